"""``WarmupCore``: batch-size warmup without a framework; ``BatchWarmup`` is its Lightning adapter."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torch.optim import Optimizer

from lit_cbs.errors import LitCBSConfigError, positive_int
from lit_cbs.rules.batch_schedules import BatchSchedule, micro_batch_for
from lit_cbs.rules.scaling import BETA2_FLOOR, LRRule, OptimizerRules, ScalingRule, get_clip_rule

__all__ = ["BatchChange", "WarmupCore", "check_divisible"]


def check_divisible(global_batch: int, micro_batch_size: int, data_parallel: int, name: str = "global batch") -> int:
    """The accumulation (micro-batches per rank and step) that makes ``global_batch`` samples, or LitCBSConfigError."""
    unit = micro_batch_size * data_parallel
    if global_batch % unit:
        lower = global_batch // unit * unit
        nearest = f"{lower} or {lower + unit}" if lower > 0 else f"{unit}"
        share = f"a micro-batch (batch_size) that divides {global_batch // data_parallel} (a rank's share)"
        ranks = f"a number of data-parallel ranks that divides {global_batch}"
        raise LitCBSConfigError(
            f"{name} {global_batch} is not a multiple of micro-batch {micro_batch_size} x data-parallel size "
            f"{data_parallel} = {unit} samples; nearest valid sizes: {nearest}: "
            f"set {name} to one of them, or use {ranks if global_batch % data_parallel else share}"
        )
    return global_batch // unit


@dataclasses.dataclass
class BatchChange:
    """One applied change of the global batch (``BatchWarmup.history``), after optimizer step ``step``; counts
    before it, all ranks. ``requested_at_*``: where it was first asked for; ``cause``: "schedule" or "guard".

    Examples:
        >>> from lit_cbs.callbacks import BatchChange
        >>> change = BatchChange(100, 0, 6400, 819200, 64, 128, 2, 4, 8, 8, 2**0.5, 6400, 819200)
        >>> change.new_global_batch // change.old_global_batch, round(change.lr_factor, 4), change.cause
        (2, 1.4142, 'schedule')
    """

    step: int
    epoch: int
    samples_seen: int
    tokens_seen: int
    old_global_batch: int
    new_global_batch: int
    old_accumulate: int
    new_accumulate: int
    old_micro_batch_size: int
    new_micro_batch_size: int
    lr_factor: float
    requested_at_samples: int
    requested_at_tokens: int
    cause: str = "schedule"
    clip_factor: float = 1.0


Batch = tuple[int, int, int]  # (global batch in samples, micro-batch in samples per rank, accumulation)
Factors = tuple[float, float]  # (LR, gradient-clipping threshold)
Counts = tuple[int, int, int, int]  # (step, epoch, samples seen, tokens seen), all ranks
_STATE = ("global_batch", "accumulate", "micro_batch_size", "lr_factor", "clip_factor")  # in state_dict as they are


class WarmupCore:
    """The batch a schedule asks for, where it may start, and the optimizer moves at each change; no framework.

    Examples:
        >>> import torch
        >>> from lit_cbs.rules.batch_schedules import PiecewiseBatch
        >>> from lit_cbs.rules.warmup_core import WarmupCore
        >>> optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        >>> core = WarmupCore(PiecewiseBatch([8, 16], [0, 32], unit="samples"), lr_rule="sqrt")  # 16 from 32 on
        >>> core.start(micro_batch_size=8)
        >>> samples = 0
        >>> for step in range(1, 7):  # train core.accumulate micro-batches of core.micro_batch_size samples, then:
        ...     samples += core.accumulate * core.micro_batch_size
        ...     optimizer.step()
        ...     change = core.after_step([optimizer], step, samples_seen=samples)
        >>> (core.history[0].step, core.global_batch, core.accumulate, round(optimizer.param_groups[0]["lr"], 4))
        (4, 16, 2, 0.1414)
    """

    def __init__(
        self,
        schedule: BatchSchedule,
        lr_rule: str | Callable[[float], float] | LRRule = "sqrt",
        max_micro_batch_size: int | None = None,
        clip_rule: str | Callable[[float], float] | ScalingRule | None = None,
        weight_decay_rule: str | None = None,
        beta2_rule: str | None = None,
        beta2_floor: float | None = BETA2_FLOOR,
    ):
        if not isinstance(schedule, BatchSchedule):
            raise LitCBSConfigError(
                f"schedule must be a lit_cbs.rules.batch_schedules schedule (ConstantBatch, PiecewiseBatch, "
                f"LinearRamp, ExponentialRamp, ...), got {schedule!r}"
            )
        self.schedule = schedule
        self.rules = OptimizerRules.build(lr_rule, weight_decay_rule, beta2_rule, beta2_floor)
        self.clip_rule = get_clip_rule(clip_rule)
        self.max_micro_batch_size = positive_int(
            "max_micro_batch_size", max_micro_batch_size, "samples per rank", optional=True
        )
        self.data_parallel_size = 1
        # Kept here, not derived from the counts: a run resumed on other ranks splits the same global batch afresh.
        self.global_batch: int | None = None
        self.micro_batch_size: int | None = None
        self.accumulate: int | None = None
        self.lr_factor = self.clip_factor = 1.0  # products of all changes' LR and clipping-threshold factors
        self.history: list[BatchChange] = []
        # ((global batch, micro-batch), samples, tokens) where the schedule first asked for the pending change
        self._requested_at: tuple[tuple[int, int], int, int] | None = None

    @property
    def lr_rule(self) -> LRRule:
        return self.rules.lr

    def start(self, micro_batch_size: int, data_parallel_size: int = 1) -> None:
        """Begin at the schedule's first batch on ``data_parallel_size`` ranks, ``micro_batch_size`` samples each."""
        positive_int("batch_size", micro_batch_size, "the micro-batch, samples per rank")
        if self.max_micro_batch_size is not None and self.max_micro_batch_size < micro_batch_size:
            raise LitCBSConfigError(
                f"max_micro_batch_size={self.max_micro_batch_size} is smaller than the datamodule's "
                f"batch_size={micro_batch_size}; raise it or lower the batch_size"
            )
        self.data_parallel_size, self.micro_batch_size = data_parallel_size, micro_batch_size
        self.check_sizes(self.schedule.sizes(0), micro_batch_size, data_parallel_size)
        self.global_batch = self.schedule.batch_size(0)
        self.micro_batch_size = self.micro_batch_for(self.global_batch)
        self.accumulate = check_divisible(self.global_batch, self.micro_batch_size, data_parallel_size)

    def consumed_at(self, samples_seen: int, tokens_seen: int) -> int:
        """What the schedule is indexed by: samples or tokens seen (all ranks)."""
        return tokens_seen if self.schedule.unit == "tokens" else samples_seen

    def micro_batch_for(self, global_batch: int) -> int:
        """The micro-batch (samples per rank) for ``global_batch`` under ``max_micro_batch_size``, else the one now."""
        if self.max_micro_batch_size is None:
            assert self.micro_batch_size is not None  # start() set it
            return self.micro_batch_size
        return micro_batch_for(global_batch, self.data_parallel_size, self.max_micro_batch_size)

    def check_sizes(
        self, sizes: Iterable[int], micro_batch_size: int, data_parallel_size: int, name: str = "scheduled global batch"
    ) -> None:
        """LitCBSConfigError unless every global batch in ``sizes`` divides into micro-batches on every rank."""
        micro = micro_batch_size if self.max_micro_batch_size is None else 1
        for size in sizes:
            check_divisible(size, micro, data_parallel_size, name)

    def wanted(self, samples_seen: int, tokens_seen: int, allowed: Callable[[int], int] | None = None) -> Batch | None:
        """The batch the schedule (and ``allowed``, a guard) asks for at these counts, or None if it is the one now."""
        target = self.schedule.batch_size(self.consumed_at(samples_seen, tokens_seen))
        if allowed is not None:
            target = allowed(target)
        micro = self.micro_batch_for(target)
        if target == self.global_batch and micro == self.micro_batch_size:
            self._requested_at = None
            return None
        if self._requested_at is None or self._requested_at[0] != (target, micro):
            self._requested_at = ((target, micro), samples_seen, tokens_seen)
        return target, micro, target // (micro * self.data_parallel_size)

    @property
    def who(self) -> str:
        """The core as its messages name it: ``BatchWarmup(lr_rule=...)``."""
        return f"BatchWarmup({self.rules.describe()})"

    def check_optimizers(
        self, optimizers: Sequence[Optimizer], schedulers: Sequence[Any], consumed: int
    ) -> list[float]:
        """LitCBSConfigError unless the rules apply at every change to come from ``consumed``; the changes' ratios."""
        assert self.global_batch is not None  # start() set it
        sizes = self.schedule.sizes(consumed)
        ratios = [b / a for a, b in zip([self.global_batch] + sizes, sizes) if a != b]
        for optimizer in optimizers:
            self.rules.check(optimizer, schedulers, ratios, self.who, compose=True)
        return ratios

    @staticmethod
    def may_change(position: int, global_batch: int) -> bool:
        """Whether a step of ``global_batch`` samples may start at ``position`` (samples of the epoch, all ranks)."""
        return position % global_batch == 0

    def scale(
        self,
        optimizers: Sequence[Optimizer],
        schedulers: Sequence[Any],
        global_batch: int,
        warn: Callable[[str], None] | None = None,
    ) -> Factors:
        """Move the optimizers for a change to ``global_batch``; its LR and clipping factors (1 if it is the same)."""
        if global_batch == self.global_batch:
            return 1.0, 1.0
        assert self.global_batch is not None  # start() set it
        ratio = global_batch / self.global_batch
        for optimizer in optimizers:
            self.rules.apply(optimizer, schedulers, ratio, warn=warn)
        return self.rules.lr.factor(ratio), self.clip_rule.factor(ratio) if self.clip_rule is not None else 1.0

    def record(
        self, new: Batch, change_factors: Factors, factors: Factors, at: Counts, cause: str = "schedule"
    ) -> BatchChange:
        """Train at ``new`` from the step after ``at`` = (step, epoch, samples, tokens) with ``factors``; its record."""
        assert self.global_batch is not None and self.micro_batch_size is not None and self.accumulate is not None
        requested = self._requested_at or (None, at[2], at[3])
        old, (lr, clip) = (self.global_batch, self.accumulate, self.micro_batch_size), change_factors
        change = BatchChange(*at, old[0], new[0], old[1], new[2], old[2], new[1], lr, *requested[1:], cause, clip)
        self.history.append(change)
        self._requested_at = None
        self.lr_factor, self.clip_factor = factors
        self.global_batch, self.micro_batch_size, self.accumulate = new
        return change

    def after_step(
        self,
        optimizers: Sequence[Optimizer],
        step: int,
        samples_seen: int,
        tokens_seen: int = 0,
        schedulers: Sequence[Any] = (),
        position: int | None = None,
        epoch: int = 0,
    ) -> BatchChange | None:
        """After optimizer step ``step`` (counts all ranks'): apply a due change (``position``: samples this epoch)."""
        new = self.wanted(samples_seen, tokens_seen)
        if new is None or not self.may_change(samples_seen if position is None else position, new[0]):
            return None
        lr, clip = self.scale(optimizers, schedulers, new[0])
        return self.record(
            new, (lr, clip), (self.lr_factor * lr, self.clip_factor * clip), (step, epoch, samples_seen, tokens_seen)
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            **{key: getattr(self, key) for key in _STATE},
            "requested_at": self._requested_at,
            "history": [dataclasses.asdict(change) for change in self.history],
            "schedule": self.schedule.state_dict() if hasattr(self.schedule, "state_dict") else None,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for key in _STATE:
            setattr(self, key, state_dict[key])
        requested_at = state_dict["requested_at"]
        self._requested_at = None if requested_at is None else (tuple(requested_at[0]), *requested_at[1:])
        self.history = [BatchChange(**change) for change in state_dict["history"]]
        if state_dict["schedule"] is not None:  # saved by a schedule with a state (CBSAdaptive)
            if not hasattr(self.schedule, "load_state_dict"):
                raise LitCBSConfigError(
                    f"the checkpoint holds the state of a closed-loop batch schedule, but this run's {self.schedule!r} "
                    "keeps none: resume with the checkpoint's schedule"
                )
            self.schedule.load_state_dict(state_dict["schedule"])
