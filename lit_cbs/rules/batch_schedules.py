"""Global batch-size schedules: amount consumed (samples or tokens) -> global batch (samples).

Pure Python, no Lightning. Every schedule has ``unit`` ("samples" or "tokens": what ``consumed``
counts) and ``batch_size(consumed) -> int``, the global batch in samples (sequences) to use once
``consumed`` samples or tokens have been trained on. ``sizes(consumed)`` lists every batch size
the schedule can still return from ``consumed`` on, so a trainer can check them all before the
first step and pick a micro-batch that divides every size still to come.
"""

from __future__ import annotations

import bisect
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence

from lit_cbs.errors import LitCBSConfigError, one_of, positive_int

__all__ = [
    "BatchSchedule",
    "CBSAdaptive",
    "ConstantBatch",
    "ExponentialRamp",
    "LinearRamp",
    "PiecewiseBatch",
    "Seesaw",
]

UNITS = ("samples", "tokens")


def _check_unit(unit: str) -> str:
    return one_of("unit", unit, UNITS)


def _check_positive_int(name: str, value) -> int:
    return positive_int(name, value, "samples")


def _check_ramp(ramp, unit: str) -> None:
    positive_int("ramp", ramp, f"{unit} over which the batch grows")


def _check_consumed(consumed) -> None:
    if consumed < 0:
        raise ValueError(f"consumed={consumed} must be >= 0")


def micro_batch_for(global_batch: int, data_parallel_size: int, max_micro_batch_size: int) -> int:
    """The micro-batch (samples per rank) BatchWarmup trains ``global_batch`` with when it grows the
    micro-batch: the largest divisor of a rank's share (global batch / ranks) up to
    ``max_micro_batch_size``; the accumulation makes up the rest.

    Examples:
        >>> micro_batch_for(96, data_parallel_size=2, max_micro_batch_size=16)  # 48 per rank: 3 rounds of 16
        16
        >>> micro_batch_for(80, data_parallel_size=2, max_micro_batch_size=16)  # 40 per rank: 4 rounds of 10
        10
    """
    share = global_batch // data_parallel_size
    return max(m for m in range(1, min(max_micro_batch_size, share) + 1) if share % m == 0)


class BatchSchedule(ABC):
    """Base class: subclasses set ``unit`` and implement ``batch_size`` and ``sizes``.

    ``BatchWarmup(schedule=...)`` takes any subclass: it asks ``batch_size`` at every step, and ``sizes``
    before training, to check each size against the data-parallel size and the micro-batch.

    Attributes:
        unit: what ``consumed`` counts: ``"samples"`` or ``"tokens"``.

    Examples:
        A minimal subclass, doubling the batch every million tokens up to 256 samples:

        >>> class DoublingPerMillion(BatchSchedule):
        ...     unit = "tokens"
        ...     def batch_size(self, consumed):
        ...         return 64 * 2 ** min(consumed // 1_000_000, 2)
        ...     def sizes(self, consumed=0):
        ...         return [size for size in (64, 128, 256) if size >= self.batch_size(consumed)]
        >>> schedule = DoublingPerMillion()
        >>> schedule.batch_size(500_000), schedule.batch_size(2_500_000), schedule.sizes(1_200_000)
        (64, 256, [128, 256])
        >>> schedule.is_constant, schedule
        (False, DoublingPerMillion())
    """

    unit: str

    @abstractmethod
    def batch_size(self, consumed: int) -> int:
        """Global batch (samples) once ``consumed`` samples or tokens (``unit``) were trained on."""

    @abstractmethod
    def sizes(self, consumed: int = 0) -> list[int]:
        """Every global batch size (samples) this schedule can return from ``consumed`` on, ascending."""

    @property
    def is_constant(self) -> bool:
        """Whether the schedule returns one batch size throughout (``sizes()`` has one)."""
        return len(self.sizes()) == 1

    def withdraw_above(self, batch_size: int) -> None:
        """BatchWarmup's guard reverted an increase to ``batch_size`` (samples): forget any decision of
        this schedule that moved the batch above it. A schedule fixed in advance made none."""
        return None

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


