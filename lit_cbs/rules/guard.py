"""``BatchGuard``: undo a batch increase after which the training loss rises above its trend.

An increase that comes too early (a batch above what the model can use yet) shows as a training
loss that falls behind where it was heading: at the same tokens it is higher than the trend of the
stretch before the change predicts. After each increase the guard:

1. fits the trend: the per-step training loss of the last stretch before the change (``fit``,
   default the second half of what was consumed before it) by least squares as
   ``a + b * ln(consumed)``;
2. watches a span after the change (``watch_span``, default a quarter of what was consumed before
   it) and averages the loss's distance from the extrapolated trend over the span's steps: the
   rise, in nats;
3. reverts to the previous batch if the rise exceeds the threshold: ``threshold`` if given, else
   ``noise_multiple`` x the standard deviation of the per-step loss around the trend before the
   change (the loss's own noise), and at least ``min_threshold``. The per-step spread, not the
   standard error of the span's mean: the trend's extrapolation error does not average out over
   a span, and on healthy runs it reaches a good part of that spread early in training.

Everything is measured in consumed samples or tokens, the schedule's unit, never in steps: a larger
batch takes fewer steps per token, so only at equal tokens are the two batches comparable. Spans
default to fractions of what was consumed before the change because loss curves are close to
linear in log tokens: the same settings then suit a run of millions of tokens and one of trillions.
After a revert, no increase is made for ``hold`` (default: as much as was consumed before the
revert, so the next try comes at twice the tokens), and while an increase is watched the next one
waits for its verdict, so every increase is judged on its own (a schedule that itself lowers the
batch inside a watch span ends the watch without a verdict).

Each step's loss is the mean of its micro-batches' losses; the guard keeps (consumed, loss) per
optimizer step of the stretch a future fit may need (with the default ``fit``, the last half of the
run's steps; they are in the checkpoint too), and averages the losses over ranks at each verdict, so
every rank decides alike. The settings are a ``GuardConfig``. The pure parts (``loss_rise``) need no
Lightning; ``BatchWarmup(guard=...)`` applies the verdicts and hands the guard, at each increase, a
``RevertRestore``: what a revert of it puts back.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from lit_cbs.errors import LitCBSConfigError, positive_int, positive_number

__all__ = [
    "BatchGuard",
    "GuardConfig",
    "GuardVerdict",
    "RevertRestore",
    "fit_trend",
    "loss_rise",
]

_SPAN = "samples or tokens, the schedule's unit"


@dataclasses.dataclass
class GuardConfig:
    """The guard's settings: ``BatchGuard(GuardConfig(...))``, ``BatchWarmup(guard=GuardConfig(...))``
    or the same as a dict (``batch.guard`` in the recipes). Spans are in the schedule's unit
    (tokens, or samples for a schedule in samples), counted from the change. Each field's docstring
    below gives its meaning, unit and default.

    Raises:
        LitCBSConfigError: a span that is not a positive int or None, a threshold or multiple that is
            not a finite number > 0, or ``min_steps`` below 3.

    Examples:
        >>> GuardConfig(watch_span=1_000_000, hold=4_000_000).watch_span
        1000000
        >>> GuardConfig(min_steps=2)
        Traceback (most recent call last):
        ...
        lit_cbs.errors.LitCBSConfigError: guard.min_steps=2 must be >= 3 (a line through 2 points ...)
    """

    watch_span: int | None = None
    """Samples or tokens trained after an increase before it is judged. None: a quarter of what was
    consumed before the increase."""

    fit: int | None = None
    """Samples or tokens before the increase whose loss trend is extrapolated. None: half of what was
    consumed before it (the trend of its second half). Steps of a reverted watch span are left out
    of later fits."""

    hold: int | None = None
    """Samples or tokens after a revert during which no increase is made. None: as much as was
    consumed before the revert (the next try comes at twice the tokens)."""

    threshold: float | None = None
    """Nats of training loss: revert when the loss over the watch span is on average more than this
    above the trend. None: ``noise_multiple`` x the per-step loss's standard deviation around the
    trend before the change, and at least ``min_threshold``."""

    noise_multiple: float = 2.0
    """Standard deviations of the per-step loss around the trend (> 0), for the default threshold."""

    min_threshold: float = 0.05
    """Nats of training loss: floor of the default threshold, for a loss so smooth that the trend's
    own extrapolation error would exceed a multiple of its noise."""

    min_steps: int = 8
    """Optimizer steps (>= 3) the fit and the watch span need at least: an increase with fewer steps
    before it (since the run started or since a reverted watch) is not judged, and a watch stays
    open until its span has this many."""

    def __post_init__(self):
        positive_int("guard.watch_span", self.watch_span, _SPAN, optional=True)
        positive_int("guard.fit", self.fit, _SPAN, optional=True)
        positive_int("guard.hold", self.hold, _SPAN, optional=True)
        self.threshold = positive_number("guard.threshold", self.threshold, "nats of training loss", optional=True)
        self.noise_multiple = positive_number(
            "guard.noise_multiple", self.noise_multiple, "standard deviations of the per-step loss"
        )
        self.min_threshold = positive_number("guard.min_threshold", self.min_threshold, "nats of training loss")
        positive_int("guard.min_steps", self.min_steps, "optimizer steps")
        if self.min_steps < 3:
            raise LitCBSConfigError(
                f"guard.min_steps={self.min_steps} must be >= 3 (a line through 2 points has no residual spread)"
            )

    @classmethod
    def from_dict(cls, settings: Mapping) -> GuardConfig:
        """From a dict (or Hydra DictConfig) of settings; an unknown key is an error naming the settings.

        Raises:
            LitCBSConfigError: an unknown key, or an invalid setting.

        Examples:
            >>> GuardConfig.from_dict({"hold": 500}).hold
            500
            >>> GuardConfig.from_dict({"span": 500})
            Traceback (most recent call last):
            ...
            lit_cbs.errors.LitCBSConfigError: guard has unknown setting(s) span; the settings are watch_span, ...
        """
        settings = {str(key): value for key, value in settings.items()}
        names = [field.name for field in dataclasses.fields(cls)]
        unknown = sorted(key for key in settings if key not in names)
        if unknown:
            raise LitCBSConfigError(
                f"guard has unknown setting(s) {', '.join(unknown)}; the settings are {', '.join(names)}"
            )
        return cls(**settings)


@dataclasses.dataclass
class RevertRestore:
    """What a revert of an increase puts back: BatchWarmup's state from just before the increase.

    BatchWarmup hands one to ``BatchGuard.watch`` at each increase and gets it back from
    ``BatchGuard.mark_reverted`` when the guard reverts that increase. Factors are unitless multipliers.

    Attributes:
        lr_factor: BatchWarmup's ``lr_factor`` before the increase: the product of every earlier change's.
        clip_factor: BatchWarmup's ``clip_factor`` (of the gradient-clipping threshold) before the increase.
        lr_factor_of_change: the increase's own LR factor, which the revert divides out of the LR schedulers.
        clip_factor_of_change: the increase's own clipping factor.
        optimizer_settings: per optimizer, per param group, the betas, eps and weight decay before the
            increase (``lit_cbs.rules.scaling.optimizer_settings``); None where a checkpoint kept none.

    Examples:
        >>> restore = RevertRestore(lr_factor=1.0, clip_factor=1.0, lr_factor_of_change=1.4142,
        ...                         clip_factor_of_change=1.0)
        >>> restore.lr_factor * restore.lr_factor_of_change  # BatchWarmup's LR factor after the increase
        1.4142
        >>> restore.optimizer_settings is None  # none saved: the revert leaves betas, eps and weight decay
        True
    """

    lr_factor: float  # BatchWarmup.lr_factor then: the product of every earlier change's LR factor
    clip_factor: float  # BatchWarmup.clip_factor then (gradient-clipping threshold)
    lr_factor_of_change: float  # the increase's own LR factor, which the revert divides out of the LR schedulers
    clip_factor_of_change: float
    # Per optimizer, per param group: betas, eps and weight decay (lit_cbs.rules.scaling.optimizer_settings);
    # None where a checkpoint's watch holds none (the first guards kept no settings).
    optimizer_settings: list[list[dict]] | None = None


@dataclasses.dataclass
class WatchedIncrease:
    """An increase the guard watches, or has decided to revert. Consumed counts in the schedule's unit."""

    change: int  # its index in BatchWarmup.history
    old_global_batch: int  # samples
    new_global_batch: int  # samples
    consumed: int  # when it was applied
    fit_after: int  # the fit's steps are those after this, up to ``consumed``
    watch_until: int  # judged once this much was consumed
    restore: RevertRestore

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> WatchedIncrease:
        state = dict(state)
        restore = RevertRestore(**state.pop("restore"))
        return cls(**state, restore=restore)


