"""``BatchWarmup``: the Lightning adapter of ``lit_cbs.rules.warmup_core.WarmupCore``, and its guard's side."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.data import extract_batch_size

from lit_cbs import metrics
from lit_cbs._internals import should_accumulate
from lit_cbs.callbacks import warmup_checks as checks
from lit_cbs.callbacks.accounting import (
    BatchAccounting,
    mean_over_ranks,
    micro_batch_loss,
    micro_batch_owner,
    resizable_train_loader,
)
from lit_cbs.callbacks.logs import log_to_loggers
from lit_cbs.errors import LitCBSConfigError, positive_int
from lit_cbs.rules.batch_schedules import BatchSchedule
from lit_cbs.rules.guard import BatchGuard, RevertRestore
from lit_cbs.rules.scaling import (
    BETA2_FLOOR,
    LRRule,
    ScalingRule,
    optimizer_settings,
    restore_settings,
    scale_learning_rate,
)
from lit_cbs.rules.warmup_core import Batch, WarmupCore

__all__ = ["BatchWarmup"]


class BatchWarmup(WarmupCore, Callback):
    """Change the global batch size (and scale the LR) during training by ``schedule``.

    global batch (samples) = micro-batch x ``accumulate`` x data-parallel size; the counts live in the Trainer's
    ``BatchAccounting`` (``accounting``).

    Args:
        schedule: a ``lit_cbs.rules.batch_schedules`` schedule: samples or tokens consumed -> global batch.
        lr_rule: "sqrt" (Adam), "linear" (SGD), "none", "adam_sde", or a callable ratio -> LR factor.
        max_tokens: the token budget (all ranks), for the ``BatchAccounting``.
        seq_len: tokens per sample, for the ``BatchAccounting``.
        max_micro_batch_size: grow the micro-batch (samples per rank) up to this before the accumulation; needs
            a ``lit_cbs.GlobalOrderLoader``. None: the micro-batch stays the datamodule's ``batch_size``.
        log_every_step: log ``batch/*``, the counts, ``fit_seconds`` and ``lr`` of each optimizer step to the
            trainer's loggers (at ``log_every_n_steps``), and the tokens (or samples) in the progress bar.
        clip_rule: multiply ``Trainer(gradient_clip_val=...)`` by ``clip_rule(new / old)`` ("sqrt", "linear",
            a callable).
        guard: revert an increase after which the training loss rises above its trend: True or a dict of
            ``BatchGuard``'s keyword arguments. None: no guard.
        weight_decay_rule: "timescale": weight decay x k / f(k) at a change by k with LR factor f(k).
        beta2_rule: "half_life": beta2 -> beta2 ** k. Not with lr_rule="adam_sde".
        beta2_floor: the lowest beta2 the half_life rule moves to (None: no floor).

    Examples:
        >>> from lit_cbs.callbacks import BatchWarmup
        >>> from lit_cbs.rules.batch_schedules import LinearRamp
        >>> warmup = BatchWarmup(
        ...     LinearRamp(start=64, increment=64, ramp=10_000, final=256), lr_rule="sqrt", max_micro_batch_size=16
        ... )
        >>> warmup.schedule.sizes(0), warmup.lr_rule.factor(256 / 64)  # the batches to come; 4x the batch: 2x LR
        ([64, 128, 192, 256], 2.0)
        >>> BatchWarmup(256)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lit_cbs.errors.LitCBSConfigError: schedule must be a lit_cbs.rules.batch_schedules schedule (...), got 256
    """

    def __init__(
        self,
        schedule: BatchSchedule,
        lr_rule: str | Callable[[float], float] | LRRule = "sqrt",
        max_tokens: int | None = None,
        seq_len: int | None = None,
        max_micro_batch_size: int | None = None,
        log_every_step: bool = True,
        clip_rule: str | Callable[[float], float] | ScalingRule | None = None,
        guard: bool | dict[str, Any] | None = None,
        weight_decay_rule: str | None = None,
        beta2_rule: str | None = None,
        beta2_floor: float | None = BETA2_FLOOR,
    ):
        super().__init__(schedule, lr_rule, max_micro_batch_size, clip_rule, weight_decay_rule, beta2_rule, beta2_floor)
        self.guard = BatchGuard.from_setting(guard)
        self._guarded = _WarmupGuard(self.guard) if self.guard is not None else None
        # The accounting's settings, taken on its behalf and handed to it in setup.
        self.seq_len = positive_int("seq_len", seq_len, "tokens per sample", optional=True)
        self.max_tokens = positive_int("max_tokens", max_tokens, "tokens", optional=True)
        self.log_every_step = log_every_step
        self.accounting: BatchAccounting | None = None  # the Trainer's, from setup on
        self._base_gradient_clip_val: float | None = None  # the Trainer's, before any change
        self._token_settings_checked = False
        self._restored = False  # this fit's state came from a checkpoint (load_state_dict)
        self._settings_set: list[list[dict[str, Any]]] | None = None  # what the rules last left in each optimizer
        self._step_lr: float | None = None  # the LR the step under way trains with (param group 0's)
        self._step_settings: dict[str, float] = {}  # batch/weight_decay, batch/beta2 of the step under way
        self._samples_before_step: int | None = None  # samples_seen after the previous optimizer step

    @property
    def _counts(self) -> BatchAccounting:
        if self.accounting is None:
            raise RuntimeError("BatchWarmup has no BatchAccounting: its setup(trainer, pl_module, 'fit') has not run")
        return self.accounting

    @property
    def _batch(self) -> int:
        if self.global_batch is None:
            raise RuntimeError("BatchWarmup has no global batch: its setup(trainer, pl_module, 'fit') has not run")
        return self.global_batch

    @property
    def consumed(self) -> int:
        """What the schedule is indexed by: samples or tokens seen (all ranks)."""
        return self.consumed_at(self._counts.samples_seen, self._counts.tokens_seen)

    def lacks_a_feeder(self, callbacks: list[Callback], resumed: bool) -> bool:
        """Whether nothing among ``callbacks`` feeds a ``CBSAdaptive`` schedule its readings."""
        return checks.lacks_a_feeder(self.schedule, callbacks, resumed)

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        checks.check_trainer(trainer, pl_module, self, BatchWarmup)
        settings = {"seq_len": self.seq_len, "max_tokens": self.max_tokens}
        accounting = self.accounting = BatchAccounting.attach(trainer, "BatchWarmup", **settings)
        self._restored = False  # load_state_dict sets it again: Lightning restores a checkpoint after setup
        self._base_gradient_clip_val = trainer.gradient_clip_val
        self.start(micro_batch_owner(trainer, pl_module).batch_size, accounting.data_parallel_size)
        if trainer.accumulate_grad_batches not in (1, self.accumulate):
            raise LitCBSConfigError(
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) conflicts with BatchWarmup, "
                f"whose schedule starts at accumulate={self.accumulate}; leave accumulate_grad_batches at 1"
            )
        self._apply_batch()

    def _apply_batch(self) -> None:
        """Train at the core's batch from the next micro-batch on: the one place it reaches the Trainer."""
        accounting = self._counts
        trainer = accounting.trainer
        assert trainer is not None and self.accumulate is not None and self.micro_batch_size is not None
        trainer.accumulate_grad_batches = self.accumulate
        if self.clip_rule is not None:
            base = self._base_gradient_clip_val
            assert base is not None  # check_trainer refuses a clip_rule without gradient_clip_val
            trainer.gradient_clip_val = base * self.clip_factor
        accounting.set_micro_batch_size(self.micro_batch_size)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        checks.check_optimizer_rules(trainer, self, self.consumed, self.guard)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        accounting = self._counts
        self._samples_before_step = accounting.samples_seen
        self._remember_settings(trainer)  # a resumed run's come from the checkpoint's param groups
        assert self.micro_batch_size is not None  # setup set it
        micros = {self.micro_batch_for(size) for size in self._sizes_to_come()}
        maximum = self.max_micro_batch_size
        checks.check_train_start(trainer, self.schedule, self._restored, micros, self.micro_batch_size, maximum)
        if accounting.checkpoint_data_parallel_size not in (None, accounting.data_parallel_size):
            self._regroup_for_new_ranks(trainer)
        ranks = accounting.data_parallel_size
        steps = {size // (self.micro_batch_for(size) * ranks) for size in self.schedule.sizes(self.consumed)}
        checks.warn_checkpoints_inside_accumulation(trainer, pl_module, steps | {accounting.accumulate})
        if accounting.budget_reached:
            return  # resumed from a run's final state: the accounting stops the run
        # A change the schedule asked for after a run's last step was not applied then (no step used
        # it); a run resumed from there with a larger budget applies it now, where it would have been.
        if not _no_step_follows(trainer):
            self._maybe_change(trainer)

    def _sizes_to_come(self) -> list[int]:
        """Every global batch the run may still train at: the schedule's, and those a guard may revert to."""
        return sorted(
            {self._batch, *self.schedule.sizes(self.consumed), *(self.guard.sizes_needed() if self.guard else [])}
        )

    def _regroup_for_new_ranks(self, trainer: pl.Trainer) -> None:
        """Resumed on another number of data-parallel ranks: the global batch, LR and data position go on; the
        micro-batch and accumulation are chosen for the ranks now, from a step boundary."""
        accounting = self._counts
        before = accounting.checkpoint_data_parallel_size
        assert before is not None and self.micro_batch_size is not None
        ranks = self.data_parallel_size = accounting.data_parallel_size
        if (loader := resizable_train_loader(trainer)) is None:  # another loader would skip or repeat samples
            raise LitCBSConfigError(
                f"the checkpoint was trained on {before} data-parallel ranks and this run has {ranks}: the train "
                f"loader ({type(trainer.train_dataloader).__name__}) splits its samples by rank, so going on would "
                f"skip or repeat samples; build it with lit_cbs.GlobalOrderLoader (one order for any number of "
                f"ranks), or resume on {before} ranks"
            )
        self.check_sizes(self._sizes_to_come(), self.micro_batch_size, ranks, name=f"global batch on {ranks} ranks")
        old = (self.micro_batch_size, self.accumulate)
        micro = self.micro_batch_for(self._batch)
        accumulate = self._batch // (micro * ranks)
        self._pad_epoch_to(trainer, accumulate)  # the position is a multiple of the batch
        self.micro_batch_size, self.accumulate = micro, accumulate
        self._apply_batch()
        rank_zero_info(
            f"BatchWarmup: resumed on {ranks} data-parallel rank(s) (the checkpoint's run had {before}): global batch "
            f"{self.global_batch} = micro {micro} x accumulate {accumulate} x {ranks} (was micro "
            f"{old[0]} x accumulate {old[1]} x {before}), from sample {loader.position:,} of epoch {loader.epoch}"
        )

    # ------------------------------------------------------------------ per batch
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # The accounting's hook ran first: it has resolved seq_len from this batch.
        if not self._token_settings_checked:
            self._token_settings_checked = True
            before = self._samples_before_step
            checks.check_first_batch(trainer, self.schedule, self._counts, self._batch, before)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self.rules.settings:
            assert self._settings_set is not None  # remembered at train start, and at every change
            checks.check_settings_kept(self.rules, self._settings_set, trainer, optimizer)
            self._step_settings = self.rules.values(optimizer)
        self._step_lr = float(optimizer.param_groups[0]["lr"])  # for the row of the step about to be taken

    def _remember_settings(self, trainer: pl.Trainer) -> None:  # what the rules last left in each optimizer
        if self.rules.settings:
            self._settings_set = [optimizer_settings(optimizer) for optimizer in trainer.optimizers]

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._guarded is not None:
            self._guarded.add_micro_batch(trainer, outputs, batch)
        if should_accumulate(trainer):
            return  # no optimizer step this batch
        if self.log_every_step:  # before any change: this row is the step just taken
            counts = self._counts  # the tokens (samples for data without tokens) in the progress bar
            if trainer.progress_bar_callback is not None:
                name, value = ("tokens", counts.tokens_seen) if counts.seq_len else ("samples", counts.samples_seen)
                pl_module.log(name, float(value), on_step=True, on_epoch=False, logger=False, prog_bar=True)
            log_to_loggers(trainer, self._step_row)
        self._samples_before_step = self._counts.samples_seen
        if self._guarded is not None:
            self._guarded.end_step(trainer, self.consumed, self.schedule.unit, self._counts.data_parallel_size)
        if not _no_step_follows(trainer):
            self._maybe_change(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Between epochs any accumulation fits: the next epoch starts at batch 0.
        if _no_step_follows(trainer) or trainer.current_epoch + 1 == trainer.max_epochs:
            return
        self._maybe_change(trainer, between_epochs=True)

    # ------------------------------------------------------------------ changes
    @staticmethod
    def _pad_epoch_to(trainer: pl.Trainer, accumulate: int) -> None:
        """Round Lightning's count of this epoch's micro-batches, and a ``GlobalOrderLoader``'s, up to a multiple
        of ``accumulate``: Lightning steps on multiples of it, and the micro-batch (or the ranks) may have changed
        this epoch. With another loader the micro-batch is fixed, and ``may_change`` implies the count is one."""
        progress, fetcher = trainer.fit_loop.epoch_loop.batch_progress, trainer.fit_loop._data_fetcher
        behind = -progress.current.ready % accumulate
        if behind:
            loader = resizable_train_loader(trainer)
            assert loader is not None
            # Before the epoch loop starts (a resumed run's on_train_start) the fetcher's count is 0; the loop adds it.
            if fetcher is not None and fetcher.fetched == progress.current.ready:
                fetcher.fetched += behind
            progress.increment_by(behind, is_last_batch=progress.is_last_batch)
            loader.micro_batches += behind

    def _maybe_change(self, trainer: pl.Trainer, between_epochs: bool = False) -> None:
        counts, guard, batch = self._counts, self.guard, self._batch
        allowed = None
        if guard is not None:
            consumed = self.consumed

            def allowed(target: int) -> int:
                return guard.allowed_batch(target, batch, consumed)

        new = self.wanted(counts.samples_seen, counts.tokens_seen, allowed)
        if new is None:
            return
        if not between_epochs:
            loader = resizable_train_loader(trainer)
            assert self.micro_batch_size is not None  # setup set it
            ready = trainer.fit_loop.epoch_loop.batch_progress.current.ready
            position = (
                loader.position if loader is not None else ready * self.micro_batch_size * self.data_parallel_size
            )
            if not self.may_change(position, new[0]):  # position: samples consumed this epoch, all ranks
                return
            self._pad_epoch_to(trainer, new[2])
        self._apply_change(trainer, new)

    def _apply_change(self, trainer: pl.Trainer, new: Batch) -> None:
        """Train at ``new`` from the next optimizer step on: move the optimizers' settings (or, for the guard's
        revert, put back those of before the increase), record the change, tell the guard, resize, say so."""
        guarded, counts, target = self._guarded, self._counts, new[0]
        if guarded is not None and guarded.guard.revert_to == target:
            revert = guarded.revert(trainer, self.schedule, self.lr_rule, self.consumed, self._batch, target)
            lr_change, clip_change, restore = revert
            factors, cause = (restore.lr_factor, restore.clip_factor), "guard"
        else:
            settings_before = [optimizer_settings(optimizer) for optimizer in trainer.optimizers] if guarded else None
            schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
            lr_change, clip_change = self.scale(
                trainer.optimizers, schedulers, target, warn=lambda why: rank_zero_warn(f"BatchWarmup: {why}")
            )
            if guarded is not None:  # it watches an increase, keeping what a revert of it puts back
                restore = RevertRestore(self.lr_factor, self.clip_factor, lr_change, clip_change, settings_before)
                guarded.scheduled_change(len(self.history), self.consumed, self._batch, target, restore)
            factors, cause = (self.lr_factor * lr_change, self.clip_factor * clip_change), "schedule"
        at = (trainer.global_step, trainer.current_epoch, counts.samples_seen, counts.tokens_seen)
        change = self.record(new, (lr_change, clip_change), factors, at, cause)
        self._apply_batch()  # the loader yields the new micro-batch from the next one on
        self._remember_settings(trainer)
        rank_zero_info(
            f"BatchWarmup: global batch {change.old_global_batch} -> {change.new_global_batch} samples "
            f"(micro {change.old_micro_batch_size} -> {change.new_micro_batch_size}, "
            f"accumulate {change.old_accumulate} -> {change.new_accumulate}) after step {change.step}, "
            f"{counts.samples_seen:,} samples / {counts.tokens_seen:,} tokens; "
            f"LR x{change.lr_factor:.4g}"
            + "".join(f", {key} {self.rules.value(key, trainer.optimizers[0]):.4g}" for key in self.rules.settings)
            + (f", gradient clipping at {trainer.gradient_clip_val:.4g}" if self.clip_rule is not None else "")
            + (" (guard: revert)" if change.cause == "guard" else "")
        )

    # ------------------------------------------------------------------ logging
    def _step_row(self, trainer: pl.Trainer) -> dict[str, float]:
        """The row of the optimizer step just taken: the batch, accumulation and LR it trained with (an epoch's
        short last step: the samples and micro-batches it had), and the counts including it."""
        counts, before = self._counts, self._samples_before_step
        micro = counts.micro_batch_size
        assert micro is not None  # set at setup
        samples = counts.samples_seen - before if before is not None else self._batch
        row = {
            metrics.GLOBAL_BATCH: float(samples),
            metrics.MICRO_BATCH: float(micro),
            # Rounds of micro-batches: an epoch's last, short round counts as one.
            metrics.ACCUMULATE: float(-(-samples // (micro * counts.data_parallel_size))),
            metrics.LR_FACTOR: self.lr_factor,
            metrics.SAMPLES_SEEN: float(counts.samples_seen),
            metrics.TOKENS_SEEN: float(counts.tokens_seen),
            metrics.FIT_SECONDS: counts.fit_seconds,
        }
        if self._step_lr is not None:
            row[metrics.LR] = self._step_lr
        row.update(self._step_settings)
        if self.clip_rule is not None:
            assert trainer.gradient_clip_val is not None  # check_trainer refuses a clip_rule without one
            row[metrics.GRADIENT_CLIP_VAL] = float(trainer.gradient_clip_val)
        if self.guard is not None:
            row[metrics.GUARD_REVERTS] = float(self.guard.reverts)
        if counts.seq_len is None:
            del row[metrics.TOKENS_SEEN]
        return row

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        guarded = self._guarded.state_dict() if self._guarded is not None else {"guard": None, "step_loss": [0.0, 0]}
        return {**super().state_dict(), **guarded}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = True
        super().load_state_dict(state_dict)
        if self._guarded is not None:
            self._guarded.load_state_dict(state_dict)
        # On resume Lightning calls setup first, then this: the checkpoint's accumulate and micro-batch win.
        if self.accounting is not None:
            self._apply_batch()


def _no_step_follows(trainer: pl.Trainer) -> bool:
    """True after the run's final optimizer step: a change there would be recorded and checkpointed unused."""
    return trainer.should_stop or (trainer.max_steps >= 0 and trainer.global_step >= trainer.max_steps)


class _WarmupGuard:
    """BatchWarmup's side of its guard: feeds ``guard`` each optimizer step's loss and carries out its reverts."""

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
