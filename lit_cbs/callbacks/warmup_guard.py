"""``BatchWarmup``'s side of its guard (``lit_cbs.rules.guard.BatchGuard``): feeds it losses, carries out reverts."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.data import extract_batch_size

from lit_cbs import metrics
from lit_cbs.callbacks.accounting import mean_over_ranks, micro_batch_loss, resizable_train_loader
from lit_cbs.callbacks.logs import log_to_loggers
from lit_cbs.rules.batch_schedules import BatchSchedule
from lit_cbs.rules.guard import BatchGuard, RevertRestore
from lit_cbs.rules.scaling import LRRule, restore_settings, scale_learning_rate

__all__: list[str] = []  # internal


class WarmupGuard:
    """Feeds ``guard`` each optimizer step's loss and acts on its verdicts."""

    def __init__(self, guard: BatchGuard):
        self.guard = guard
        # This step's micro-batch losses so far: their sum (on the loss's device: no host sync) and count.
        self.loss_sum: torch.Tensor | float = 0.0
        self.micro_batches = 0

    def add_micro_batch(self, trainer: pl.Trainer, outputs: Any, batch: Any) -> None:
        loss = micro_batch_loss(trainer, outputs)
        if loss is None or extract_batch_size(batch) == 0:
            return  # training_step returned None (Lightning skipped it), or a micro-batch of no sample
        self.loss_sum = self.loss_sum + loss
        self.micro_batches += 1

    def state_dict(self) -> dict[str, Any]:
        """The guard's, and the step under way's [sum of micro-batch losses (nats), their count]."""
        return {"guard": self.guard.state_dict(), "step_loss": [float(self.loss_sum), self.micro_batches]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict["guard"] is not None:
            self.guard.load_state_dict(state_dict["guard"])
            self.loss_sum, self.micro_batches = state_dict["step_loss"]

    def end_step(self, trainer: pl.Trainer, consumed: int, unit: str, data_parallel_size: int) -> None:
        """Give the guard the step's loss at ``consumed`` (``unit``: the schedule's) and let it judge."""
        loss_sum, micro_batches = self.loss_sum, self.micro_batches
        self.loss_sum, self.micro_batches = 0.0, 0
        loader = resizable_train_loader(trainer)
        if loader is not None:
            assert loader.last_round_samples is not None  # the step's micro-batches came from it
            if loader.last_round_samples < data_parallel_size:
                return  # the epoch's last round left a rank no sample, so no loss: every rank leaves this step out
        if not micro_batches:
            return
        self.guard.record(consumed, float(loss_sum) / micro_batches)
        verdict = self.guard.judge(consumed, lambda values: mean_over_ranks(trainer, values))
        if verdict is None:
            return
        v, kept = verdict, f"keeping {verdict.new_global_batch}"
        rank_zero_info(
            f"BatchWarmup guard: over the {v.decided_at - v.consumed_at_change:,} {unit} after {v.old_global_batch} "
            f"-> {v.new_global_batch} at {v.consumed_at_change:,} {unit}, the training loss was {v.rise:+.4f} nats "
            f"from its trend ({v.watch_steps} steps; threshold {v.threshold:.4f}, loss noise {v.residual_std:.4f} "
            f"over {v.fit_steps} steps before); {f'reverting to {v.old_global_batch}' if v.reverted else kept} samples"
        )
        logged = {metrics.GUARD_RISE: verdict.rise, metrics.GUARD_THRESHOLD: verdict.threshold}
        log_to_loggers(trainer, lambda _: logged, every_step=True)

    def scheduled_change(self, index: int, consumed: int, old: int, new: int, restore: RevertRestore) -> None:
        """The guard watches an increase ``old`` -> ``new`` (samples); a decrease ends the watch it falls in."""
        if new < old and self.guard.watching:
            self.guard.forget_watch()
        elif new > old and not self.guard.watch(index, consumed, old, new, restore):
            rank_zero_info(
                f"BatchWarmup guard: {old} -> {new} is not judged: fewer than "
                f"guard.min_steps={self.guard.min_steps} steps of loss before it to fit a trend to"
            )

    def revert(
        self, trainer: pl.Trainer, schedule: BatchSchedule, lr_rule: LRRule, consumed: int, old: int, new: int
    ) -> tuple[float, float, RevertRestore]:
        """Carry out the revert ``old`` -> ``new`` (samples): the optimizers' LR and settings of before the increase,
        ``schedule`` withdraws its batches above ``new``. Return the revert's LR and clipping factors, the restore."""
        restore = self.guard.mark_reverted(consumed)
        lr_change, clip_change = 1.0 / restore.lr_factor_of_change, 1.0 / restore.clip_factor_of_change
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        for index, optimizer in enumerate(trainer.optimizers):
            scale_learning_rate(optimizer, schedulers, lr_change)
            if restore.optimizer_settings is not None:
                restore_settings(optimizer, restore.optimizer_settings[index])
            else:  # a watch from a checkpoint of the first guards kept no settings: undo adam_sde by the inverse ratio
                lr_rule.adjust_optimizer(optimizer, new / old)
        schedule.withdraw_above(new)
        return lr_change, clip_change, restore