@dataclasses.dataclass
class GuardVerdict:
    """The guard's judgement of one increase. Consumed counts in the schedule's unit (samples or tokens).

    ``BatchGuard.judge`` returns one when a watch span closes; ``BatchGuard.verdicts`` (and
    ``BatchWarmup(guard=...).guard.verdicts``) keep them in order, and ``batch_history.json`` has each as a dict.

    Attributes:
        change: the index in ``BatchWarmup.history`` of the increase judged.
        old_global_batch: the batch before the increase (samples).
        new_global_batch: the batch after it (samples).
        consumed_at_change: consumed when it was applied.
        decided_at: consumed when the watch span closed.
        rise: the mean loss above the trend over the watch span's steps (nats).
        threshold: the rise above which the increase is reverted (nats).
        residual_std: the spread of the per-step loss around the trend before the change (nats).
        trend_intercept: the trend is ``trend_intercept + trend_slope * ln(consumed)`` (nats).
        trend_slope: nats per e-fold of consumed.
        fit_steps: optimizer steps the trend was fitted to.
        watch_steps: optimizer steps in the watch span.
        reverted: whether the guard reverts the increase.

    Examples:
        An increase from 64 to 128 samples at 1000 tokens, judged at 1250 (the default watch span):

        >>> import dataclasses
        >>> verdict = GuardVerdict(change=0, old_global_batch=64, new_global_batch=128, consumed_at_change=1000,
        ...                        decided_at=1250, rise=0.3, threshold=0.05, residual_std=0.01,
        ...                        trend_intercept=2.0, trend_slope=-0.5, fit_steps=10, watch_steps=10, reverted=True)
        >>> verdict.rise > verdict.threshold, verdict.reverted
        (True, True)
        >>> dataclasses.asdict(verdict)["watch_steps"]  # as batch_history.json writes it
        10
    """

    change: int  # index in BatchWarmup.history of the increase judged
    old_global_batch: int  # samples
    new_global_batch: int  # samples
    consumed_at_change: int
    decided_at: int  # consumed when the watch span closed
    rise: float  # nats: mean loss above the trend over the watch span's steps
    threshold: float  # nats
    residual_std: float  # nats: spread of the per-step loss around the trend before the change
    trend_intercept: float  # nats: the trend is trend_intercept + trend_slope * ln(consumed)
    trend_slope: float  # nats per e-fold of consumed
    fit_steps: int
    watch_steps: int  # optimizer steps in the watch span
    reverted: bool


