"""``BatchGuard``: undo a batch increase after which the training loss rises above its trend.

An increase that comes too early (a batch above what the model can use yet) shows as a training
loss that falls behind where it was heading: at the same tokens it is higher than the trend of the
stretch before the change predicts. After each increase the guard:

1. fits the trend: the per-step training loss of the last stretch before the change (``fit``,
   default the second half of what was consumed before it) by least squares as
   ``a + b * ln(consumed)``;
2. watches a window after the change (``window``, default a quarter of what was consumed before
   it) and averages the loss's distance from the extrapolated trend over the window's steps: the
   rise, in nats;
3. reverts to the previous batch if the rise exceeds the threshold: ``threshold`` if given, else
   ``noise_multiple`` x the standard deviation of the per-step loss around the trend before the
   change (the loss's own noise), and at least ``min_threshold``. The per-step spread, not the
   standard error of the window's mean: the trend's extrapolation error does not average out over
   a window, and on healthy runs it reaches a good part of that spread early in training.

Everything is measured in consumed samples or tokens, the schedule's unit, never in steps: a larger
batch takes fewer steps per token, so only at equal tokens are the two batches comparable. Spans
default to fractions of what was consumed before the change because loss curves are close to
linear in log tokens: the same settings then suit a run of millions of tokens and one of trillions.
After a revert, no increase is made for ``hold`` (default: as much as was consumed before the
revert, so the next try comes at twice the tokens), and while a window is open the next increase
waits for its verdict, so every increase is judged on its own (a schedule that itself lowers the
batch inside a window ends that window without a verdict).

Each step's loss is the mean of its micro-batches' losses; the guard keeps (consumed, loss) per
optimizer step of the stretch a future fit may need (with the default ``fit``, the last half of the
run's steps; they are in the checkpoint too), and averages the losses over ranks at each verdict, so
every rank decides alike. The pure parts (``loss_rise``) need no Lightning; ``BatchWarmup(guard=...)``
applies the verdicts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from lit_cbs.errors import LitCBSConfigError, positive_int, positive_number


@dataclasses.dataclass
class GuardVerdict:
    """The guard's judgement of one increase. Consumed counts in the schedule's unit (samples or tokens)."""

    change: int  # index in BatchWarmup.history of the increase judged
    old_global_batch: int  # samples
    new_global_batch: int  # samples
    consumed_at_change: int
    decided_at: int  # consumed when the window closed
    rise: float  # nats: mean loss above the trend over the window's steps
    threshold: float  # nats
    residual_std: float  # nats: spread of the per-step loss around the trend before the change
    trend_intercept: float  # nats: the trend is trend_intercept + trend_slope * ln(consumed)
    trend_slope: float  # nats per e-fold of consumed
    fit_steps: int
    window_steps: int
    reverted: bool


def fit_trend(points: Sequence[tuple[float, float]]) -> tuple[float, float, float]:
    """Least-squares fit of ``loss = intercept + slope * ln(consumed)`` to (consumed, loss) points (3 or
    more); returns intercept (nats), slope (nats per e-fold of consumed) and the residuals' standard
    deviation (nats, n - 2 degrees of freedom)."""
    log_consumed = np.log([consumed for consumed, _ in points])
    losses = np.array([loss for _, loss in points])
    slope, intercept = np.polyfit(log_consumed, losses, 1)
    residuals = losses - (intercept + slope * log_consumed)
    return float(intercept), float(slope), float(np.sqrt(residuals @ residuals / (len(points) - 2)))


def loss_rise(fit: Sequence[tuple[float, float]], window: Sequence[tuple[float, float]]) -> tuple[float, float, float, float]:
    """How far the ``window`` points' losses sit above the trend of the ``fit`` points (``fit_trend``):
    their mean distance from it (nats), then the trend's intercept, slope and residual standard deviation."""
    intercept, slope, residual_std = fit_trend(fit)
    rise = sum(loss - intercept - slope * math.log(consumed) for consumed, loss in window) / len(window)
    return rise, intercept, slope, residual_std


