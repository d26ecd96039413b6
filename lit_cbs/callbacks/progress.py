"""``RunProgressBar``: Lightning's TQDMProgressBar counting the whole run, in tokens or optimizer steps."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar

from lit_cbs.callbacks.accounting import BatchAccounting, trainer_callbacks

__all__ = ["RunProgressBar"]


class RunProgressBar(TQDMProgressBar):
    """One training bar for the whole run, tokens out of ``max_tokens`` (``BatchAccounting``'s), else optimizer
    steps out of ``max_steps``, else Lightning's; ``TQDMProgressBar``'s arguments (``refresh_rate`` in
    micro-batches). Lightning's bar counts an epoch's micro-batches, though a run may stop anywhere in it.

    Examples:
        >>> import types
        >>> from lit_cbs.callbacks import RunProgressBar
        >>> bar = RunProgressBar(refresh_rate=10)
        >>> bar.progress(types.SimpleNamespace(max_steps=1000, global_step=250))
        (250, 1000, 'steps')
        >>> bar.progress(types.SimpleNamespace(max_steps=-1, global_step=250)) is None  # Lightning's epoch bar
        True
    """

    def __init__(self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False):
        super().__init__(refresh_rate=refresh_rate, process_position=process_position, leave=leave)
        self._accounting: BatchAccounting | None = None
        self._micro_batches = 0

    def progress(self, trainer: pl.Trainer) -> tuple[int, int, str] | None:
        """(done, total, unit) for the whole run, or None where Lightning's per-epoch count applies."""
        accounting = self._accounting
        if accounting is not None and accounting.max_tokens is not None:
            # The last step may pass the budget: the bar then ends at what was trained.
            return accounting.tokens_seen, max(accounting.max_tokens, accounting.tokens_seen), "tokens"
        if trainer.max_steps is not None and trainer.max_steps > 0:
            return trainer.global_step, trainer.max_steps, "steps"
        return None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._accounting = next((cb for cb in trainer_callbacks(trainer) if isinstance(cb, BatchAccounting)), None)
        self._micro_batches = 0
        progress = self.progress(trainer)
        if progress is not None and not self.train_progress_bar.disable:
            # A resumed run starts part-way: tqdm's rate then counts from here, not from zero at time 0.
            self.train_progress_bar.initial = progress[0]
            self.train_progress_bar.set_description(f"Epoch {trainer.current_epoch}")  # no epoch start mid-epoch
        self._show(trainer, pl_module)

    def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.progress(trainer) is None:
            super().on_train_epoch_start(trainer, *args)
        else:
            self.train_progress_bar.set_description(f"Epoch {trainer.current_epoch}")

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.progress(trainer) is None:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        self._micro_batches += 1
        if self.is_enabled and (self._micro_batches % self.refresh_rate == 0 or trainer.should_stop):
            self._show(trainer, pl_module)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.progress(trainer) is None:
            super().on_train_epoch_end(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._show(trainer, pl_module)
        super().on_train_end(trainer, pl_module)

    def _show(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        progress, bar = self.progress(trainer), self.train_progress_bar
        if progress is None or bar.disable:
            return
        done, total, unit = progress
        bar.unit, bar.unit_scale, bar.total, bar.n = unit, unit == "tokens", total, done
        bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
        bar.refresh()