def fit_trend(points: Sequence[tuple[float, float]]) -> tuple[float, float, float]:
    """Least-squares fit of ``loss = intercept + slope * ln(consumed)`` to (consumed, loss) points (3 or
    more); returns intercept (nats), slope (nats per e-fold of consumed) and the residuals' standard
    deviation (nats, n - 2 degrees of freedom).

    Args:
        points: (consumed, loss) pairs: consumed > 0 in samples or tokens, loss in nats; 3 or more.

    Returns:
        ``(intercept, slope, residual_std)``, in nats, nats per e-fold and nats.

    Examples:
        >>> import math
        >>> points = [(1, 2.0), (math.e, 1.5), (math.e**2, 1.0)]  # loss = 2 - 0.5 ln(consumed)
        >>> [round(value, 4) for value in fit_trend(points)]
        [2.0, -0.5, 0.0]
    """
    log_consumed = np.log([consumed for consumed, _ in points])
    losses = np.array([loss for _, loss in points])
    slope, intercept = np.polyfit(log_consumed, losses, 1)
    residuals = losses - (intercept + slope * log_consumed)
    return float(intercept), float(slope), float(np.sqrt(residuals @ residuals / (len(points) - 2)))


def loss_rise(
    fit: Sequence[tuple[float, float]], window: Sequence[tuple[float, float]]
) -> tuple[float, float, float, float]:
    """How far the ``window`` points' losses sit above the trend of the ``fit`` points (``fit_trend``):
    their mean distance from it (nats), then the trend's intercept, slope and residual standard deviation.

    Args:
        fit: (consumed, loss) pairs the trend is fitted to (``fit_trend``; 3 or more).
        window: (consumed, loss) pairs judged against it (1 or more).

    Returns:
        ``(rise, intercept, slope, residual_std)``: nats, nats, nats per e-fold of consumed, nats.

    Examples:
        >>> import math
        >>> fit = [(1, 2.0), (math.e, 1.5), (math.e**2, 1.0)]  # loss = 2 - 0.5 ln(consumed)
        >>> rise, *_ = loss_rise(fit, window=[(math.e**3, 0.7)])  # the trend says 0.5 at e**3
        >>> round(rise, 4)
        0.2
    """
    intercept, slope, residual_std = fit_trend(fit)
    rise = sum(loss - intercept - slope * math.log(consumed) for consumed, loss in window) / len(window)
    return rise, intercept, slope, residual_std