class ConstantBatch(BatchSchedule):
    """The same global batch (samples) throughout: the control run, with BatchWarmup's logging.

    Args:
        batch_size: the global batch (samples).
        unit: what ``consumed`` counts: ``"samples"`` or ``"tokens"``.

    Raises:
        LitCBSConfigError: ``batch_size`` is not a positive int, or ``unit`` is unknown.

    Examples:
        >>> schedule = ConstantBatch(256)
        >>> schedule.batch_size(1_000_000), schedule.sizes(), schedule.is_constant
        (256, [256], True)
    """

    def __init__(self, batch_size: int, unit: str = "samples"):
        self.size = _check_positive_int("batch_size", batch_size)
        self.unit = _check_unit(unit)

    def batch_size(self, consumed: int) -> int:
        _check_consumed(consumed)
        return self.size

    def sizes(self, consumed: int = 0) -> list[int]:
        return [self.size]


class PiecewiseBatch(BatchSchedule):
    """``batch_sizes[i]`` samples from ``thresholds[i]`` consumed on (OLMo-core style).

    ``thresholds`` are in ``unit`` (samples or tokens), start at 0 and strictly increase. Covers
    the doubling schedule of Merrill et al. 2025 (1024 -> 2048 at 168B tokens -> 4096 at 503B
    tokens) and Qwen3-style growth (Zhou et al. 2026: 2M -> 4M -> 5M -> 6M tokens per batch).

    Args:
        batch_sizes: the global batch (samples) of each phase.
        thresholds: where each phase starts (``unit``); 0 first, strictly increasing, one per batch size.
        unit: what ``thresholds`` and ``consumed`` count: ``"tokens"`` or ``"samples"``.

    Raises:
        LitCBSConfigError: no batch sizes, a size that is not a positive int, a threshold count that does
            not match, a first threshold other than 0, thresholds that do not strictly increase, or an
            unknown ``unit``.

    Examples:
        Merrill et al. 2025's doubling schedule:

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
            _check_positive_int(f"batch_sizes[{i}]", b)
        if thresholds[0] != 0:
            raise LitCBSConfigError(
                f"thresholds[0]={thresholds[0]} must be 0: the first batch size applies from the start"
            )
        for i in range(1, len(thresholds)):
            if not thresholds[i] > thresholds[i - 1]:
                raise LitCBSConfigError(
                    f"thresholds must strictly increase, but thresholds[{i}]={thresholds[i]} <= "
                    f"thresholds[{i - 1}]={thresholds[i - 1]}"
                )
        self.batch_sizes = batch_sizes
        self.thresholds = thresholds
        self.unit = _check_unit(unit)

    def batch_size(self, consumed: int) -> int:
        _check_consumed(consumed)
        return self.batch_sizes[bisect.bisect_right(self.thresholds, consumed) - 1]

    def sizes(self, consumed: int = 0) -> list[int]:
        start = bisect.bisect_right(self.thresholds, consumed) - 1
        return sorted(set(self.batch_sizes[start:]))


class Seesaw(PiecewiseBatch):
    """Seesaw (Meterez et al. 2025): turn an LR schedule's decay into batch growth.

    Wherever ``lr_schedule`` (tokens -> LR multiplier, ``lit_cbs.rules.lr_schedules``) first falls to
    1 / factor, 1 / factor**2, ... of its peak after its warmup, the global batch grows by ``factor``,
    from ``start`` up to ``max_batch_size`` samples. Run it under ``BatchWarmup(lr_rule="sqrt")`` with
    the same LR schedule: at each such point the schedule divides the LR by ``factor`` and the
    rule multiplies it by sqrt(factor), so where the schedule alone would halve the LR, the batch
    doubles and the LR falls by 1 / sqrt(2) (the paper's rule for Adam; for SGD, where a doubled
    batch is worth a halved LR, use lr_rule="none"). In between, and once the batch has reached
    ``max_batch_size``, the LR follows the schedule as before: LR(t) = base x schedule(t) x
    sqrt(factor) ** (growths so far).

    It is a ``PiecewiseBatch`` in tokens whose thresholds come from the LR schedule, so a change
    is applied like any other (at an aligned step, resumable, on any number of ranks).

    Args:
        lr_schedule: the LR multiplier as a function of tokens, non-increasing after its warmup
            (``warmup_tokens``, if it has one); ``CosineSchedule``, ``WarmupStableDecay`` with a decay,
            ``StepDecay``.
        start: the global batch (samples) before the decay.
        max_batch_size: the batch cap (samples); growth stops at the largest start x factor**j at or below it.
        factor: how much the LR falls per growth, and the batch grows (2: Seesaw's halving).
        total_tokens: where to stop looking for the decay; default ``lr_schedule.total_tokens``.

    Raises:
        LitCBSConfigError: ``lr_schedule`` is not callable or rises again after its warmup, ``start`` or
            ``max_batch_size`` is not a positive int, ``factor`` is not an int >= 2, ``max_batch_size`` is
            below ``start * factor``, there is no ``total_tokens``, or the LR never falls to 1 / ``factor``.

    Examples:
        A cosine over 1M tokens falls to 1/2 of its peak at half the run, to 1/4 later:

        >>> from lit_cbs.rules.lr_schedules import CosineSchedule
        >>> schedule = Seesaw(CosineSchedule(warmup_tokens=0, total_tokens=1_000_000), start=64, max_batch_size=256)
        >>> schedule.batch_sizes, schedule.thresholds
        ([64, 128, 256], [0, 535441, 732280])
    """

    def __init__(self, lr_schedule, start: int, max_batch_size: int, factor: int = 2, total_tokens: int | None = None):
        if not callable(lr_schedule):
            raise LitCBSConfigError(f"lr_schedule must be callable tokens -> LR multiplier, got {lr_schedule!r}")
        start = _check_positive_int("start", start)
        max_batch_size = _check_positive_int("max_batch_size", max_batch_size)
        if isinstance(factor, bool) or not isinstance(factor, int) or factor < 2:
            raise LitCBSConfigError(
                f"factor={factor!r} must be an int >= 2 (2: the batch doubles where the LR would halve)"
            )
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
        while size <= max_batch_size:
            at = _first_token_at_or_below(lr_schedule, level, first, total)
            if at is None:
                break
            if at == thresholds[-1]:  # a step decay past several levels at once: one larger growth
                sizes[-1] = size
            else:
                sizes.append(size)
                thresholds.append(at)
            size, level = size * factor, level / factor
        if len(sizes) == 1:
            raise LitCBSConfigError(
                f"{lr_schedule!r} never falls to 1/{factor} of its peak before {total:,} tokens, "
                "so Seesaw would never grow the batch: "
                "give an LR schedule that decays (lr_schedule=cosine, or wsd with decay_tokens > 0)"
            )
        super().__init__(sizes, thresholds, unit="tokens")
        self.lr_schedule, self.start, self.max_batch_size, self.factor = lr_schedule, start, max_batch_size, factor


def _first_token_at_or_below(schedule, level: float, low: int, high: int) -> int | None:
    """The first token count in [low, high] where the non-increasing ``schedule`` is <= ``level``, or None."""
    if schedule(high) > level:
        return None
    while low < high:
        middle = (low + high) // 2
        low, high = (middle + 1, high) if schedule(middle) > level else (low, middle)
    return low


class LinearRamp(BatchSchedule):
    """Megatron-LM ``--rampup-batch-size START INCR RAMP`` (GPT-3 style linear ramp).

    batch = start + floor(consumed / per_increment) * increment while consumed <= ramp, with
    per_increment = ramp / ((final - start) / increment) (= ramp * increment / (final - start));
    ``final`` once more than ``ramp`` was consumed. The same float arithmetic as Megatron-LM, so
    both switch at the same sample. Megatron counts samples; ``unit="tokens"`` reads ``ramp`` in
    tokens instead.

    Args:
        start: the first global batch (samples).
        increment: the batch's growth at each step of the ramp (samples).
        ramp: how much is consumed (``unit``) until the batch reaches ``final``.
        final: the global batch (samples) after the ramp; ``final - start`` a multiple of ``increment``.
        unit: what ``ramp`` and ``consumed`` count: ``"samples"`` or ``"tokens"``.

    Raises:
        LitCBSConfigError: a size or ``ramp`` that is not a positive int, ``final <= start``, ``final -
            start`` not a multiple of ``increment``, or an unknown ``unit``.

    Examples:
        >>> schedule = LinearRamp(start=32, increment=32, ramp=3000, final=128)
        >>> [schedule.batch_size(consumed) for consumed in (0, 999, 1000, 2999, 3001)]
        [32, 32, 64, 96, 128]
        >>> schedule.sizes()
        [32, 64, 96, 128]
    """

    def __init__(self, start: int, increment: int, ramp: int, final: int, unit: str = "samples"):
        _check_positive_int("start", start)
        _check_positive_int("increment", increment)
        _check_positive_int("final", final)
        _check_ramp(ramp, unit)
        if final <= start:
            raise LitCBSConfigError(
                f"final={final} must be larger than start={start} for a ramp; use ConstantBatch otherwise"
            )
        if (final - start) % increment:
            raise LitCBSConfigError(
                f"final - start = {final - start} must be a multiple of increment={increment} (Megatron's rule); "
                f"e.g. final={start + (final - start) // increment * increment} or "
                f"{start + ((final - start) // increment + 1) * increment}"
            )
        self.start, self.increment, self.ramp, self.final = start, increment, ramp, final
        self.unit = _check_unit(unit)
        self._per_increment = ramp / ((final - start) // increment)

    def batch_size(self, consumed: int) -> int:
        _check_consumed(consumed)
        if consumed > self.ramp:
            return self.final
        return self.start + int(consumed / self._per_increment) * self.increment

    def sizes(self, consumed: int = 0) -> list[int]:
        return list(range(self.batch_size(consumed), self.final + 1, self.increment))


class ExponentialRamp(BatchSchedule):
    """Geometric growth from ``start`` to ``final`` over ``ramp`` consumed.

    The exact size start * (final/start) ** (consumed/ramp) is rounded down to a multiple of
    ``multiple_of`` (samples; give micro-batch x world size so every size is reachable) and
    never falls below ``start`` nor rises above ``final``; ``final`` from ``ramp`` on.

    Args:
        start: the first global batch (samples), a multiple of ``multiple_of``.
        final: the global batch (samples) from ``ramp`` on, a multiple of ``multiple_of``.
        ramp: how much is consumed (``unit``) until the batch reaches ``final``.
        unit: what ``ramp`` and ``consumed`` count: ``"tokens"`` or ``"samples"``.
        multiple_of: every size is a multiple of it (samples).

    Raises:
        LitCBSConfigError: a size or ``ramp`` that is not a positive int, ``final <= start``, ``start`` or
            ``final`` not a multiple of ``multiple_of``, or an unknown ``unit``.

    Examples:
        >>> schedule = ExponentialRamp(start=64, final=512, ramp=3_000_000, multiple_of=32)
        >>> [schedule.batch_size(tokens) for tokens in (0, 1_000_000, 2_000_000, 3_000_000)]
        [64, 128, 256, 512]
    """

    def __init__(self, start: int, final: int, ramp: int, unit: str = "tokens", multiple_of: int = 1):
        _check_positive_int("start", start)
        _check_positive_int("final", final)
        _check_positive_int("multiple_of", multiple_of)
        _check_ramp(ramp, unit)
        if final <= start:
            raise LitCBSConfigError(f"final={final} must be larger than start={start}; use ConstantBatch otherwise")
        for name, v in (("start", start), ("final", final)):
            if v % multiple_of:
                raise LitCBSConfigError(
                    f"{name}={v} must be a multiple of multiple_of={multiple_of}; "
                    f"nearest: {v // multiple_of * multiple_of or multiple_of} "
                    f"or {(v // multiple_of + 1) * multiple_of}"
                )
        self.start, self.final, self.ramp, self.multiple_of = start, final, ramp, multiple_of
        self.unit = _check_unit(unit)

    def batch_size(self, consumed: int) -> int:
        _check_consumed(consumed)
        if consumed >= self.ramp:
            return self.final
        exact = self.start * (self.final / self.start) ** (consumed / self.ramp)
        rounded = int(math.floor(exact / self.multiple_of + 1e-9)) * self.multiple_of
        return min(self.final, max(self.start, rounded))

    def sizes(self, consumed: int = 0) -> list[int]:
        # Sizes grow monotonically through every multiple between here and final.
        return list(range(self.batch_size(consumed), self.final + 1, self.multiple_of))


class CBSAdaptive(BatchSchedule):
    """Closed-loop batch warmup: double the batch when the measured CBS reaches ``factor`` x the batch.

    Merrill et al. 2025 (arXiv 2505.23971) double the batch, with the LR times sqrt(2),
    once the CBS exceeds twice the current batch; they read the thresholds off a CBS curve by
    hand. Here ``CBSProbeCallback`` calls ``observe`` with each measurement (the lower end of its
    CBS interval, k* x B, in samples), and the schedule doubles at most once per measurement,
    never past ``final``. ``batch_size(consumed)`` replays the recorded decisions, so it is a
    deterministic function of consumed and survives a resume through ``state_dict``.

    Once the batch is at ``final`` no reading can change it, so the probe stops probing there
    (``probe_after_final=True`` keeps measuring, e.g. to draw the CBS curve on).

    Args:
        start: the first global batch (samples).
        final: the largest global batch (samples): ``start`` times a power of 2.
        factor: the batch doubles once a CBS reading is at least ``factor`` x the batch (>= 1).
        unit: what ``consumed`` counts: ``"tokens"`` or ``"samples"``.
        probe_after_final: keep asking for readings once the batch is at ``final``.

    Raises:
        LitCBSConfigError: a size that is not a positive int, ``final < start``, ``final`` not ``start``
            times a power of 2, ``factor < 1``, or an unknown ``unit``.

    Examples:
        >>> schedule = CBSAdaptive(start=64, final=256)
        >>> schedule.observe(1000, cbs=100.0), schedule.observe(2000, cbs=130.0)  # 130 >= 2 x 64: double
        (False, True)
        >>> schedule.batch_size(1999), schedule.batch_size(2000), schedule.sizes(2000)
        (64, 128, [128, 256])
        >>> schedule.state_dict()
        {'decisions': [[2000, 128]]}
    """

    def __init__(
        self, start: int, final: int, factor: float = 2.0, unit: str = "tokens", probe_after_final: bool = False
    ):
        _check_positive_int("start", start)
        _check_positive_int("final", final)
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
        self.unit = _check_unit(unit)
        self.decisions: list[tuple[int, int]] = []  # (consumed, new global batch), in order

    def batch_size(self, consumed: int) -> int:
        _check_consumed(consumed)
        size = self.start
        for at, new_size in self.decisions:
            if consumed >= at:
                size = new_size
        return size

    def sizes(self, consumed: int = 0) -> list[int]:
        size, sizes = self.batch_size(consumed), []
        while size <= self.final:
            sizes.append(size)
            size *= 2
        return sizes

    def wants_readings(self, consumed: int) -> bool:
        """Whether a CBS reading at ``consumed`` could still move the batch (or ``probe_after_final``)."""
        return self.probe_after_final or self.batch_size(consumed) < self.final

    def observe(self, consumed: int, cbs: float) -> bool:
        """Record a CBS measurement made at ``consumed``; return True if the batch doubles.

        Args:
            consumed: samples or tokens (``unit``) trained on when the reading was made.
            cbs: the measured critical batch size (samples).

        Returns:
            Whether the batch doubles from ``consumed`` on.
        """
        current = self.batch_size(consumed)
        if cbs >= self.factor * current and current * 2 <= self.final:
            self.decisions.append((consumed, current * 2))
            return True
        return False

    def withdraw_above(self, batch_size: int) -> None:
        """Forget every decision that moved the batch above ``batch_size`` (samples): BatchWarmup's
        guard reverted that increase, so the batch doubles again only on a new measurement."""
        self.decisions = [d for d in self.decisions if d[1] <= batch_size]

    def state_dict(self) -> dict:
        return {"decisions": [list(d) for d in self.decisions]}

    def load_state_dict(self, state_dict: dict) -> None:
        self.decisions = [tuple(d) for d in state_dict["decisions"]]