class BatchGuard:
    """Watch the training loss after each batch increase; revert the increase if the loss rises above its trend.

    Give it to ``BatchWarmup(guard=BatchGuard(...))``, or ``guard=True`` for the defaults, or a dict of
    these settings (``batch.guard`` in the recipes). Spans are in the schedule's unit (tokens, or
    samples for a schedule in samples), counted from the change.

    Args:
        window: how much is trained after an increase before it is judged. Default: a quarter of
            what was consumed before the increase.
        fit: the stretch before the increase whose loss trend is extrapolated. Default: half of what
            was consumed before it (the trend of its second half). Steps of a reverted window are
            left out of later fits.
        hold: after a revert, no increase for this much. Default: as much as was consumed before
            the revert (the next try comes at twice the tokens).
        threshold: nats; revert when the loss over the window is on average more than this above
            the trend. Default (None): ``noise_multiple`` x the per-step loss's standard deviation
            around the trend before the change, and at least ``min_threshold``.
        noise_multiple: multiple of that standard deviation (a number > 0) for the default threshold.
        min_threshold: nats; floor of the default threshold, for a loss so smooth that the trend's
            own extrapolation error would exceed a multiple of its noise.
        min_steps: optimizer steps the fit and the window need at least; an increase with fewer
            steps before it (since the run started or since a reverted window) is not judged, and
            a window stays open until it has this many.

    Attributes:
        verdicts: ``GuardVerdict`` per judged increase, in order.
        reverts: increases reverted so far.
        hold_until: consumed (schedule unit) before which no increase is made.
    """

    SETTINGS = ("window", "fit", "hold", "threshold", "noise_multiple", "min_threshold", "min_steps")

    def __init__(
        self,
        window: int | None = None,
        fit: int | None = None,
        hold: int | None = None,
        threshold: float | None = None,
        noise_multiple: float = 2.0,
        min_threshold: float = 0.05,
        min_steps: int = 8,
    ):
        span = "samples or tokens, the schedule's unit"
        self.window = positive_int("guard.window", window, span, optional=True)
        self.fit = positive_int("guard.fit", fit, span, optional=True)
        self.hold = positive_int("guard.hold", hold, span, optional=True)
        self.threshold = positive_number("guard.threshold", threshold, "nats of training loss", optional=True)
        self.noise_multiple = positive_number("guard.noise_multiple", noise_multiple, "standard deviations of the per-step loss")
        self.min_threshold = positive_number("guard.min_threshold", min_threshold, "nats of training loss")
        self.min_steps = positive_int("guard.min_steps", min_steps, "optimizer steps")
        if self.min_steps < 3:
            raise LitCBSConfigError(f"guard.min_steps={min_steps} must be >= 3 (a line through 2 points has no residual spread)")
        self.verdicts: list[GuardVerdict] = []
        self.reverts = 0
        self.hold_until = 0
        self._steps: list[tuple[int, float]] = []  # (consumed after the step, its loss on this rank)
        self._watch: dict[str, Any] | None = None  # the increase being watched
        self._revert: dict[str, Any] | None = None  # the watch whose increase is to be undone

    @classmethod
    def from_setting(cls, setting: bool | Mapping | BatchGuard | None) -> BatchGuard | None:
        """The guard for ``BatchWarmup(guard=setting)``: None or False for none, True for the defaults,
        a dict (or Hydra DictConfig) of settings, or a BatchGuard."""
        if setting is None or setting is False:
            return None
        if setting is True:
            return cls()
        if isinstance(setting, BatchGuard):
            return setting
        if isinstance(setting, Mapping):
            unknown = sorted(str(key) for key in setting if key not in cls.SETTINGS)
            if unknown:
                raise LitCBSConfigError(
                    f"guard has unknown setting(s) {', '.join(unknown)}; the settings are {', '.join(cls.SETTINGS)}"
                )
            return cls(**{str(key): value for key, value in setting.items()})
        raise LitCBSConfigError(
            f"guard={setting!r} must be true, false, null, a dict of the settings {', '.join(cls.SETTINGS)}, or a BatchGuard"
        )

    def __repr__(self) -> str:
        return f"BatchGuard({', '.join(f'{name}={getattr(self, name)!r}' for name in self.SETTINGS)})"

    # ------------------------------------------------------------------ what BatchWarmup asks
    @property
    def watching(self) -> bool:
        """Whether an increase is being watched (its window is open)."""
        return self._watch is not None

    @property
    def revert_to(self) -> int | None:
        """The global batch (samples) to go back to, once decided, until BatchWarmup applied it."""
        return None if self._revert is None else self._revert["old_global_batch"]

    def allowed_batch(self, scheduled: int, current: int, consumed: int) -> int:
        """The global batch to train with next: the schedule's, unless a revert is due, or an increase
        must wait (a window is open, or a revert's hold is not over)."""
        if self._revert is not None:
            return self._revert["old_global_batch"]
        if scheduled > current and (self._watch is not None or consumed < self.hold_until):
            return current
        return scheduled

    def sizes_needed(self) -> list[int]:
        """Global batches a revert may go back to (the micro-batch must divide them)."""
        watched = self._revert or self._watch
        return [] if watched is None else [watched["old_global_batch"]]

    # ------------------------------------------------------------------ per optimizer step
    def record(self, consumed: int, loss: float) -> None:
        """Record the loss (this rank's mean over the step's micro-batches) of the step that brought
        the run to ``consumed``; forget steps no later fit can use."""
        self._steps.append((consumed, loss))
        keep_after = consumed - (self.fit if self.fit is not None else consumed // 2)
        if self._watch is not None:
            keep_after = min(keep_after, self._watch["fit_after"])
        drop = 0
        while drop < len(self._steps) and self._steps[drop][0] <= keep_after:
            drop += 1
        del self._steps[:drop]

    def watch(self, change: int, consumed: int, old_global_batch: int, new_global_batch: int, restore: dict) -> bool:
        """Open the window of the increase ``change`` (its index in the history), applied at ``consumed``;
        ``restore`` holds what a revert puts back. Returns False if too few steps precede it to judge it."""
        fit_after = consumed - (self.fit if self.fit is not None else consumed // 2)
        fit_steps = sum(1 for at, _ in self._steps if fit_after < at <= consumed)
        if fit_steps < self.min_steps:
            return False
        self._watch = {
            "change": change,
            "old_global_batch": old_global_batch,
            "new_global_batch": new_global_batch,
            "consumed": consumed,
            "fit_after": fit_after,
            "window_until": consumed + (self.window if self.window is not None else max(1, consumed // 4)),
            "restore": restore,
        }
        return True

    def forget_watch(self) -> None:
        """Stop watching the open window without a verdict: the schedule itself moved the batch below the
        increase watched, so there is nothing left to revert."""
        self._watch = None

    def judge(self, consumed: int, mean_over_ranks: Callable[[list[float]], list[float]]) -> GuardVerdict | None:
        """After a step: if the open window is complete, judge its increase and return the verdict
        (a revert is then due: ``revert_to``). ``mean_over_ranks`` averages a list of floats over ranks."""
        watch = self._watch
        if watch is None or consumed < watch["window_until"]:
            return None
        fit = [(at, loss) for at, loss in self._steps if watch["fit_after"] < at <= watch["consumed"]]
        window = [(at, loss) for at, loss in self._steps if at > watch["consumed"]]
        if len(window) < self.min_steps:
            return None
        losses = mean_over_ranks([loss for _, loss in fit + window])
        fit = [(at, loss) for (at, _), loss in zip(fit, losses)]
        window = [(at, loss) for (at, _), loss in zip(window, losses[len(fit) :])]
        rise, intercept, slope, residual_std = loss_rise(fit, window)
        threshold = self.threshold if self.threshold is not None else max(self.noise_multiple * residual_std, self.min_threshold)
        reverted = not rise <= threshold  # a non-finite loss counts as a rise
        verdict = GuardVerdict(
            change=watch["change"],
            old_global_batch=watch["old_global_batch"],
            new_global_batch=watch["new_global_batch"],
            consumed_at_change=watch["consumed"],
            decided_at=consumed,
            rise=rise,
            threshold=threshold,
            residual_std=residual_std,
            trend_intercept=intercept,
            trend_slope=slope,
            fit_steps=len(fit),
            window_steps=len(window),
            reverted=reverted,
        )
        self.verdicts.append(verdict)
        self._watch = None
        if reverted:
            self._revert = watch
        return verdict

    def reverted(self, consumed: int) -> dict:
        """The due revert was applied at ``consumed``: hold the next increase, leave the reverted window's
        losses out of later fits; return what the watched increase asked to be restored."""
        watch, self._revert = self._revert, None
        self.reverts += 1
        self.hold_until = consumed + (self.hold if self.hold is not None else consumed)
        self._steps = [(at, loss) for at, loss in self._steps if at <= watch["consumed"]]
        return watch["restore"]

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        return {
            "verdicts": [dataclasses.asdict(verdict) for verdict in self.verdicts],
            "reverts": self.reverts,
            "hold_until": self.hold_until,
            "steps": [list(step) for step in self._steps],
            "watch": self._watch,
            "revert": self._revert,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.verdicts = [GuardVerdict(**verdict) for verdict in state_dict["verdicts"]]
        self.reverts = state_dict["reverts"]
        self.hold_until = state_dict["hold_until"]
        self._steps = [tuple(step) for step in state_dict["steps"]]
        self._watch = state_dict["watch"]
        self._revert = state_dict["revert"]
