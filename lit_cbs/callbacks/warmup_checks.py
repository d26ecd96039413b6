"""What ``BatchWarmup`` refuses (the setting and the fix) and warns about, each at the first hook that knows enough."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, TypeGuard

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden

from lit_cbs.callbacks.accounting import BatchAccounting, resizable_train_loader, trainer_callbacks
from lit_cbs.callbacks.validation import TokenValidation
from lit_cbs.data.loader import GlobalOrderLoader
from lit_cbs.errors import LitCBSConfigError, require_automatic_optimization
from lit_cbs.rules.batch_schedules import BatchSchedule, CBSAdaptive, PiecewiseBatch
from lit_cbs.rules.guard import BatchGuard
from lit_cbs.rules.lr_schedules import TokenLRScheduler
from lit_cbs.rules.scaling import OptimizerRules, ScalingRule
from lit_cbs.rules.warmup_core import WarmupCore


def check_trainer(
    trainer: pl.Trainer, pl_module: pl.LightningModule, schedule: BatchSchedule, warmup_class: type[Callback]
) -> None:
    """Refuse what would set the accumulation beside BatchWarmup (``warmup_class``, passed in: it imports this)."""
    require_automatic_optimization(pl_module, "BatchWarmup", "it changes accumulate_grad_batches")
    warmups = sum(isinstance(callback, warmup_class) for callback in trainer_callbacks(trainer))
    if warmups > 1:  # Lightning refuses two at Trainer(...); this is one added to trainer.callbacks later
        raise LitCBSConfigError(
            f"the Trainer has {warmups} BatchWarmup callbacks, which would each set the batch and move the LR at "
            "their own changes: keep one, with one schedule of every change (PiecewiseBatch)"
        )
    if any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer_callbacks(trainer)):
        fix = "remove the GradientAccumulationScheduler callback"
        raise LitCBSConfigError(f"BatchWarmup sets the accumulation itself: {fix}")
    from lightning.pytorch.strategies import DeepSpeedStrategy

    if isinstance(trainer.strategy, DeepSpeedStrategy) and not schedule.is_constant:
        fix = "use ddp, fsdp or model_parallel"
        raise LitCBSConfigError(f"DeepSpeedStrategy fixes gradient accumulation at start; {fix}")


def check_clip_rule(clip_rule: ScalingRule | None, trainer: pl.Trainer) -> None:
    """A ``clip_rule`` needs a clipping threshold to rescale: ``Trainer(gradient_clip_val=...)``."""
    if clip_rule is not None and not trainer.gradient_clip_val:
        raise LitCBSConfigError(
            f"BatchWarmup(clip_rule={clip_rule.name!r}) rescales the gradient-clipping threshold, but "
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


def check_adaptive_is_fed(schedule: BatchSchedule, trainer: pl.Trainer, resumed: bool) -> None:
    """Refuse a ``CBSAdaptive`` schedule that nothing feeds readings: its batch would never grow."""
    if lacks_a_feeder(schedule, trainer_callbacks(trainer), resumed=resumed):
        raise LitCBSConfigError(
            f"BatchWarmup's schedule is CBSAdaptive(start={schedule.start}, final={schedule.final}), which grows "
            "the batch only on CBS readings, but no CBSProbeCallback is among the Trainer's callbacks, so the batch "
            f"would stay {schedule.start} for the whole run: add lit_cbs.CBSProbeCallback(...) (or a callback of "
            "yours that calls schedule.observe, with feeds_cbs_adaptive = True), or use a fixed schedule "
            "(PiecewiseBatch, ConstantBatch)"
        )


def check_accumulation(trainer: pl.Trainer, accumulate: int) -> None:
    """The Trainer's ``accumulate_grad_batches`` must be 1 or the ``accumulate`` BatchWarmup starts with."""
    if trainer.accumulate_grad_batches not in (1, accumulate):
        raise LitCBSConfigError(
            f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) conflicts with BatchWarmup, "
            f"whose schedule starts at accumulate={accumulate}; leave accumulate_grad_batches at 1"
        )


def check_optimizer_rules(trainer: pl.Trainer, warmup: WarmupCore, consumed: int, guard: BatchGuard | None) -> None:
    """``WarmupCore.check_optimizers``; warnings for rules that never act and for LR schedules indexed by optimizer
    steps, which the changes stretch."""
    schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
    ratios = warmup.check_optimizers(trainer.optimizers, schedulers, consumed)
    rules, schedule, global_batch, who = warmup.rules, warmup.schedule, warmup.global_batch, warmup.who
    if not ratios:
        if rules.settings and guard is None:
            rank_zero_warn(
                f"{who}: the schedule {schedule!r} never changes the batch from {global_batch}, so "
                f"{' and '.join(f'{key}_rule' for key in rules.settings)} never act: give the optimizer the "
                "settings for this batch yourself, or drop the rules"
            )
        return
    for config in trainer.lr_scheduler_configs:
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


