"""The in-process runner: a point's branches trained inside the Trainer, from an in-memory copy of the state at the
window's start, on the micro-batches the main run trained (``RecordedWindow``), while the main run waits."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl

from lit_cbs.callbacks.accounting import BatchAccounting
from lit_cbs.callbacks.checkpoint import set_probe_window, stop_signal
from lit_cbs.callbacks.module_state import logging_muted
from lit_cbs.probe.branch import BranchMeasurer, BranchTrainer, RecordedWindow
from lit_cbs.probe.config import ProbeConfig
from lit_cbs.probe.engine import BranchOutcome, ProbePoint
from lit_cbs.probe.limits import known
from lit_cbs.probe.snapshot import TrainingSnapshot

__all__: list[str] = []  # the probe engine's own parts


class InProcessRunner:
    """Trains a point's branches where the main run's part ends (and at each early look), then restores the main
    run's state: one point at a time."""

    mode = "in_process"
    late = False

    def __init__(self, config: ProbeConfig):
        self.config = config
        self.window: RecordedWindow | None = None  # the open point's, with the micro-batches recorded so far
        self._branches: BranchTrainer | None = None
        self._trained: list[float] = []
        self._failed: list[float] = []
        self._outcomes: list[tuple[ProbePoint, BranchOutcome | str]] = []

    def attach(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        accounting: BatchAccounting,
        branch_trainer: Callable[[int], BranchTrainer],
    ) -> None:
        """At setup: the run it trains in; ``branch_trainer(batch_size)`` makes the trainer of a point's branches."""
        self.trainer, self.pl_module, self.accounting = trainer, pl_module, accounting
        self.branch_trainer = branch_trainer

    def start(self, point: ProbePoint) -> None:
        trainer, accounting = self.trainer, self.accounting
        with accounting.branching():  # the copy is probe work, not the main run's time
            start = TrainingSnapshot(trainer, self.pl_module, self.config.snapshot_device)
        ranks = accounting.data_parallel_size
        self.window = RecordedWindow(
            early_stop_samples=[
                (look - point.window_end_samples + point.window_samples) // ranks for look in point.looks
            ],
            tokens=point.tokens,
            step=point.step,
            batch_size=point.batch_size,
            accumulate=accounting.accumulate,
            micro_batch_size=known(accounting.micro_batch_size, "BatchAccounting.micro_batch_size"),
            data_parallel_size=ranks,
            seq_len=point.seq_len,
            multipliers=point.multipliers,
            window_samples=point.window_samples,
            start=start,
            replicates=point.replicates,
            interrupted_at_tokens=point.interrupted_at_tokens,
        )
        self._branches, self._trained, self._failed = self.branch_trainer(point.batch_size), [], []
        set_probe_window(trainer, trainer.global_step)

    def record_batch(self, batch: Any) -> None:
        """Keep a micro-batch the main run trains on inside the open window."""
        if self.window is not None:
            self.window.record_batch(batch, self.config.snapshot_device)

    def window_ended(self, point: ProbePoint) -> None:
        """Nothing to hand over: the engine keeps the main run's score, which ``point.baseline`` gives."""

    def step(self, point: ProbePoint, samples_seen: int) -> None:
        """Where the main run's part ends, or at an early look, train and score the branches over the window
        recorded so far (the main state restored after), for ``poll``.

        Raises:
            ProbeAborted: a stop signal arrived inside a branch (the main state is restored).
            ProbeUnusable: the run cannot be probed as it is.
        """
        window, branches = self.window, self._branches
        assert window is not None and branches is not None, "a point is open"
        final = window.complete
        if not (final or window.at_early_stop):
            return
        trainer, pl_module, accounting = self.trainer, self.pl_module, self.accounting
        with accounting.branching():  # probe work: not the main run's time or gradients
            after_window = TrainingSnapshot(trainer, pl_module, self.config.snapshot_device)
            try:
                train = functools.partial(branches.loss, window, keep=not final)
                measurer = BranchMeasurer(train, window.replicates, point.baseline, self._trained, self._failed)
                with logging_muted(pl_module):
                    scores = measurer.scores(self.config.search, window.multipliers, self.config.epsilon)
            finally:
                after_window.restore(trainer, pl_module)
                accounting.set_gradient_sync(None)
        window_tokens = window.tokens_of(min(window.recorded_samples, window.samples_per_rank))
        outcome = BranchOutcome(
            scores, list(self._trained), list(self._failed), branches.tokens_trained, window_tokens, final
        )
        self._outcomes.append((point, outcome))

    def poll(self) -> list[tuple[ProbePoint, BranchOutcome | str]]:
        outcomes, self._outcomes = self._outcomes, []
        return outcomes

    def close(self, point: ProbePoint) -> None:
        self.window, self._branches = None, None
        if stop_signal(self.trainer) is None and not self.trainer.received_sigterm:
            set_probe_window(self.trainer, None)  # else the run stops: its last checkpoint keeps the start
