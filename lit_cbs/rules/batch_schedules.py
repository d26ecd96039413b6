"""Global batch schedules: samples or tokens consumed (``unit``) -> global batch (samples). No Lightning."""

from __future__ import annotations

import bisect
import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from lit_cbs.errors import LitCBSConfigError, one_of, positive_int

__all__ = ["BatchSchedule", "CBSAdaptive", "ConstantBatch", "ExponentialRamp", "LinearRamp", "PiecewiseBatch", "Seesaw"]


_samples = functools.partial(positive_int, unit="samples")


def micro_batch_for(global_batch: int, data_parallel_size: int, max_micro_batch_size: int) -> int:
    """The largest divisor of a rank's share of ``global_batch`` up to ``max_micro_batch_size`` (samples)."""
    share = global_batch // data_parallel_size
    return max(m for m in range(1, min(max_micro_batch_size, share) + 1) if share % m == 0)


class BatchSchedule(ABC):
    """Base of ``BatchWarmup(schedule=...)``: ``unit`` ("samples" or "tokens") is what ``consumed`` counts."""

    def __init__(self, unit: str) -> None:
        self.unit = str(one_of("unit", unit, ("samples", "tokens")))

    def batch_size(self, consumed: int) -> int:
        """Global batch (samples) once ``consumed`` samples or tokens were trained on."""
        if consumed < 0:
            raise ValueError(f"consumed={consumed} must be >= 0")
        return self._batch_size(consumed)

    @abstractmethod
    def _batch_size(self, consumed: int) -> int: ...

    @abstractmethod
    def sizes(self, consumed: int = 0) -> list[int]:
        """Every global batch (samples) this schedule can return from ``consumed`` on, ascending."""

    @property
    def is_constant(self) -> bool:
        return len(self.sizes()) == 1

    def withdraw_above(self, batch_size: int) -> None:
        """The guard reverted an increase to ``batch_size``: forget decisions above it (a fixed schedule made none)."""
        return None

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


class ConstantBatch(BatchSchedule):
    """The same global batch (samples) throughout: the control run, with BatchWarmup's logging.

    Examples:
        >>> ConstantBatch(256).batch_size(1_000_000), ConstantBatch(256).is_constant
        (256, True)
    """

    def __init__(self, batch_size: int, unit: str = "samples"):
        self.size = _samples("batch_size", batch_size)
        super().__init__(unit)

    def _batch_size(self, consumed: int) -> int:
        return self.size

    def sizes(self, consumed: int = 0) -> list[int]:
        return [self.size]


class PiecewiseBatch(BatchSchedule):
    """``batch_sizes[i]`` samples from ``thresholds[i]`` (``unit``; 0, then increasing) consumed on (OLMo-core style).

    Examples:
        >>> schedule = PiecewiseBatch([1024, 2048, 4096], [0, 168_000_000_000, 503_000_000_000])
        >>> schedule.batch_size(200_000_000_000), schedule.sizes(200_000_000_000)
        (2048, [2048, 4096])
    """

    def __init__(self, batch_sizes: Sequence[int], thresholds: Sequence[int], unit: str = "tokens"):
        batch_sizes, thresholds = list(batch_sizes), list(thresholds)
        if not batch_sizes:
            raise LitCBSConfigError("batch_sizes is empty; give at least one global batch size (samples)")
        if len(batch_sizes) != len(thresholds):
            raise LitCBSConfigError(
                f"batch_sizes has {len(batch_sizes)} entries but thresholds has {len(thresholds)}; "
                "give one threshold (where each size starts) per batch size"
            )
        for i, b in enumerate(batch_sizes):
            _samples(f"batch_sizes[{i}]", b)
        if thresholds[0] != 0:
            raise LitCBSConfigError(f"thresholds[0]={thresholds[0]} must be 0: the first size applies from the start")
        for i, (before, at) in enumerate(zip(thresholds, thresholds[1:]), start=1):
            if not at > before:
                raise LitCBSConfigError(
                    f"thresholds must strictly increase, but thresholds[{i}]={at} <= thresholds[{i - 1}]={before}"
                )
        self.batch_sizes, self.thresholds = batch_sizes, thresholds
        super().__init__(unit)

    def _batch_size(self, consumed: int) -> int:
        return self.batch_sizes[bisect.bisect_right(self.thresholds, consumed) - 1]

    def sizes(self, consumed: int = 0) -> list[int]:
        return sorted(set(self.batch_sizes[bisect.bisect_right(self.thresholds, consumed) - 1 :]))