def check_loader_resizes(trainer: pl.Trainer, micros: set[int], micro_batch_size: int, maximum: int | None) -> None:
    """A micro-batch that changes (``micros``: those of every batch to come) needs a ``GlobalOrderLoader``."""
    if micros == {micro_batch_size}:
        return
    loader = resizable_train_loader(trainer)
    if loader is None:
        name = type(trainer.train_dataloader).__name__
        raise LitCBSConfigError(
            f"BatchWarmup(max_micro_batch_size={maximum}) changes the micro-batch between "
            f"optimizer steps ({' -> '.join(map(str, sorted(micros)))} samples per rank), which the train loader "
            f"({name}) cannot do mid-epoch: build it with lit_cbs.GlobalOrderLoader(dataset, "
            "batch_size=self.batch_size, ...), or set max_micro_batch_size=None to grow the batch by accumulation"
        )
    if trainer.limit_train_batches != 1.0:
        raise LitCBSConfigError(
            f"Trainer(limit_train_batches={trainer.limit_train_batches}) counts micro-batches, whose size "
            f"BatchWarmup(max_micro_batch_size={maximum}) changes: stop the run by max_tokens "
            "or max_steps instead"
        )


def check_loader_regroups(trainer: pl.Trainer, before: int, ranks: int) -> GlobalOrderLoader:
    """The ``GlobalOrderLoader`` of a run resumed on ``ranks`` ranks from ``before``; another would skip or repeat."""
    loader = resizable_train_loader(trainer)
    if loader is None:
        raise LitCBSConfigError(
            f"the checkpoint was trained on {before} data-parallel ranks and this run has {ranks}: the train "
            f"loader ({type(trainer.train_dataloader).__name__}) splits its samples by rank, so going on would "
            f"skip or repeat samples; build it with lit_cbs.GlobalOrderLoader (one order for any number of "
            f"ranks), or resume on {before} ranks"
        )
    return loader


