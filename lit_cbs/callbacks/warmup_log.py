"""What ``BatchWarmup`` reports of a run: the row of metrics it writes for each optimizer step (``log_every_step``)
and the line it says at each change of the batch. ``WarmupStepLog`` keeps what a row needs from the start of its
step (the LR and the settings the rules move that the step trains with, and the samples seen before it) and writes
the row straight to the loggers (``lit_cbs.callbacks.logs.log_to_loggers``), building it on logging steps only: a
step of a small model pays for an attribute or two, not for Lightning's ``self.log`` of every metric.

Each row describes the optimizer step it belongs to, as Lightning's LearningRateMonitor does: the batch, accumulation
and LR that step trained with, and the counts including it (the metrics' names are in ``lit_cbs.metrics``).
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info

from lit_cbs import metrics
from lit_cbs.callbacks.accounting import BatchAccounting
from lit_cbs.callbacks.batch_change import BatchChange
from lit_cbs.callbacks.logs import log_to_loggers
from lit_cbs.rules.guard import BatchGuard
from lit_cbs.rules.scaling import OptimizerRules, ScalingRule

__all__: list[str] = []  # internal: what other lit_cbs modules use, nothing a user calls


class WarmupStepLog:
    """``BatchWarmup``'s row of metrics for each optimizer step, and its line for each change.

    BatchWarmup hands it the Trainer's ``BatchAccounting`` (the counts) and its own global batch and LR factor at each
    call; what it keeps between calls is what the row of the step under way needs from the step's start.
    """

    def __init__(self, rules: OptimizerRules, clip_rule: ScalingRule | None, guard: BatchGuard | None):
        self.rules = rules
        self.clip_rule = clip_rule
        self.guard = guard
        self.step_lr: float | None = None  # the LR the step just taken trained with (param group 0's)
        self.step_settings: dict[str, float] = {}  # batch/weight_decay, batch/beta2 of the step just taken
        self.samples_before_step: int | None = None  # samples_seen after the previous optimizer step

    def before_optimizer_step(self, optimizer) -> None:
        """Keep the LR and the rules' settings of ``optimizer`` that the step about to be taken trains with."""
        self.step_lr = float(optimizer.param_groups[0]["lr"])
        if self.rules.settings:
            self.step_settings = self.rules.values(optimizer)

    def log(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        counts: BatchAccounting,
        global_batch: int,
        lr_factor: float,
    ) -> None:
        """Show the tokens (samples for data without tokens) in the progress bar, and write the row of the optimizer
        step just taken to the loggers on a logging step; call it before any change, so the row is that step's."""
        if trainer.progress_bar_callback is not None:
            name, value = ("tokens", counts.tokens_seen) if counts.seq_len else ("samples", counts.samples_seen)
            pl_module.log(name, float(value), on_step=True, on_epoch=False, logger=False, prog_bar=True)
        log_to_loggers(trainer, lambda trainer: self.metrics(trainer, counts, global_batch, lr_factor))

    def metrics(
        self, trainer: pl.Trainer, counts: BatchAccounting, global_batch: int, lr_factor: float
    ) -> dict[str, float]:
        """The row of the optimizer step just taken: metric name -> value."""
        # What the step trained on: the global batch, but fewer samples in an epoch's short last step.
        before = self.samples_before_step
        micro = counts.micro_batch_size
        assert micro is not None  # set at BatchWarmup's setup
        samples = counts.samples_seen - before if before is not None else global_batch
        logged = {
            metrics.GLOBAL_BATCH: float(samples),
            metrics.MICRO_BATCH: float(micro),
            # Rounds of micro-batches: an epoch's last, short round counts as one.
            metrics.ACCUMULATE: float(-(-samples // (micro * counts.data_parallel_size))),
            metrics.LR_FACTOR: lr_factor,
            metrics.SAMPLES_SEEN: float(counts.samples_seen),
            metrics.TOKENS_SEEN: float(counts.tokens_seen),
            metrics.FIT_SECONDS: counts.fit_seconds,
        }
        if self.step_lr is not None:
            logged[metrics.LR] = self.step_lr
        logged.update(self.step_settings)
        if self.clip_rule is not None:
            # BatchWarmup refuses a clip_rule without a threshold (warmup_checks.check_clip_rule)
            assert trainer.gradient_clip_val is not None
            logged[metrics.GRADIENT_CLIP_VAL] = float(trainer.gradient_clip_val)
        if self.guard is not None:
            logged[metrics.GUARD_REVERTS] = float(self.guard.reverts)
        if not counts.has_tokens:
            del logged[metrics.TOKENS_SEEN]
        return logged

    def announce(self, trainer: pl.Trainer, change: BatchChange, counts: BatchAccounting) -> None:
        """Say ``change``, just applied: the batch's three factors before and after, the counts, the LR factor and
        the settings the rules moved (param group 0's of the first optimizer), and the clipping threshold."""
        rank_zero_info(
            f"BatchWarmup: global batch {change.old_global_batch} -> {change.new_global_batch} samples "
            f"(micro {change.old_micro_batch_size} -> {change.new_micro_batch_size}, "
            f"accumulate {change.old_accumulate} -> {change.new_accumulate}) after step {change.step}, "
            f"{counts.samples_seen:,} samples / {counts.tokens_seen:,} tokens; "
            f"LR x{change.lr_factor:.4g}"
            + "".join(f", {rule.key} {rule.value(trainer.optimizers[0]):.4g}" for rule in self.rules.settings)
            + (f", gradient clipping at {trainer.gradient_clip_val:.4g}" if self.clip_rule is not None else "")
            + (" (guard: revert)" if change.cause == "guard" else "")
        )