class Seesaw(PiecewiseBatch):
    """Seesaw (Meterez et al. 2025): the batch grows by ``factor`` (from ``start`` up to ``max_batch_size`` samples)
    where ``lr_schedule`` (tokens -> LR multiplier) first falls to 1/factor, 1/factor**2, ... of its peak. Run it
    under ``BatchWarmup(lr_rule="sqrt")`` (Adam; SGD: "none") with the same LR schedule.

    Examples:
        >>> from lit_cbs.rules.lr_schedules import CosineSchedule
        >>> Seesaw(CosineSchedule(warmup_tokens=0, total_tokens=1_000_000), start=64, max_batch_size=256).thresholds
        [0, 535441, 732280]
    """

    def __init__(
        self,
        lr_schedule: Callable[[int], float],
        start: int,
        max_batch_size: int,
        factor: int = 2,
        total_tokens: int | None = None,
    ):
        if not callable(lr_schedule):
            raise LitCBSConfigError(f"lr_schedule must be callable tokens -> LR multiplier, got {lr_schedule!r}")
        start, max_batch_size = _samples("start", start), _samples("max_batch_size", max_batch_size)
        if isinstance(factor, bool) or not isinstance(factor, int) or factor < 2:
            raise LitCBSConfigError(f"factor={factor!r} must be an int >= 2 (2: the batch doubles where the LR halves)")
        if max_batch_size < start * factor:
            raise LitCBSConfigError(
                f"max_batch_size={max_batch_size} is below start x factor = {start * factor}, so the batch could never "
                "grow: raise max_batch_size, or use ConstantBatch"
            )
        total = total_tokens if total_tokens is not None else getattr(lr_schedule, "total_tokens", None)
        total = positive_int("total_tokens", total, "tokens (or an lr_schedule with total_tokens)")
        first = getattr(lr_schedule, "warmup_tokens", 0)
        peak = lr_schedule(first)
        sample = [lr_schedule(first + (total - first) * i // 256) for i in range(257)]
        if not (peak > 0 and all(later <= earlier * (1 + 1e-12) for earlier, later in zip(sample, sample[1:]))):
            raise LitCBSConfigError(
                f"Seesaw needs an LR schedule that only decays after its warmup ({first:,} tokens), "
                f"but {lr_schedule!r} rises again: use CosineSchedule, WarmupStableDecay or StepDecay"
            )
        sizes, thresholds = [start], [0]
        size, level = start * factor, peak / factor
        while size <= max_batch_size and lr_schedule(total) <= level:
            low = first + bisect.bisect_left(range(first, total), True, key=lambda tokens: lr_schedule(tokens) <= level)
            keep = len(sizes) - (low == thresholds[-1])  # a step decay past several levels at once: one larger growth
            sizes, thresholds = [*sizes[:keep], size], [*thresholds[:keep], low]
            size, level = size * factor, level / factor
        if len(sizes) == 1:
            raise LitCBSConfigError(
                f"{lr_schedule!r} never falls to 1/{factor} of its peak before {total:,} tokens, so Seesaw would never "
                "grow the batch: give an LR schedule that decays (lr_schedule=cosine, or wsd with decay_tokens > 0)"
            )
        super().__init__(sizes, thresholds, unit="tokens")
        self.lr_schedule, self.start, self.max_batch_size, self.factor = lr_schedule, start, max_batch_size, factor


def _ramp_checks(start: int, final: int, ramp: int, unit: str, step: tuple[str, int]) -> None:
    for name, value in (("start", start), ("final", final), step):
        _samples(name, value)
    positive_int("ramp", ramp, f"{unit} over which the batch grows")
    if final <= start:
        raise LitCBSConfigError(f"final={final} must be larger than start={start}; use ConstantBatch otherwise")


class LinearRamp(BatchSchedule):
    """Megatron-LM's ``--rampup-batch-size START INCR RAMP``: from ``start``, ``increment`` samples more at
    each of the equal parts of ``ramp`` (``unit``), ``final`` after it; Megatron's float arithmetic.

    Examples:
        >>> schedule = LinearRamp(start=32, increment=32, ramp=3000, final=128)
        >>> [schedule.batch_size(consumed) for consumed in (0, 999, 1000, 2999, 3001)]
        [32, 32, 64, 96, 128]
    """

    def __init__(self, start: int, increment: int, ramp: int, final: int, unit: str = "samples"):
        _ramp_checks(start, final, ramp, unit, ("increment", increment))
        if (final - start) % increment:
            lower = start + (final - start) // increment * increment
            raise LitCBSConfigError(
                f"final - start = {final - start} must be a multiple of increment={increment} (Megatron's rule); "
                f"e.g. final={lower} or {lower + increment}"
            )
        self.start, self.increment, self.ramp, self.final = start, increment, ramp, final
        super().__init__(unit)
        self._per_increment = ramp / ((final - start) // increment)

    def _batch_size(self, consumed: int) -> int:
        return self.final if consumed > self.ramp else self.start + int(consumed / self._per_increment) * self.increment

    def sizes(self, consumed: int = 0) -> list[int]:
        return list(range(self.batch_size(consumed), self.final + 1, self.increment))


class ExponentialRamp(BatchSchedule):
    """Geometric growth from ``start`` to ``final`` over ``ramp`` consumed: start * (final/start) **
    (consumed/ramp), rounded down to a multiple of ``multiple_of`` samples (micro-batch x world size).

    Examples:
        >>> schedule = ExponentialRamp(start=64, final=512, ramp=3_000_000, multiple_of=32)
        >>> [schedule.batch_size(tokens) for tokens in (0, 1_000_000, 2_000_000, 3_000_000)]
        [64, 128, 256, 512]
    """

    def __init__(self, start: int, final: int, ramp: int, unit: str = "tokens", multiple_of: int = 1):
        _ramp_checks(start, final, ramp, unit, ("multiple_of", multiple_of))
        for name, v in (("start", start), ("final", final)):
            if v % multiple_of:
                nearest = f"{v // multiple_of * multiple_of or multiple_of} or {(v // multiple_of + 1) * multiple_of}"
                raise LitCBSConfigError(
                    f"{name}={v} must be a multiple of multiple_of={multiple_of}; nearest: {nearest}"
                )
        self.start, self.final, self.ramp, self.multiple_of = start, final, ramp, multiple_of
        super().__init__(unit)

    def _batch_size(self, consumed: int) -> int:
        if consumed >= self.ramp:
            return self.final
        exact = self.start * (self.final / self.start) ** (consumed / self.ramp)
        rounded = int(math.floor(exact / self.multiple_of + 1e-9)) * self.multiple_of
        return min(self.final, max(self.start, rounded))

    def sizes(self, consumed: int = 0) -> list[int]:
        return list(range(self.batch_size(consumed), self.final + 1, self.multiple_of))


class CBSAdaptive(BatchSchedule):
    """Closed loop (Merrill et al. 2025): double the batch, up to ``final``, once a CBS reading (``observe``, from
    ``CBSProbeCallback``) reaches ``factor`` x the batch; at ``final`` the probe stops unless ``probe_after_final``.

    Examples:
        >>> schedule = CBSAdaptive(start=64, final=256)
        >>> schedule.observe(1000, cbs=100.0), schedule.observe(2000, cbs=130.0), schedule.sizes(2000)  # 130 >= 2 x 64
        (False, True, [128, 256])
    """

    def __init__(
        self, start: int, final: int, factor: float = 2.0, unit: str = "tokens", probe_after_final: bool = False
    ):
        _samples("start", start), _samples("final", final)
        if final < start:
            raise LitCBSConfigError(f"final={final} must be >= start={start}")
        doublings = math.log2(final / start)
        if abs(doublings - round(doublings)) > 1e-9:
            raise LitCBSConfigError(
                f"final={final} must be start={start} times a power of 2 (the batch doubles); "
                f"nearest: {start * 2 ** math.floor(doublings)} or {start * 2 ** math.ceil(doublings)}"
            )
        if not factor >= 1:
            raise LitCBSConfigError(f"factor={factor} must be >= 1 (double once the CBS is factor x the batch)")
        self.start, self.final, self.factor = start, final, float(factor)
        self.probe_after_final = bool(probe_after_final)
        super().__init__(unit)
        self.decisions: list[tuple[int, int]] = []  # (consumed, new global batch), in order

    def _batch_size(self, consumed: int) -> int:
        return next((size for at, size in reversed(self.decisions) if consumed >= at), self.start)

    def sizes(self, consumed: int = 0) -> list[int]:
        size = self.batch_size(consumed)
        return [size * 2**i for i in range(round(math.log2(self.final / size)) + 1)]

    def wants_readings(self, consumed: int) -> bool:
        """Whether a reading at ``consumed`` could still move the batch (or ``probe_after_final``)."""
        return self.probe_after_final or self.batch_size(consumed) < self.final

    def observe(self, consumed: int, cbs: float) -> bool:
        """Record a CBS reading (samples) made at ``consumed``; True if the batch doubles from there."""
        current = self.batch_size(consumed)
        if cbs >= self.factor * current and current * 2 <= self.final:
            self.decisions.append((consumed, current * 2))
            return True
        return False

    def withdraw_above(self, batch_size: int) -> None:
        self.decisions = [d for d in self.decisions if d[1] <= batch_size]

    def state_dict(self) -> dict[str, Any]:
        return {"decisions": [list(d) for d in self.decisions]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.decisions = [(at, size) for at, size in state_dict["decisions"]]
