"""``BatchWarmup``: grow the global batch during training by a schedule in samples or tokens.

global batch (samples) = micro-batch x accumulate x data-parallel size. The micro-batch is the
datamodule's (or LightningModule's) ``batch_size``; BatchWarmup changes ``accumulate``
(``trainer.accumulate_grad_batches``), which Lightning reads at every batch to decide when to
step, when to zero gradients and how to divide the loss. A change to accumulate N' is applied
right after an optimizer step, and only when the micro-batches consumed this epoch are divisible
by N', so every later step averages over exactly the scheduled samples and the data order is
that of a run without the change. An increase by an
integer ratio r therefore waits at most r - 1 steps; ``history`` records when each change was
asked for and when it happened. At epoch boundaries the micro-batch itself may also change
(``max_micro_batch_size``), which reloads the train loader.

Each change multiplies the LR by ``lr_rule(new / old)`` where the optimizer and its schedulers
keep it (lit_cbs.lr_rules), so it composes with the user's LR schedule; the applied state is in
the checkpoint, so a resumed run never applies a change twice.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.model_helpers import is_overridden

from lit_cbs._internals import checkpoint_triggers, reload_train_dataloader, should_accumulate, tree_leaves
from lit_cbs.lr_rules import check_scheduler_supported, get_lr_rule, scale_learning_rate
from lit_cbs.logs import log_to_loggers
from lit_cbs.lr_schedules import TokenLRScheduler
from lit_cbs.schedules import BatchSchedule

log = logging.getLogger(__name__)


@dataclasses.dataclass
class BatchChange:
    """One applied change of the global batch. Batches in samples, consumed counts global."""

    step: int  # optimizer steps taken before the new batch's first step
    epoch: int
    samples_seen: int
    tokens_seen: int
    old_global_batch: int
    new_global_batch: int
    old_accumulate: int
    new_accumulate: int
    old_micro_batch_size: int
    new_micro_batch_size: int
    lr_factor: float  # this change's LR multiplier, lr_rule(new / old)
    requested_at_samples: int  # where the schedule first asked for this new batch (and micro-batch)
    requested_at_tokens: int


def _nearest_multiples(value: int, unit: int) -> str:
    lower = value // unit * unit
    upper = lower + unit
    return f"{lower} or {upper}" if lower > 0 else f"{upper}"


def data_parallel_size(trainer: pl.Trainer) -> int:
    """Ranks that each read their own micro-batches (tensor-parallel ranks share one)."""
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None)
    return int(kwargs["num_replicas"]) if kwargs else 1


def token_sequence_length(batch: Any) -> int | None:
    """Tokens per sample of a batch of token ids: dim 1 of its first 2-D integer tensor, else None.

    Only integer tensors count: a float [batch, features] tensor (tabular data, images) has no tokens.
    """
    for leaf in tree_leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.ndim == 2 and not (leaf.is_floating_point() or leaf.is_complex()):
            if leaf.dtype != torch.bool:
                return int(leaf.shape[1])
    return None


class BatchWarmup(Callback):
    """Change the global batch size (and scale the LR) during training by ``schedule``.

    Args:
        schedule: a ``lit_cbs.schedules`` schedule: consumed samples or tokens -> global batch (samples).
        lr_rule: "sqrt" (Adam), "linear" (SGD), "none", "adam_sde", or a callable ratio -> LR factor.
        max_tokens: stop training once this many tokens (all ranks) were trained on.
        seq_len: tokens per sample. Default: the datamodule's ``tokens_per_sample`` or ``seq_len``,
            else dim 1 of the first 2-D integer tensor (token ids) of the first batch. Data without
            token ids (float features) has no tokens: ``tokens_seen`` stays 0 and token-based
            settings (``unit="tokens"``, ``max_tokens``) are refused.
        max_micro_batch_size: if given, at epoch boundaries the micro-batch becomes the largest size
            (samples per rank, at most this) that divides every global batch still to come, and
            the train loader is reloaded.
        log_every_step: send ``batch/global_size``, ``batch/accumulate``, ``batch/lr_factor``,
            ``samples_seen``, ``tokens_seen`` and ``lr`` to the trainer's loggers at its
            ``log_every_n_steps``, and show ``tokens`` (``samples`` for data without tokens) in the
            progress bar. Each row describes the optimizer step it belongs to, as Lightning's
            LearningRateMonitor does: the batch, accumulation and LR that step trained with, and
            the counts including it.

    Attributes:
        history: ``BatchChange`` records, in order.
        samples_seen, tokens_seen: global counts trained on so far.
    """

    def __init__(
        self,
        schedule: BatchSchedule,
        lr_rule="sqrt",
        max_tokens: int | None = None,
        seq_len: int | None = None,
        max_micro_batch_size: int | None = None,
        log_every_step: bool = True,
    ):
        if not isinstance(schedule, BatchSchedule):
            raise TypeError(
                f"schedule must be a lit_cbs.schedules schedule (ConstantBatch, PiecewiseBatch, LinearRamp, "
                f"ExponentialRamp, ...), got {schedule!r}"
            )
        for name, value in (("max_tokens", max_tokens), ("seq_len", seq_len), ("max_micro_batch_size", max_micro_batch_size)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name}={value!r} must be a positive int or None")
        self.schedule = schedule
        self.lr_rule = get_lr_rule(lr_rule)
        self.max_tokens = max_tokens
        self.seq_len = seq_len
        self.max_micro_batch_size = max_micro_batch_size
        self.log_every_step = log_every_step

        self.samples_seen = 0
        self.tokens_seen = 0
        self.global_batch: int | None = None
        self.accumulate: int | None = None
        self.micro_batch_size: int | None = None
        self.lr_factor = 1.0  # product of all changes' LR factors
        self.history: list[BatchChange] = []
        # ((target batch, micro-batch), samples, tokens) when the schedule first asked for a pending change
        self._requested_at: tuple[tuple[int, int], int, int] | None = None
        self._trainer: pl.Trainer | None = None
        self._data_parallel_size = 1
        self._token_schedulers: list[TokenLRScheduler] = []
        self.fsdp_modules: list = []  # FSDP2 modules whose gradient reduction waits for the stepping micro-batch
        self._gradient_sync: bool | None = None
        self._check_micro_batch = True
        self._seq_len_resolved = False
        self._step_lr: float | None = None

    # ------------------------------------------------------------------ validation and setup
    @property
    def consumed(self) -> int:
        """What the schedule is indexed by: samples or tokens seen (global)."""
        return self.tokens_seen if self.schedule.unit == "tokens" else self.samples_seen

    @staticmethod
    def _micro_batch_holder(trainer: pl.Trainer, pl_module: pl.LightningModule):
        datamodule = trainer.datamodule
        if datamodule is not None and hasattr(datamodule, "batch_size"):
            return datamodule, "batch_size"
        if hasattr(pl_module, "batch_size"):
            return pl_module, "batch_size"
        if "batch_size" in getattr(pl_module, "hparams", {}):
            return pl_module.hparams, "batch_size"
        raise ValueError(
            "BatchWarmup needs the micro-batch size: give the datamodule (or the LightningModule) a "
            "`batch_size` attribute that its train_dataloader uses"
        )

    def _get_micro(self, trainer, pl_module) -> int:
        holder, attr = self._micro_batch_holder(trainer, pl_module)
        value = holder[attr] if isinstance(holder, dict) else getattr(holder, attr)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"batch_size={value!r} (the micro-batch, samples per rank) must be a positive int")
        return value

    def _set_micro(self, trainer, pl_module, value: int) -> None:
        holder, attr = self._micro_batch_holder(trainer, pl_module)
        if isinstance(holder, dict):
            holder[attr] = value
        else:
            setattr(holder, attr, value)

    def _pick_micro(self, consumed: int, current_micro: int) -> int:
        """Largest micro-batch <= max_micro_batch_size dividing every global batch still to come."""
        if self.max_micro_batch_size is None:
            return current_micro
        sizes = self.schedule.sizes(consumed)
        for micro in range(self.max_micro_batch_size, 0, -1):
            if all(size % (micro * self._data_parallel_size) == 0 for size in sizes):
                return micro
        raise AssertionError("micro-batch 1 divides every size checked in setup")  # pragma: no cover

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._trainer = trainer
        self._data_parallel_size = data_parallel_size(trainer)
        if not pl_module.automatic_optimization:
            raise ValueError(
                "BatchWarmup needs automatic optimization (it changes accumulate_grad_batches); "
                "set `self.automatic_optimization = True` or remove BatchWarmup"
            )
        if any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks):
            raise ValueError("BatchWarmup sets the accumulation itself: remove the GradientAccumulationScheduler callback")
        from lightning.pytorch.strategies import DeepSpeedStrategy

        if isinstance(trainer.strategy, DeepSpeedStrategy) and not self.schedule.is_constant:
            raise ValueError("DeepSpeedStrategy fixes gradient accumulation at start; use ddp, fsdp or model_parallel")

        micro = self._get_micro(trainer, pl_module)
        unit = micro * self._data_parallel_size
        for size in self.schedule.sizes(0):
            if size % unit:
                raise ValueError(
                    f"scheduled global batch {size} is not a multiple of micro-batch {micro} x data-parallel size "
                    f"{self._data_parallel_size} = {unit} samples; nearest valid sizes: {_nearest_multiples(size, unit)}"
                )
        if self.max_micro_batch_size is not None and self.max_micro_batch_size < micro:
            raise ValueError(
                f"max_micro_batch_size={self.max_micro_batch_size} is smaller than the datamodule's "
                f"batch_size={micro}; raise it or lower the batch_size"
            )
        self.micro_batch_size = self._pick_micro(0, micro)
        self.global_batch = self.schedule.batch_size(0)
        self.accumulate = self.global_batch // (self.micro_batch_size * self._data_parallel_size)
        if trainer.accumulate_grad_batches not in (1, self.accumulate):
            raise ValueError(
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) conflicts with BatchWarmup, "
                f"whose schedule starts at accumulate={self.accumulate}; leave accumulate_grad_batches at 1"
            )
        self._apply_to_trainer(trainer, pl_module)

    def _apply_to_trainer(self, trainer, pl_module) -> None:
        trainer.accumulate_grad_batches = self.accumulate
        self._set_micro(trainer, pl_module, self.micro_batch_size)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        self._token_schedulers = [s for s in schedulers if isinstance(s, TokenLRScheduler)]
        if not self.schedule.is_constant:
            for config in trainer.lr_scheduler_configs:
                check_scheduler_supported(config.scheduler)
                if config.interval == "step" and not isinstance(config.scheduler, TokenLRScheduler):
                    rank_zero_warn(
                        f"{type(config.scheduler).__name__} is indexed by optimizer steps, but BatchWarmup changes "
                        "the tokens per step, so the schedule will stretch in tokens (and "
                        "trainer.estimated_stepping_batches assumes a constant batch); use "
                        "lit_cbs.lr_schedules.TokenLRScheduler"
                    )
            sizes = self.schedule.sizes(self.consumed)
            ratios = [b / a for a, b in zip([self.global_batch] + sizes, sizes) if a != b]
            for optimizer in trainer.optimizers:
                self.lr_rule.check_optimizer(optimizer, ratios)
        if self.seq_len is None and trainer.datamodule is not None:
            for attr in ("tokens_per_sample", "seq_len"):
                if isinstance(getattr(trainer.datamodule, attr, None), int):
                    self.seq_len = getattr(trainer.datamodule, attr)
                    break

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.fsdp_modules = [m for m in pl_module.modules() if isinstance(m, FSDPModule)]
        self._gradient_sync = None
        self._warn_checkpoints_inside_accumulation(trainer, pl_module)
        if self.max_tokens is not None and self.tokens_seen >= self.max_tokens:
            trainer.should_stop = True  # resumed from a run's final state: no step is left to train
            return
        # A change the schedule asked for after a run's last step was not applied then (no step used
        # it); a run resumed from there with a larger budget applies it now, where it would have been.
        ready = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        if not self._no_step_follows(trainer):
            self._maybe_change(trainer, pl_module, lambda new_accumulate: ready % new_accumulate == 0)

    def _warn_checkpoints_inside_accumulation(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Warn where a ModelCheckpoint can save between the micro-batches of one optimizer step: the
        accumulated gradient is not in the checkpoint, so a run resumed from it trains a different step."""
        unit = self.micro_batch_size * self._data_parallel_size
        step = math.lcm(*{size // unit for size in self.schedule.sizes(self.consumed)}, self.accumulate)
        if step == 1:
            return
        validation_batch = trainer.val_check_batch
        validates_inside_epoch = (
            isinstance(validation_batch, int)
            and trainer.limit_val_batches != 0
            and is_overridden("validation_step", pl_module)
            and (validation_batch < trainer.num_training_batches or trainer.check_val_every_n_epoch is None)
        )
        for callback in trainer.checkpoint_callbacks:
            if not isinstance(callback, ModelCheckpoint):
                continue
            time_interval, every_n_epochs = checkpoint_triggers(callback)
            if time_interval is not None:
                reason = f"train_time_interval={time_interval} can fall on any micro-batch"
            elif every_n_epochs >= 1 and validates_inside_epoch and validation_batch % step:
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

    # ------------------------------------------------------------------ per batch
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check_micro_batch = True  # the loader may have been (re)built for this epoch

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        micro = extract_batch_size(batch)
        if self._check_micro_batch:
            self._check_received_micro_batch(trainer, micro)
        if not self._seq_len_resolved:
            self._resolve_seq_len(batch)
        samples = micro * self._data_parallel_size
        self.samples_seen += samples
        self.tokens_seen += samples * (self.seq_len or 0)
        for scheduler in self._token_schedulers:
            scheduler.tokens_seen = self.tokens_seen
        if self.fsdp_modules:
            self.set_gradient_sync(not should_accumulate(trainer))

    def _check_received_micro_batch(self, trainer: pl.Trainer, micro: int) -> None:
        """The first batch of an epoch must hold ``batch_size`` samples: a loader that ignores it
        would make every count, the global batch and the LR rule silently wrong."""
        self._check_micro_batch = False
        if micro == self.micro_batch_size:
            return
        if micro < self.micro_batch_size and trainer.num_training_batches == 1:
            return  # an epoch shorter than one micro-batch (drop_last=False)
        where = "the datamodule's" if trainer.datamodule is not None else "the LightningModule's"
        raise ValueError(
            f"BatchWarmup counts micro-batches of batch_size={self.micro_batch_size} samples, but the train "
            f"loader's first batch this epoch holds {micro}: build train_dataloader() with "
            f"DataLoader(..., batch_size=self.batch_size) from {where} `batch_size`, read when the loader is "
            "created (BatchWarmup sets it and reloads the loader when the micro-batch changes)"
        )

    def _resolve_seq_len(self, batch: Any) -> None:
        self._seq_len_resolved = True
        if self.seq_len is None:
            self.seq_len = token_sequence_length(batch)
        if self.seq_len is None and (self.schedule.unit == "tokens" or self.max_tokens is not None):
            setting = "schedule unit='tokens'" if self.schedule.unit == "tokens" else f"max_tokens={self.max_tokens}"
            raise ValueError(
                f"BatchWarmup has {setting} but the batches hold no token ids (no 2-D integer tensor), so it "
                "cannot count tokens: use unit='samples' and no max_tokens for such data, or pass "
                "BatchWarmup(seq_len=...) / give the datamodule a `tokens_per_sample` attribute if it is token data"
            )

    def set_gradient_sync(self, sync: bool | None) -> None:
        """Reduce FSDP2 gradients in the next backward (True) or keep accumulating locally (False).

        Lightning skips the all-reduce of accumulating micro-batches only for DDP; under FSDP2 the
        reduce-scatter is deferred to the micro-batch that steps. None resets to syncing.
        """
        if sync is None:
            sync, self._gradient_sync = True, None
        if sync != self._gradient_sync:
            for module in self.fsdp_modules:
                module.set_requires_gradient_sync(sync, recurse=False)
            self._gradient_sync = sync

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        self._step_lr = float(optimizer.param_groups[0]["lr"])  # the LR this step trains with

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        epoch_loop = trainer.fit_loop.epoch_loop
        if should_accumulate(trainer):
            return  # no optimizer step this batch
        if self.max_tokens is not None and self.tokens_seen >= self.max_tokens:
            trainer.should_stop = True
        if self.log_every_step:
            self._log(trainer, pl_module)  # before any change: this row is the step just taken
        if self._no_step_follows(trainer):
            return
        ready = epoch_loop.batch_progress.current.ready
        self._maybe_change(trainer, pl_module, lambda new_accumulate: ready % new_accumulate == 0)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Between epochs any accumulation fits (the next epoch starts at batch 0), and the
        # micro-batch may change because the train loader can be rebuilt.
        if self._no_step_follows(trainer) or trainer.current_epoch + 1 == trainer.max_epochs:
            return
        self._maybe_change(trainer, pl_module, lambda new_accumulate: True, epoch_boundary=True)

    @staticmethod
    def _no_step_follows(trainer: pl.Trainer) -> bool:
        """True after the run's final optimizer step: a change there would be recorded, logged and
        checkpointed although no step uses it."""
        return trainer.should_stop or (trainer.max_steps >= 0 and trainer.global_step >= trainer.max_steps)

    def _maybe_change(self, trainer, pl_module, fits, epoch_boundary: bool = False) -> None:
        target = self.schedule.batch_size(self.consumed)
        new_micro = self._pick_micro(self.consumed, self.micro_batch_size) if epoch_boundary else self.micro_batch_size
        if target == self.global_batch and new_micro == self.micro_batch_size:
            self._requested_at = None
            return
        if self._requested_at is None or self._requested_at[0] != (target, new_micro):
            self._requested_at = ((target, new_micro), self.samples_seen, self.tokens_seen)
        new_accumulate = target // (new_micro * self._data_parallel_size)
        if not fits(new_accumulate):
            return
        self._apply_change(trainer, pl_module, target, new_accumulate, new_micro)

    def _apply_change(self, trainer, pl_module, target: int, new_accumulate: int, new_micro: int) -> None:
        factor = 1.0
        if target != self.global_batch:
            ratio = target / self.global_batch
            factor = self.lr_rule.lr_factor(ratio)
            schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
            for optimizer in trainer.optimizers:
                scale_learning_rate(optimizer, schedulers, factor)
                self.lr_rule.adjust_optimizer(optimizer, ratio)
        change = BatchChange(
            step=trainer.global_step,
            epoch=trainer.current_epoch,
            samples_seen=self.samples_seen,
            tokens_seen=self.tokens_seen,
            old_global_batch=self.global_batch,
            new_global_batch=target,
            old_accumulate=self.accumulate,
            new_accumulate=new_accumulate,
            old_micro_batch_size=self.micro_batch_size,
            new_micro_batch_size=new_micro,
            lr_factor=factor,
            requested_at_samples=self._requested_at[1],
            requested_at_tokens=self._requested_at[2],
        )
        self.history.append(change)
        self._requested_at = None
        self.global_batch, self.accumulate, self.lr_factor = target, new_accumulate, self.lr_factor * factor
        if new_micro != self.micro_batch_size:
            self.micro_batch_size = new_micro
            reload_train_dataloader(trainer)  # rebuilt with the new batch_size at the next epoch start
        self._apply_to_trainer(trainer, pl_module)
        rank_zero_info(
            f"BatchWarmup: global batch {change.old_global_batch} -> {target} samples "
            f"(micro {change.old_micro_batch_size} -> {new_micro}, accumulate {change.old_accumulate} -> "
            f"{new_accumulate}) after step {change.step}, {self.samples_seen:,} samples / {self.tokens_seen:,} tokens; "
            f"LR x{factor:.4g}"
        )

    def _log(self, trainer, pl_module) -> None:
        if trainer.progress_bar_callback is not None:
            name, value = ("tokens", self.tokens_seen) if self.seq_len else ("samples", self.samples_seen)
            pl_module.log(name, float(value), on_step=True, on_epoch=False, logger=False, prog_bar=True)
        log_to_loggers(trainer, self._metrics)

    def _metrics(self, trainer) -> dict[str, float]:
        metrics = {
            "batch/global_size": float(self.global_batch),
            "batch/accumulate": float(self.accumulate),
            "batch/lr_factor": self.lr_factor,
            "samples_seen": float(self.samples_seen),
            "tokens_seen": float(self.tokens_seen),
        }
        if self._step_lr is not None:
            metrics["lr"] = self._step_lr
        if self.seq_len is None:
            del metrics["tokens_seen"]  # data without token ids
        return metrics

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        return {
            "samples_seen": self.samples_seen,
            "tokens_seen": self.tokens_seen,
            "global_batch": self.global_batch,
            "accumulate": self.accumulate,
            "micro_batch_size": self.micro_batch_size,
            "lr_factor": self.lr_factor,
            "seq_len": self.seq_len,
            "requested_at": self._requested_at,
            "history": [dataclasses.asdict(change) for change in self.history],
            # Closed-loop schedules (CBSAdaptive) carry decisions made during training.
            "schedule": self.schedule.state_dict() if hasattr(self.schedule, "state_dict") else None,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.samples_seen = state_dict["samples_seen"]
        self.tokens_seen = state_dict["tokens_seen"]
        self.global_batch = state_dict["global_batch"]
        self.accumulate = state_dict["accumulate"]
        self.micro_batch_size = state_dict["micro_batch_size"]
        self.lr_factor = state_dict["lr_factor"]
        self.seq_len = self.seq_len or state_dict["seq_len"]
        requested_at = state_dict["requested_at"]
        self._requested_at = None if requested_at is None else (tuple(requested_at[0]), *requested_at[1:])
        self.history = [BatchChange(**change) for change in state_dict["history"]]
        if state_dict.get("schedule") is not None:
            self.schedule.load_state_dict(state_dict["schedule"])
        # On resume Lightning calls setup first, then this: the checkpoint's accumulate and micro-batch win.
        if self._trainer is not None:
            self._apply_to_trainer(self._trainer, self._trainer.lightning_module)

