"""What ``BatchWarmup`` refuses (the setting and the fix) and warns about, each at the first hook that knows enough."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import Any, TypeGuard

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden

from lit_cbs.callbacks.accounting import BatchAccounting, resizable_train_loader, trainer_callbacks
from lit_cbs.callbacks.validation import TokenValidation
from lit_cbs.errors import LitCBSConfigError, require_automatic_optimization
from lit_cbs.rules.batch_schedules import BatchSchedule, CBSAdaptive, PiecewiseBatch
from lit_cbs.rules.guard import BatchGuard
from lit_cbs.rules.lr_schedules import TokenLRScheduler
from lit_cbs.rules.scaling import OptimizerRules
from lit_cbs.rules.warmup_core import WarmupCore


def check_trainer(trainer: pl.Trainer, pl_module: pl.LightningModule, warmup: WarmupCore, kind: type) -> None:
    """Refuse what would set the accumulation beside BatchWarmup (``kind``, passed in: it imports this), and a
    ``clip_rule`` without a clipping threshold to rescale."""
    require_automatic_optimization(pl_module, "BatchWarmup", "it changes accumulate_grad_batches")
    warmups = sum(isinstance(callback, kind) for callback in trainer_callbacks(trainer))
    if warmups > 1:  # Lightning refuses two at Trainer(...); this is one added to trainer.callbacks later
        raise LitCBSConfigError(
            f"the Trainer has {warmups} BatchWarmup callbacks, which would each set the batch and move the LR at "
            "their own changes: keep one, with one schedule of every change (PiecewiseBatch)"
        )
    if any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer_callbacks(trainer)):
        raise LitCBSConfigError(
            "BatchWarmup sets the accumulation itself: remove the GradientAccumulationScheduler callback"
        )
    from lightning.pytorch.strategies import DeepSpeedStrategy

    if isinstance(trainer.strategy, DeepSpeedStrategy) and not warmup.schedule.is_constant:
        raise LitCBSConfigError(
            "DeepSpeedStrategy fixes gradient accumulation at start; use ddp, fsdp or model_parallel"
        )
    if warmup.clip_rule is not None and not trainer.gradient_clip_val:
        raise LitCBSConfigError(
            f"BatchWarmup(clip_rule={warmup.clip_rule.name!r}) rescales the gradient-clipping threshold, but "
            f"Trainer(gradient_clip_val={trainer.gradient_clip_val!r}) sets none: set gradient_clip_val "
            "(e.g. 1.0), or clip_rule=None"
        )


def lacks_a_feeder(schedule: BatchSchedule, callbacks: Sequence[Any], resumed: bool) -> TypeGuard[CBSAdaptive]:
    """Whether ``schedule`` is a ``CBSAdaptive`` that nothing among ``callbacks`` feeds readings (a
    ``CBSProbeCallback``, or a callback with ``feeds_cbs_adaptive = True``); a resumed run may have none."""
    return (
        isinstance(schedule, CBSAdaptive)
        and schedule.start < schedule.final
        and not resumed
        and not any(getattr(callback, "feeds_cbs_adaptive", False) for callback in callbacks)
    )


def check_train_start(
    trainer: pl.Trainer, schedule: BatchSchedule, resumed: bool, micros: set[int], micro: int, maximum: int | None
) -> None:
    """Refuse a ``CBSAdaptive`` schedule nothing feeds (its batch would never grow), and a micro-batch that changes
    from ``micro`` (``micros``: those of every batch to come) without a ``GlobalOrderLoader``."""
    if lacks_a_feeder(schedule, trainer_callbacks(trainer), resumed=resumed):
        raise LitCBSConfigError(
            f"BatchWarmup's schedule is CBSAdaptive(start={schedule.start}, final={schedule.final}), which grows "
            "the batch only on CBS readings, but no CBSProbeCallback is among the Trainer's callbacks, so the batch "
            f"would stay {schedule.start} for the whole run: add lit_cbs.CBSProbeCallback(...) (or a callback of "
            "yours that calls schedule.observe, with feeds_cbs_adaptive = True), or use a fixed schedule "
            "(PiecewiseBatch, ConstantBatch)"
        )
    if micros == {micro}:
        return
    if resizable_train_loader(trainer) is None:
        raise LitCBSConfigError(
            f"BatchWarmup(max_micro_batch_size={maximum}) changes the micro-batch between "
            f"optimizer steps ({' -> '.join(map(str, sorted(micros)))} samples per rank), which the train loader "
            f"({type(trainer.train_dataloader).__name__}) cannot do mid-epoch: build it with "
            "lit_cbs.GlobalOrderLoader(dataset, batch_size=self.batch_size, ...), or set max_micro_batch_size=None "
            "to grow the batch by accumulation"
        )
    if trainer.limit_train_batches != 1.0:
        raise LitCBSConfigError(
            f"Trainer(limit_train_batches={trainer.limit_train_batches}) counts micro-batches, whose size "
            f"BatchWarmup(max_micro_batch_size={maximum}) changes: stop the run by max_tokens "
            "or max_steps instead"
        )


def check_optimizer_rules(trainer: pl.Trainer, warmup: WarmupCore, consumed: int, guard: BatchGuard | None) -> None:
    """``WarmupCore.check_optimizers``; warnings for rules that never act and for LR schedules indexed by optimizer
    steps, which the changes stretch."""
    ratios = warmup.check_optimizers(trainer.optimizers, [c.scheduler for c in trainer.lr_scheduler_configs], consumed)
    rules = warmup.rules
    if not ratios and rules.settings and guard is None:
        rank_zero_warn(
            f"{warmup.who}: the schedule {warmup.schedule!r} never changes the batch from {warmup.global_batch}, so "
            f"{' and '.join(f'{key}_rule' for key in rules.settings)} never act: give the optimizer the "
            "settings for this batch yourself, or drop the rules"
        )
    for config in trainer.lr_scheduler_configs if ratios else []:
        # ReduceLROnPlateau follows a monitored metric, not the step count: nothing stretches.
        if config.interval == "step" and not isinstance(
            config.scheduler, (TokenLRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        ):
            rank_zero_warn(
                f"{type(config.scheduler).__name__} is indexed by optimizer steps, but BatchWarmup changes "
                "the tokens per step, so the schedule will stretch in tokens (and "
                "trainer.estimated_stepping_batches assumes a constant batch); use "
                "lit_cbs.rules.lr_schedules.TokenLRScheduler"
            )


def warn_checkpoints_inside_accumulation(
    trainer: pl.Trainer, pl_module: pl.LightningModule, accumulations: set[int]
) -> None:
    """Warn where a ModelCheckpoint can save between the micro-batches of one optimizer step (``accumulations``:
    those of every batch to come): the half-accumulated gradient is not in the checkpoint."""
    step, every = math.lcm(*accumulations), trainer.val_check_batch
    validates_inside_epoch = (  # a TokenValidation validates after steps
        isinstance(every, int)
        and trainer.limit_val_batches != 0
        and is_overridden("validation_step", pl_module)
        and (every < trainer.num_training_batches or trainer.check_val_every_n_epoch is None)
        and not any(isinstance(callback, TokenValidation) for callback in trainer_callbacks(trainer))
    )
    for callback in trainer.checkpoint_callbacks if step > 1 else []:
        if not isinstance(callback, ModelCheckpoint):
            continue
        if callback._train_time_interval is not None:
            reason = f"train_time_interval={callback._train_time_interval} can fall on any micro-batch"
        elif callback._every_n_epochs >= 1 and validates_inside_epoch and isinstance(every, int) and every % step:
            reason = (
                f"it saves after validation, which runs every {every} micro-batches (val_check_interval), "
                f"not a multiple of the accumulation {step}"
            )
        else:
            continue
        rank_zero_warn(
            f"ModelCheckpoint may save inside an accumulation window ({reason}); a run resumed from such a "
            f"checkpoint loses the half-accumulated gradient. Checkpoint on optimizer steps with "
            f"ModelCheckpoint(every_n_train_steps=...), or set val_check_interval to a multiple of {step} "
            f"micro-batches (e.g. {-(-every // step) * step if isinstance(every, int) else step})"
        )


def check_first_batch(
    trainer: pl.Trainer,
    schedule: BatchSchedule,
    accounting: BatchAccounting,
    global_batch: int,
    samples_before_step: int | None,
) -> None:
    """At the first batch, where the accounting has seen one: refuse a schedule in tokens on data without tokens;
    warn about every global batch to come that the run ends before (by max_tokens, max_steps or max_epochs),
    walking the phases from ``global_batch`` as BatchWarmup takes them."""
    if schedule.unit == "tokens" and accounting.seq_len is None:
        raise LitCBSConfigError(
            "BatchWarmup has schedule unit='tokens' but the batches hold no token ids (no 2-D integer "
            "tensor), so it cannot count tokens: use unit='samples' for such data, or pass "
            "BatchWarmup(seq_len=...) / give the datamodule a `tokens_per_sample` attribute if it is token data"
        )
    if isinstance(schedule, CBSAdaptive):
        return  # its batches come from readings, not from the consumed count
    seq_len, unit = accounting.seq_len or 0, schedule.unit  # 0 for data without tokens
    samples = samples_before_step if samples_before_step is not None else accounting.samples_seen
    start = {"samples": samples, "tokens": accounting.tokens_seen - (accounting.samples_seen - samples) * seq_len}
    if not (limits := _run_limits(trainer, accounting, samples)):  # (setting, unit, amount left)
        return
    batch, reached, used = global_batch, {global_batch}, {"steps": 0, "samples": 0, "tokens": 0}

    def changed(steps: int) -> bool:  # whether the schedule asks for another batch after ``steps`` more at ``batch``
        return schedule.batch_size(start[unit] + used[unit] + steps * per[unit]) != batch

    while True:
        per = {"steps": 1, "samples": batch, "tokens": batch * seq_len}
        left = [max(0, -(-(amount - used[u]) // per[u])) for _, u, amount in limits]  # steps at ``batch``
        if not ((k := min(left)) and changed(k)):
            break
        # The fewest steps to a change (a schedule moves one way with what is consumed).
        high = bisect.bisect_left(range(1, k + 1), True, key=changed) + 1
        used = {name: count + high * per[name] for name, count in used.items()}
        batch = schedule.batch_size(start[unit] + used[unit])
        reached.add(batch)
    consumed = accounting.tokens_seen if unit == "tokens" else accounting.samples_seen
    never = [size for size in schedule.sizes(consumed) if size not in reached]
    if not never:
        return
    ending = limits[left.index(k)][0]
    samples, tokens = (start[name] + used[name] + k * per[name] for name in ("samples", "tokens"))  # where it ends
    where, hint = ", ".join(map(str, never)), ""
    if isinstance(schedule, PiecewiseBatch):
        starts = dict(zip(schedule.batch_sizes, schedule.thresholds))
        where = ", ".join(f"{size} (from {starts[size]:,} {unit})" for size in never)
        thresholds = [t for t, size in zip(schedule.thresholds, schedule.batch_sizes) if size in never]
        if unit == "samples" and seq_len and thresholds and thresholds[0] <= tokens:
            hint = (
                "; its thresholds are in samples (unit='samples'), but read as tokens they fall inside the run: "
                "did you mean unit='tokens'?"
            )
    at = f"{samples:,} samples" + (f" / {tokens:,} tokens" if seq_len else "")
    rank_zero_warn(
        f"BatchWarmup: the run ends by {ending} at {at}, before the schedule's global batch {where}: "
        f"{'it never trains' if len(never) == 1 else 'they never train'} in this fit. Raise the limit, or move the "
        f"schedule's thresholds (a run stopped here to resume elsewhere goes on with them){hint}"
    )


def _run_limits(trainer: pl.Trainer, accounting: BatchAccounting, samples: int) -> list[tuple[str, str, int]]:
    limits = []
    samples_seen, seq_len, max_tokens = accounting.samples_seen, accounting.seq_len, accounting.max_tokens
    if max_tokens is not None and seq_len:
        left = max_tokens - accounting.tokens_seen + (samples_seen - samples) * seq_len
        limits.append((f"max_tokens={max_tokens:,}", "tokens", left))
    if trainer.max_steps is not None and trainer.max_steps >= 0:
        limits.append((f"Trainer(max_steps={trainer.max_steps:,})", "steps", trainer.max_steps - trainer.global_step))
    if trainer.max_epochs is not None and trainer.max_epochs >= 0:
        micro = (accounting.micro_batch_size or 0) * accounting.data_parallel_size  # read off the first batch
        if (loader := resizable_train_loader(trainer)) is not None:
            per_epoch, this_epoch = loader.num_samples, loader.position
        elif isinstance(trainer.num_training_batches, int):
            per_epoch = trainer.num_training_batches * micro
            this_epoch = trainer.fit_loop.epoch_loop.batch_progress.current.ready * micro
        else:
            return limits  # an iterable of unknown length
        left = (trainer.max_epochs - trainer.current_epoch) * per_epoch - this_epoch + (samples_seen - samples)
        limits.append((f"Trainer(max_epochs={trainer.max_epochs}) ({per_epoch:,} samples per epoch)", "samples", left))
    return limits


def check_settings_kept(
    rules: OptimizerRules,
    settings_set: list[list[dict[str, Any]]],
    trainer: pl.Trainer,
    optimizer: torch.optim.Optimizer,
) -> None:
    """Refuse a setting the ``rules`` move that something else wrote since BatchWarmup did (``settings_set``)."""
    index = next(i for i, candidate in enumerate(trainer.optimizers) if candidate is optimizer)
    for number, (group, saved) in enumerate(zip(optimizer.param_groups, settings_set[index])):
        for key in rules.settings:
            now, then = rules.get(key, group), rules.get(key, saved)
            if now != then:
                raise LitCBSConfigError(
                    f"BatchWarmup({key}_rule={rules.rule_name(key)!r}) set {key}={then:.6g} in param group {number}, "
                    f"but at step {trainer.global_step} it is {now:.6g}: something else writes it (a callback, an LR "
                    f"scheduler or the module's optimizer_step); remove that writer or set {key}_rule=None"
                )
