"""``BatchGuard``: undo a batch increase after which the training loss rises above its trend (docs/guides/guard.md)."""

from __future__ import annotations

import bisect
import dataclasses
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from lit_cbs.errors import LitCBSConfigError, positive_int, positive_number

__all__ = ["BatchGuard", "GuardVerdict", "RevertRestore"]

_SPAN = "samples or tokens, the schedule's unit"


@dataclasses.dataclass
class RevertRestore:
    """What a revert puts back: the factors before the increase, the increase's own, each optimizer's settings."""

    lr_factor: float
    clip_factor: float
    lr_factor_of_change: float
    clip_factor_of_change: float
    optimizer_settings: list[list[dict[str, Any]]] | None = None


@dataclasses.dataclass
class _WatchedIncrease:
    change: int
    old_global_batch: int
    new_global_batch: int
    consumed: int
    fit_after: int
    watch_until: int
    restore: RevertRestore


@dataclasses.dataclass
class GuardVerdict:
    """The guard's judgement of one increase; ``rise``: nats of mean loss after it above the fit's trend a + b ln(n)."""

    change: int  # index in BatchWarmup.history
    old_global_batch: int
    new_global_batch: int
    consumed_at_change: int
    decided_at: int  # consumed when the watch span closed
    rise: float
    threshold: float
    residual_std: float
    trend_intercept: float
    trend_slope: float
    fit_steps: int
    watch_steps: int
    reverted: bool