def warn_checkpoints_inside_accumulation(
    trainer: pl.Trainer, pl_module: pl.LightningModule, accumulations: set[int]
) -> None:
    """Warn where a ModelCheckpoint can save between the micro-batches of one optimizer step (``accumulations``:
    those of every batch to come): the half-accumulated gradient is not in the checkpoint."""
    step = math.lcm(*accumulations)
    if step == 1:
        return
    validation_batch = trainer.val_check_batch
    validates_inside_epoch = (
        isinstance(validation_batch, int)
        and trainer.limit_val_batches != 0
        and is_overridden("validation_step", pl_module)
        and (validation_batch < trainer.num_training_batches or trainer.check_val_every_n_epoch is None)
        and not any(
            isinstance(callback, TokenValidation) for callback in trainer_callbacks(trainer)
        )  # validates after steps
    )
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint):
            continue
        time_interval, every_n_epochs = callback._train_time_interval, callback._every_n_epochs
        if time_interval is not None:
            reason = f"train_time_interval={time_interval} can fall on any micro-batch"
        elif (
            every_n_epochs >= 1
            and validates_inside_epoch
            and isinstance(validation_batch, int)
            and validation_batch % step
        ):
            reason = (
                f"it saves after validation, which runs every {validation_batch} micro-batches (val_check_interval), "
                f"not a multiple of the accumulation {step}"
            )
        else:
            continue
        aligned = -(-validation_batch // step) * step if isinstance(validation_batch, int) else step
        rank_zero_warn(
            f"ModelCheckpoint may save inside an accumulation window ({reason}); a run resumed from such a "
            f"checkpoint loses the half-accumulated gradient. Checkpoint on optimizer steps with "
            f"ModelCheckpoint(every_n_train_steps=...), or set val_check_interval to a multiple of {step} "
            f"micro-batches (e.g. {aligned})"
        )


def check_token_data(schedule: BatchSchedule, accounting: BatchAccounting) -> None:
    """A schedule in tokens needs token data (at the first batch, where the accounting has seen one)."""
    if schedule.unit == "tokens" and accounting.seq_len is None:
        raise LitCBSConfigError(
            "BatchWarmup has schedule unit='tokens' but the batches hold no token ids (no 2-D integer "
            "tensor), so it cannot count tokens: use unit='samples' for such data, or pass "
            "BatchWarmup(seq_len=...) / give the datamodule a `tokens_per_sample` attribute if it is token data"
        )


def _run_limits(trainer: pl.Trainer, accounting: BatchAccounting, samples: int) -> list[tuple[str, str, int]]:
    """What ends the run from ``samples`` seen: (setting, unit, amount left) for max_tokens (tokens), max_steps
    (optimizer steps) and max_epochs (samples, from the loader's length)."""
    limits = []
    samples_seen, tokens_seen = accounting.samples_seen, accounting.tokens_seen
    if accounting.max_tokens is not None and accounting.seq_len:
        limits.append(
            (
                f"max_tokens={accounting.max_tokens:,}",
                "tokens",
                accounting.max_tokens - tokens_seen + (samples_seen - samples) * accounting.seq_len,
            )
        )
    if trainer.max_steps is not None and trainer.max_steps >= 0:
        limits.append((f"Trainer(max_steps={trainer.max_steps:,})", "steps", trainer.max_steps - trainer.global_step))
    if trainer.max_epochs is not None and trainer.max_epochs >= 0:
        loader = resizable_train_loader(trainer)
        ranks, micro = accounting.data_parallel_size, accounting.micro_batch_size
        if loader is not None:
            per_epoch, this_epoch = loader.num_samples, loader.position
        elif isinstance(trainer.num_training_batches, int):
            assert micro is not None  # the accounting has read the first batch's
            per_epoch = trainer.num_training_batches * micro * ranks
            this_epoch = trainer.fit_loop.epoch_loop.batch_progress.current.ready * micro * ranks
        else:
            return limits  # an iterable of unknown length
        left = (trainer.max_epochs - trainer.current_epoch) * per_epoch - this_epoch + (samples_seen - samples)
        limits.append((f"Trainer(max_epochs={trainer.max_epochs}) ({per_epoch:,} samples per epoch)", "samples", left))
    return limits


def warn_unreachable_batches(
    trainer: pl.Trainer,
    schedule: BatchSchedule,
    accounting: BatchAccounting,
    global_batch: int,
    samples_before_step: int | None,
) -> None:
    """Warn, before the first step, about every global batch to come that the run ends before (by max_tokens,
    max_steps or max_epochs), walking the phases from ``global_batch`` as BatchWarmup takes them."""
    if isinstance(schedule, CBSAdaptive):
        return  # its batches come from readings, not from the consumed count
    seq_len = accounting.seq_len or 0  # 0 for data without tokens (has_tokens: seq_len is not None)
    samples_seen, tokens_seen = accounting.samples_seen, accounting.tokens_seen
    samples = samples_before_step if samples_before_step is not None else samples_seen
    tokens = tokens_seen - (samples_seen - samples) * seq_len
    limits = _run_limits(trainer, accounting, samples)
    if not limits:
        return
    batch, reached, steps_taken = global_batch, {global_batch}, 0
    start = {"samples": samples, "tokens": tokens}

    def steps_left(limit: tuple[str, str, int]) -> int:  # at ``batch``, until ``limit`` ends the run
        _, unit, left = limit
        used = steps_taken if unit == "steps" else {"samples": samples, "tokens": tokens}[unit] - start[unit]
        per_step = {"steps": 1, "samples": batch, "tokens": batch * seq_len}[unit]
        return max(0, -(-(left - used) // per_step)) if per_step else 0

    while True:
        k_limit = min(steps_left(limit) for limit in limits)
        steps = _steps_until_change(schedule, samples, tokens, seq_len, batch, k_limit)
        if steps is None:
            break
        samples, tokens, steps_taken = samples + steps * batch, tokens + steps * batch * seq_len, steps_taken + steps
        batch = schedule.batch_size(tokens if schedule.unit == "tokens" else samples)
        reached.add(batch)
    consumed = tokens_seen if schedule.unit == "tokens" else samples_seen
    never = [size for size in schedule.sizes(consumed) if size not in reached]
    if not never:
        return
    ending = min(limits, key=steps_left)[0]
    samples, tokens = samples + k_limit * batch, tokens + k_limit * batch * seq_len  # where the run ends
    where = ", ".join(map(str, never))
    if isinstance(schedule, PiecewiseBatch):
        starts = {size: at for at, size in zip(schedule.thresholds, schedule.batch_sizes)}
        where = ", ".join(f"{size} (from {starts[size]:,} {schedule.unit})" for size in never)
    hint = ""
    if isinstance(schedule, PiecewiseBatch) and schedule.unit == "samples" and seq_len:
        thresholds = [t for t, size in zip(schedule.thresholds, schedule.batch_sizes) if size in never]
        if thresholds and thresholds[0] <= tokens:
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


def _steps_until_change(
    schedule: BatchSchedule, samples: int, tokens: int, seq_len: int, batch: int, most: int
) -> int | None:
    """The fewest steps at ``batch`` after which the schedule asks for another batch, if at most ``most``
    (galloping, then bisecting: a schedule moves one way with what is consumed)."""

    def changed(steps: int) -> bool:
        consumed = tokens + steps * batch * seq_len if schedule.unit == "tokens" else samples + steps * batch
        return schedule.batch_size(consumed) != batch

    if most == 0 or not changed(most):
        return None
    low, high = 0, 1
    while high < most and not changed(high):
        low, high = high, min(2 * high, most)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if changed(middle) else (middle, high)
    return high


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