class BatchGuard:
    """Watch the training loss after each batch increase; revert the increase if the loss rises above its trend.

    Give it to ``BatchWarmup(guard=BatchGuard(...))``, or ``guard=True`` for the defaults, or a
    ``GuardConfig`` or a dict of its settings (``batch.guard`` in the recipes).

    Args:
        config: the settings (``GuardConfig``, whose fields say each one's unit and default).
        **settings: instead of ``config``, its fields as keyword arguments: ``BatchGuard(hold=1000)``.

    Attributes:
        config: the ``GuardConfig``.
        verdicts: ``GuardVerdict`` per judged increase, in order.
        reverts: increases reverted so far.
        hold_until: consumed (schedule unit) before which no increase is made.

    Raises:
        TypeError: both ``config`` and ``settings``.
        LitCBSConfigError: an unknown or invalid setting (``GuardConfig``).

    Examples:
        A loss on its trend (2 - 0.5 ln consumed, +-0.01) until an increase at 1000 samples, then 0.3 nats
        above it:

        >>> import math
        >>> guard = BatchGuard()
        >>> for i, consumed in enumerate(range(50, 1001, 50)):
        ...     guard.record(consumed, 2 - 0.5 * math.log(consumed) + (0.01 if i % 2 else -0.01))
        >>> guard.watch(change=0, consumed=1000, old_global_batch=64, new_global_batch=128,
        ...             restore=RevertRestore(lr_factor=1.0, clip_factor=1.0, lr_factor_of_change=1.0,
        ...                                   clip_factor_of_change=1.0))
        True
        >>> for consumed in range(1025, 1251, 25):  # the default watch span: a quarter of 1000
        ...     guard.record(consumed, 2 - 0.5 * math.log(consumed) + 0.3)
        >>> verdict = guard.judge(1250, mean_over_ranks=lambda losses: losses)  # one rank
        >>> verdict.reverted, round(verdict.rise, 2), verdict.threshold, guard.revert_to
        (True, 0.3, 0.05, 64)
        >>> guard.mark_reverted(1250).lr_factor, guard.hold_until  # no increase before 2 x 1250
        (1.0, 2500)
    """

    def __init__(self, config: GuardConfig | None = None, **settings):
        if config is not None and settings:
            raise TypeError(f"BatchGuard: give config= or settings ({', '.join(settings)}), not both")
        self.config = config if config is not None else GuardConfig.from_dict(settings)
        self.verdicts: list[GuardVerdict] = []
        self.reverts = 0
        self.hold_until = 0
        self._steps: list[tuple[int, float]] = []  # (consumed after the step, its loss on this rank)
        self._watch: WatchedIncrease | None = None  # the increase being watched
        self._revert: WatchedIncrease | None = None  # the watched increase to be undone

    @classmethod
    def from_setting(cls, setting: bool | Mapping | GuardConfig | BatchGuard | None) -> BatchGuard | None:
        """The guard for ``BatchWarmup(guard=setting)``: None or False for none, True for the defaults,
        a ``GuardConfig``, a dict (or Hydra DictConfig) of its settings, or a BatchGuard.

        Raises:
            LitCBSConfigError: any other ``setting``, or an invalid setting in it.

        Examples:
            >>> BatchGuard.from_setting(False) is None, BatchGuard.from_setting({"hold": 500}).config.hold
            (True, 500)
        """
        if setting is None or setting is False:
            return None
        if setting is True:
            return cls()
        if isinstance(setting, BatchGuard):
            return setting
        if isinstance(setting, GuardConfig):
            return cls(setting)
        if isinstance(setting, Mapping):
            return cls(GuardConfig.from_dict(setting))
        names = ", ".join(field.name for field in dataclasses.fields(GuardConfig))
        raise LitCBSConfigError(
            f"guard={setting!r} must be true, false, null, a dict of the settings {names}, "
            "a GuardConfig, or a BatchGuard"
        )

    def __repr__(self) -> str:
        return f"BatchGuard({self.config!r})"

    # ------------------------------------------------------------------ what BatchWarmup asks
    @property
    def watching(self) -> bool:
        """Whether an increase is being watched (its watch span is not over)."""
        return self._watch is not None

    @property
    def revert_to(self) -> int | None:
        """The global batch (samples) to go back to, once decided, until BatchWarmup applied it."""
        return None if self._revert is None else self._revert.old_global_batch

    def allowed_batch(self, scheduled: int, current: int, consumed: int) -> int:
        """The global batch to train with next: the schedule's, unless a revert is due, or an increase
        must wait (an increase is watched, or a revert's hold is not over)."""
        if self._revert is not None:
            return self._revert.old_global_batch
        if scheduled > current and (self._watch is not None or consumed < self.hold_until):
            return current
        return scheduled

    def sizes_needed(self) -> list[int]:
        """Global batches a revert may go back to (the micro-batch must divide them)."""
        watched = self._revert or self._watch
        return [] if watched is None else [watched.old_global_batch]

    # ------------------------------------------------------------------ per optimizer step
    def record(self, consumed: int, loss: float) -> None:
        """Record the loss (this rank's mean over the step's micro-batches) of the step that brought
        the run to ``consumed``; forget steps no later fit can use."""
        self._steps.append((consumed, loss))
        keep_after = consumed - self._fit_span(consumed)
        if self._watch is not None:
            keep_after = min(keep_after, self._watch.fit_after)
        drop = 0
        while drop < len(self._steps) and self._steps[drop][0] <= keep_after:
            drop += 1
        del self._steps[:drop]

    def _fit_span(self, consumed: int) -> int:
        return self.config.fit if self.config.fit is not None else consumed // 2

    def watch(
        self, change: int, consumed: int, old_global_batch: int, new_global_batch: int, restore: RevertRestore
    ) -> bool:
        """Start watching the increase ``change`` (its index in the history), applied at ``consumed``;
        ``restore`` is what a revert puts back. Returns False if too few steps precede it to judge it."""
        fit_after = consumed - self._fit_span(consumed)
        fit_steps = sum(1 for at, _ in self._steps if fit_after < at <= consumed)
        if fit_steps < self.config.min_steps:
            return False
        watch_span = self.config.watch_span if self.config.watch_span is not None else max(1, consumed // 4)
        self._watch = WatchedIncrease(
            change, old_global_batch, new_global_batch, consumed, fit_after, consumed + watch_span, restore
        )
        return True

    def forget_watch(self) -> None:
        """Stop watching without a verdict: the schedule itself moved the batch below the
        increase watched, so there is nothing left to revert."""
        self._watch = None

    def judge(self, consumed: int, mean_over_ranks: Callable[[list[float]], list[float]]) -> GuardVerdict | None:
        """After a step: if the watched increase's span is complete, judge it and return the verdict
        (a revert is then due: ``revert_to``). ``mean_over_ranks`` averages a list of floats over ranks."""
        watch, config = self._watch, self.config
        if watch is None or consumed < watch.watch_until:
            return None
        fit = [(at, loss) for at, loss in self._steps if watch.fit_after < at <= watch.consumed]
        watched = [(at, loss) for at, loss in self._steps if at > watch.consumed]
        if len(watched) < config.min_steps:
            return None
        losses = mean_over_ranks([loss for _, loss in fit + watched])
        fit = [(at, loss) for (at, _), loss in zip(fit, losses)]
        watched = [(at, loss) for (at, _), loss in zip(watched, losses[len(fit) :])]
        rise, intercept, slope, residual_std = loss_rise(fit, watched)
        threshold = (
            config.threshold
            if config.threshold is not None
            else max(config.noise_multiple * residual_std, config.min_threshold)
        )
        reverted = not rise <= threshold  # a non-finite loss counts as a rise
        verdict = GuardVerdict(
            change=watch.change,
            old_global_batch=watch.old_global_batch,
            new_global_batch=watch.new_global_batch,
            consumed_at_change=watch.consumed,
            decided_at=consumed,
            rise=rise,
            threshold=threshold,
            residual_std=residual_std,
            trend_intercept=intercept,
            trend_slope=slope,
            fit_steps=len(fit),
            watch_steps=len(watched),
            reverted=reverted,
        )
        self.verdicts.append(verdict)
        self._watch = None
        if reverted:
            self._revert = watch
        return verdict

    def mark_reverted(self, consumed: int) -> RevertRestore:
        """Record that the due revert was applied at ``consumed``: hold the next increase, leave the
        reverted span's losses out of later fits; return what the reverted increase asked to be restored."""
        watch, self._revert = self._revert, None
        if watch is None:
            raise RuntimeError("BatchGuard.mark_reverted: no revert is due (revert_to is None)")
        self.reverts += 1
        self.hold_until = consumed + (self.config.hold if self.config.hold is not None else consumed)
        self._steps = [(at, loss) for at, loss in self._steps if at <= watch.consumed]
        return watch.restore

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        return {
            "verdicts": [dataclasses.asdict(verdict) for verdict in self.verdicts],
            "reverts": self.reverts,
            "hold_until": self.hold_until,
            "steps": [list(step) for step in self._steps],
            "watch": None if self._watch is None else self._watch.state_dict(),
            "revert": None if self._revert is None else self._revert.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.verdicts = [GuardVerdict(**verdict) for verdict in state_dict["verdicts"]]
        self.reverts = state_dict["reverts"]
        self.hold_until = state_dict["hold_until"]
        self._steps = [tuple(step) for step in state_dict["steps"]]
        self._watch, self._revert = (
            None if state_dict[key] is None else WatchedIncrease.from_state_dict(state_dict[key])
            for key in ("watch", "revert")
        )