class BatchGuard:
    """Watch the training loss after each batch increase; revert the increase if the loss rises above its trend.
    ``BatchWarmup(guard=True)`` builds one with the defaults, ``guard={...}`` with these keyword arguments; the
    spans count the schedule's unit (samples or tokens). Settings and defaults: docs/guides/guard.md."""

    def __init__(
        self,
        watch_span: int | None = None,
        fit: int | None = None,
        hold: int | None = None,
        threshold: float | None = None,
        noise_multiple: float = 2.0,
        min_threshold: float = 0.05,
        min_steps: int = 8,
    ):
        self.watch_span = positive_int("guard.watch_span", watch_span, _SPAN, optional=True)
        self.fit = positive_int("guard.fit", fit, _SPAN, optional=True)
        self.hold = positive_int("guard.hold", hold, _SPAN, optional=True)
        self.threshold = positive_number("guard.threshold", threshold, "nats of training loss", optional=True)
        self.noise_multiple = positive_number("guard.noise_multiple", noise_multiple, "standard deviations of the loss")
        self.min_threshold = positive_number("guard.min_threshold", min_threshold, "nats of training loss")
        self.min_steps = positive_int("guard.min_steps", min_steps, "optimizer steps")
        if self.min_steps < 3:
            raise LitCBSConfigError(
                f"guard.min_steps={self.min_steps} must be >= 3 (a line through 2 points has no residual spread)"
            )
        self.verdicts: list[GuardVerdict] = []
        self.reverts = self.hold_until = 0  # hold_until: consumed before which no increase is made
        self._steps: list[tuple[int, float]] = []  # (consumed after the step, its loss on this rank)
        self._watch: _WatchedIncrease | None = None  # the increase being watched
        self._revert: _WatchedIncrease | None = None  # the watched increase to be undone

    @classmethod
    def from_setting(cls, setting: bool | Mapping[str, Any] | None) -> BatchGuard | None:
        """The guard for ``BatchWarmup(guard=...)``: None/False, True (the defaults) or a dict of the arguments."""
        if setting is None or isinstance(setting, bool):
            return cls() if setting else None
        names = ", ".join(parameters := inspect.signature(cls).parameters)
        if not isinstance(setting, Mapping):
            raise LitCBSConfigError(f"guard={setting!r} must be true, false, null, a dict of the settings {names}")
        if unknown := sorted(set(map(str, setting)) - set(parameters)):
            raise LitCBSConfigError(f"guard has unknown setting(s) {', '.join(unknown)}; the settings are {names}")
        return cls(**{str(key): value for key, value in setting.items()})

    @property
    def watching(self) -> bool:
        return self._watch is not None

    @property
    def revert_to(self) -> int | None:
        """The global batch (samples) a decided revert goes back to, until applied."""
        return None if self._revert is None else self._revert.old_global_batch

    def allowed_batch(self, scheduled: int, current: int, consumed: int) -> int:
        """The schedule's global batch, unless a revert is due or an increase must wait (watched, or held)."""
        if self._revert is not None:
            return self._revert.old_global_batch
        if scheduled > current and (self._watch is not None or consumed < self.hold_until):
            return current
        return scheduled

    def sizes_needed(self) -> list[int]:
        """Global batches a revert may go back to (the micro-batch must divide them)."""
        watched = self._revert or self._watch
        return [] if watched is None else [watched.old_global_batch]

    def record(self, consumed: int, loss: float) -> None:
        """The loss (nats, this rank's mean over the micro-batches) of the step that reached ``consumed``."""
        self._steps.append((consumed, loss))
        keep_after = consumed - self._fit_span(consumed)
        if self._watch is not None:
            keep_after = min(keep_after, self._watch.fit_after)
        del self._steps[: bisect.bisect_right(self._steps, keep_after, key=lambda step: step[0])]

    def _fit_span(self, consumed: int) -> int:
        return self.fit or consumed // 2

    def watch(
        self, change: int, consumed: int, old_global_batch: int, new_global_batch: int, restore: RevertRestore
    ) -> bool:
        """Watch the increase ``change`` (history index) applied at ``consumed``; False if too few steps precede it."""
        fit_after = consumed - self._fit_span(consumed)
        if sum(1 for at, _ in self._steps if fit_after < at <= consumed) < self.min_steps:
            return False
        until = consumed + (self.watch_span or max(1, consumed // 4))
        self._watch = _WatchedIncrease(change, old_global_batch, new_global_batch, consumed, fit_after, until, restore)
        return True

    def forget_watch(self) -> None:
        """The schedule moved the batch below the increase watched: nothing left to revert."""
        self._watch = None

    def judge(self, consumed: int, mean_over_ranks: Callable[[list[float]], list[float]]) -> GuardVerdict | None:
        """After a step: judge the watched increase if its span is complete (losses averaged ``mean_over_ranks``)."""
        watch = self._watch
        if watch is None or consumed < watch.watch_until:
            return None
        fit = [(at, loss) for at, loss in self._steps if watch.fit_after < at <= watch.consumed]
        watched = [(at, loss) for at, loss in self._steps if at > watch.consumed]
        if len(watched) < self.min_steps:
            return None
        losses = mean_over_ranks([loss for _, loss in fit + watched])
        fit = [(at, loss) for (at, _), loss in zip(fit, losses)]
        watched = [(at, loss) for (at, _), loss in zip(watched, losses[len(fit) :])]
        # The watched losses' mean rise above the least-squares trend a + b ln(consumed) of the fit's (nats).
        log_consumed, fit_losses = np.log([at for at, _ in fit]), np.array([loss for _, loss in fit])
        slope, intercept = map(float, np.polyfit(log_consumed, fit_losses, 1))
        residuals = fit_losses - (intercept + slope * log_consumed)
        residual_std = float(np.sqrt(residuals @ residuals / (len(fit) - 2)))  # n - 2 degrees of freedom
        rise = sum(loss - intercept - slope * math.log(at) for at, loss in watched) / len(watched)
        threshold = self.threshold or max(self.noise_multiple * residual_std, self.min_threshold)
        reverted = not rise <= threshold  # a non-finite loss counts as a rise
        at_change = (watch.change, watch.old_global_batch, watch.new_global_batch, watch.consumed, consumed)
        verdict = GuardVerdict(
            *at_change, rise, threshold, residual_std, intercept, slope, len(fit), len(watched), reverted
        )
        self.verdicts.append(verdict)
        self._watch = None
        if reverted:
            self._revert = watch
        return verdict

    def mark_reverted(self, consumed: int) -> RevertRestore:
        """The due revert was applied at ``consumed``: hold the next increase; return what to restore."""
        watch, self._revert = self._revert, None
        assert watch is not None, "no revert is due"
        self.reverts += 1
        self.hold_until = consumed + (self.hold or consumed)
        self._steps = [(at, loss) for at, loss in self._steps if at <= watch.consumed]
        return watch.restore

    def state_dict(self) -> dict[str, Any]:
        watches = {key: w and dataclasses.asdict(w) for key, w in (("watch", self._watch), ("revert", self._revert))}
        verdicts = [dataclasses.asdict(verdict) for verdict in self.verdicts]
        steps = [list(step) for step in self._steps]
        return {"verdicts": verdicts, "reverts": self.reverts, "hold_until": self.hold_until, "steps": steps, **watches}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.verdicts = [GuardVerdict(**verdict) for verdict in state_dict["verdicts"]]
        self.reverts, self.hold_until = state_dict["reverts"], state_dict["hold_until"]
        self._steps = [(at, loss) for at, loss in state_dict["steps"]]
        self._watch, self._revert = (
            None if w is None else _WatchedIncrease(**{**w, "restore": RevertRestore(**w["restore"])})
            for w in (state_dict["watch"], state_dict["revert"])
        )
