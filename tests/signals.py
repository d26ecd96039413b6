"""A callback that sends a real signal to a real run, for the preemption tests (importable by recipes/train.py
under torchrun: ``+callbacks.signal={_target_: signals.SignalAt, ...}`` with tests/ on PYTHONPATH)."""

from __future__ import annotations

import os

import lightning.pytorch as pl

from lit_cbs.callbacks.accounting import BatchAccounting


class SignalAt(pl.Callback):
    """Sends this process ``signum`` right after main-run optimizer step ``step``; with ``rank``, on that
    rank's process alone, as when one node of a job is preempted."""

    def __init__(self, step: int, signum: int, rank: int | None = None):
        self.step, self.signum, self.rank = step, signum, rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.rank is not None and trainer.global_rank != self.rank:
            return
        if trainer.global_step == self.step and not BatchAccounting.attach(trainer).in_branch:
            os.kill(os.getpid(), self.signum)
