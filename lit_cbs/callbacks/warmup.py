"""``BatchWarmup``: grow the global batch during training by a schedule in samples or tokens.

global batch (samples) = micro-batch x accumulate x data-parallel size. At each change BatchWarmup
picks the micro-batch first (the largest that divides a rank's share of the new batch, up to
``max_micro_batch_size``; without it the micro-batch stays the datamodule's ``batch_size``) and
makes up the rest by accumulation (``trainer.accumulate_grad_batches``, which Lightning reads at
every batch to decide when to step, when to zero gradients and how to divide the loss). A change is
applied right after an optimizer step, and only when the samples consumed this epoch (all ranks)
are a multiple of the new global batch, so every later step averages over exactly the scheduled
samples, and the steps where the batch changes depend on the samples alone, not on the ranks or
the micro-batch. A change from B to B' therefore waits at most B' / gcd(B, B') - 1 steps (r - 1
for an integer ratio r); ``history``
records when each change was asked for and when it happened.

A new micro-batch reaches the train loader between two steps, mid-epoch, when the loader is a
``lit_cbs.GlobalOrderLoader``: its micro-batches are cut from one global sample order, so the
data order is that of a run without the change. Another loader cannot change its batch mid-epoch,
so a schedule that needs another micro-batch is refused with it. The same loader lets a run resume
on another number of ranks: the micro-batch and accumulation are chosen afresh for the new ranks,
the global batch, LR and data position continue.

Each change multiplies the LR by ``lr_rule(new / old)`` where the optimizer and its schedulers
keep it (lit_cbs.rules.scaling), so it composes with the user's LR schedule; ``weight_decay_rule`` and
``beta2_rule`` move AdamW's weight decay and beta2 with it. The applied state is in the checkpoint
(the optimizer's param groups), so a resumed run never applies a change twice. ``clip_rule``
likewise rescales the Trainer's ``gradient_clip_val``.

With ``guard`` (lit_cbs.rules.guard.BatchGuard, its settings its keyword arguments) each increase is
judged on the training loss after it and reverted if the loss rises above its trend: the revert is
a change like the others (at an aligned step), recorded with ``cause="guard"``, and it restores the
LR and clipping threshold of before the increase, and the weight decay, betas and eps of before it,
exactly (the guard keeps them as a ``RevertRestore``; ``lit_cbs.callbacks.warmup_guard`` feeds it the losses).

What BatchWarmup refuses and warns about, at setup, fit start, train start and the first batch, is in
``lit_cbs.callbacks.warmup_checks``; where a change may start (an aligned step), in ``lit_cbs.callbacks.warmup_align``;
the row of metrics it logs for each step and the line it says at each change, in ``lit_cbs.callbacks.warmup_log``;
the record of a change in its ``history`` (``BatchChange``), in ``lit_cbs.callbacks.batch_change``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_cbs._internals import should_accumulate
from lit_cbs.callbacks import warmup_align as align
from lit_cbs.callbacks import warmup_checks as checks
from lit_cbs.callbacks.accounting import (
    BatchAccounting,
    check_divisible,
)
from lit_cbs.callbacks.batch_change import BatchChange
from lit_cbs.callbacks.warmup_guard import WarmupGuard
from lit_cbs.callbacks.warmup_log import WarmupStepLog
from lit_cbs.errors import LitCBSConfigError, positive_int
from lit_cbs.rules.batch_schedules import BatchSchedule, micro_batch_for
from lit_cbs.rules.guard import BatchGuard, RevertRestore
from lit_cbs.rules.scaling import (
    BETA2_FLOOR,
    OptimizerRules,
    get_clip_rule,
    optimizer_settings,
)

__all__ = ["BatchWarmup"]

log = logging.getLogger(__name__)


class BatchWarmup(Callback):
    """Change the global batch size (and scale the LR) during training by ``schedule``.

    The counts it acts on (micro-batch, accumulation, samples and tokens seen) live in the Trainer's
    ``BatchAccounting`` (``lit_cbs.callbacks.accounting``); BatchWarmup is the one callback that changes them.

    Args:
        schedule: a ``lit_cbs.rules.batch_schedules`` schedule: consumed samples or tokens -> global batch (samples).
        lr_rule: "sqrt" (Adam), "linear" (SGD), "none", "adam_sde", or a callable ratio -> LR factor.
        weight_decay_rule: "timescale": at a change by k = new / old with LR factor f(k), every param
            group's weight_decay becomes weight_decay * k / f(k), keeping AdamW's timescale
            B / (eta * lambda * D) (lit_cbs.rules.scaling). None (default): unchanged.
        beta2_rule: "half_life": Adam's beta2 becomes beta2 ** k, keeping its half-life in tokens.
            None (default): unchanged. Not with lr_rule="adam_sde", which moves beta2 itself.
        beta2_floor: the lowest beta2 the half_life rule moves it to (unitless; default 0.95,
            ``lit_cbs.rules.scaling.BETA2_FLOOR``, the lowest large-model recipes train with; runs that
            scaled beta2 further down with the batch spiked); said once, in a warning, when it holds.
            None: no floor.
        clip_rule: multiply the Trainer's ``gradient_clip_val`` by ``clip_rule(new / old)`` at each
            change: "sqrt", "linear", or a callable ratio -> factor (loosening clipping as the batch
            grows). None or "none" (default): unchanged. Needs ``Trainer(gradient_clip_val=...)``.
        guard: watch the training loss after each increase and revert an increase after which it rises
            above its trend: True for the defaults, or a dict of ``lit_cbs.rules.guard.BatchGuard``'s
            keyword arguments (docs/guides/guard.md). None or False
            (default): no guard.
        max_tokens: the token budget (tokens, all ranks), passed on to the Trainer's ``BatchAccounting``,
            which owns it (its docstring has the default): a run with a BatchWarmup needs no
            BatchAccounting of its own to set it. Data without token ids (float features) has no tokens:
            token-based settings (``unit="tokens"``, ``max_tokens``) are refused.
        seq_len: tokens per sample, passed on to the Trainer's ``BatchAccounting`` as ``max_tokens``.
        max_micro_batch_size: if given, the micro-batch (samples per rank) grows with the batch: at
            every change it becomes the largest size up to this that divides a rank's share of the
            new global batch, before the accumulation grows. Needs a train loader that changes its
            batch between optimizer steps (``lit_cbs.GlobalOrderLoader``). None (default): the
            micro-batch stays the datamodule's ``batch_size`` and the accumulation grows.
        log_every_step: send ``batch/global_size``, ``batch/micro_batch_size``, ``batch/accumulate``,
            ``batch/lr_factor`` (with their rules ``batch/weight_decay``, the largest of the param
            groups, and ``batch/beta2``, param group 0's), ``samples_seen``, ``tokens_seen``,
            ``fit_seconds`` (wall seconds of training since the fit began, validation and probes
            included; a resumed run goes on from its checkpoint's) and ``lr`` to the trainer's
            loggers at its ``log_every_n_steps``, and show ``tokens`` (``samples`` for data without
            tokens) in the progress bar. Each row describes the optimizer step it belongs to, as
            Lightning's LearningRateMonitor does: the batch, accumulation and LR that step trained
            with, and the counts including it. An epoch's last step, short when the epoch's samples
            run out before the accumulation does, shows the samples and micro-batches it trained on.

    Attributes:
        history: ``BatchChange`` records, in order.
        global_batch: the batch now (samples): the schedule's, or the one a guard's revert went back to.
        accumulate, micro_batch_size, samples_seen, tokens_seen, seq_len, max_tokens: read from the
            Trainer's ``BatchAccounting`` (micro-batches per step, samples per rank, counts, tokens).
        guard: the ``BatchGuard`` or None; ``guard.verdicts`` holds its judgement of each increase.

    Raises:
        LitCBSConfigError: at construction, ``schedule`` not a schedule, an unknown rule or one the
            others exclude, ``max_tokens``, ``seq_len`` or ``max_micro_batch_size`` not None or an int
            >= 1, or invalid guard settings; at setup and at the first batch, what
            ``lit_cbs.callbacks.warmup_checks`` refuses (a batch that does not divide over the ranks, a
            second BatchWarmup, manual optimization, ...).

    Examples:
        Built before the Trainer, it knows only its settings; the counts come from the Trainer's
        ``BatchAccounting`` at setup:

        >>> from lit_cbs.callbacks import BatchWarmup
        >>> from lit_cbs.rules.batch_schedules import LinearRamp
        >>> warmup = BatchWarmup(
        ...     LinearRamp(start=64, increment=64, ramp=10_000, final=256), lr_rule="sqrt", max_micro_batch_size=16
        ... )
        >>> warmup.schedule.sizes(0), warmup.lr_rule.factor(256 / 64)  # the batches to come; 4x the batch: 2x LR
        ([64, 128, 192, 256], 2.0)
        >>> warmup.global_batch, warmup.micro_batch_size, warmup.samples_seen, warmup.history  # before setup
        (None, None, 0, [])
        >>> BatchWarmup(256)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lit_cbs.errors.LitCBSConfigError: schedule must be a lit_cbs.rules.batch_schedules schedule (...), got 256
    """

    def __init__(
        self,
        schedule: BatchSchedule,
        lr_rule="sqrt",
        max_tokens: int | None = None,
        seq_len: int | None = None,
        max_micro_batch_size: int | None = None,
        log_every_step: bool = True,
        clip_rule=None,
        guard: bool | dict[str, Any] | None = None,
        weight_decay_rule: str | None = None,
        beta2_rule: str | None = None,
        beta2_floor: float | None = BETA2_FLOOR,
    ):
        if not isinstance(schedule, BatchSchedule):
            raise LitCBSConfigError(
                f"schedule must be a lit_cbs.rules.batch_schedules schedule (ConstantBatch, PiecewiseBatch, "
                f"LinearRamp, ExponentialRamp, ...), got {schedule!r}"
            )
        self.schedule = schedule
        self.rules = OptimizerRules.build(lr_rule, weight_decay_rule, beta2_rule, beta2_floor)
        self.clip_rule = get_clip_rule(clip_rule)
        self.guard = BatchGuard.from_setting(guard)
        self._guarded = WarmupGuard(self.guard) if self.guard is not None else None
        # The accounting's settings, taken on its behalf and handed to it in setup.
        self._accounting_settings = BatchAccounting.checked_settings(seq_len=seq_len, max_tokens=max_tokens)
        self.max_micro_batch_size = positive_int(
            "max_micro_batch_size", max_micro_batch_size, "samples per rank", optional=True
        )
        self.log_every_step = log_every_step

        self.accounting: BatchAccounting | None = None  # the Trainer's, from setup on
        # Kept here, not derived from the accounting's micro-batch x accumulation x ranks: a run resumed
        # on other ranks goes on at the checkpoint's global batch and splits it afresh.
        self.global_batch: int | None = None
        self.lr_factor = 1.0  # product of all changes' LR factors
        self.clip_factor = 1.0  # product of all changes' clipping-threshold factors
        self._base_gradient_clip_val: float | None = None  # the Trainer's, before any change
        self.history: list[BatchChange] = []
        # ((target batch, micro-batch), samples, tokens) when the schedule first asked for a pending change
        self._requested_at: tuple[tuple[int, int], int, int] | None = None
        self._token_settings_checked = False
        self._restored = False  # this fit's state came from a checkpoint (load_state_dict)
        self._settings_set: list[list[dict]] | None = None  # what the rules last left in each optimizer
        self._step_log = WarmupStepLog(self.rules, self.clip_rule, self.guard)  # each step's row, each change's line

    @property
    def lr_rule(self):
        """The LR rule (``rules.lr``)."""
        return self.rules.lr

    # ------------------------------------------------------------------ counts (the accounting's)
    @property
    def samples_seen(self) -> int:
        """Samples trained on so far, all ranks."""
        return self.accounting.samples_seen if self.accounting is not None else 0

    @property
    def tokens_seen(self) -> int:
        """Tokens trained on so far, all ranks (0 for data without token ids)."""
        return self.accounting.tokens_seen if self.accounting is not None else 0

    @property
    def seq_len(self) -> int | None:
        """Tokens per sample (None for data without token ids)."""
        return self.accounting.seq_len if self.accounting is not None else self._accounting_settings["seq_len"]

    @property
    def max_tokens(self) -> int | None:
        """The token budget (all ranks), or None."""
        return self.accounting.max_tokens if self.accounting is not None else self._accounting_settings["max_tokens"]

    @property
    def micro_batch_size(self) -> int | None:
        """Samples per micro-batch and rank (None before setup)."""
        return self.accounting.micro_batch_size if self.accounting is not None else None

    @property
    def accumulate(self) -> int | None:
        """Micro-batches per optimizer step (None before setup)."""
        return self.accounting.accumulate if self.accounting is not None else None

    @property
    def _counts(self) -> BatchAccounting:
        """The Trainer's ``BatchAccounting``, from setup on."""
        if self.accounting is None:
            raise RuntimeError("BatchWarmup has no BatchAccounting: its setup(trainer, pl_module, 'fit') has not run")
        return self.accounting

    @property
    def _batch(self) -> int:
        """The global batch now (samples), from setup on."""
        if self.global_batch is None:
            raise RuntimeError("BatchWarmup has no global batch: its setup(trainer, pl_module, 'fit') has not run")
        return self.global_batch

    @property
    def _micro(self) -> int:
        """The micro-batch now (samples per rank), from setup on."""
        micro = self._counts.micro_batch_size
        if micro is None:
            raise RuntimeError("BatchWarmup has no micro-batch: its setup(trainer, pl_module, 'fit') has not run")
        return micro

    @property
    def consumed(self) -> int:
        """What the schedule is indexed by: samples or tokens seen (global)."""
        return self.tokens_seen if self.schedule.unit == "tokens" else self.samples_seen

    # ------------------------------------------------------------------ validation and setup
    def micro_batch_for(self, global_batch: int) -> int:
        """The micro-batch (samples per rank) for ``global_batch``: the largest divisor of a rank's share
        up to ``max_micro_batch_size`` (``lit_cbs.rules.batch_schedules.micro_batch_for``); without it,
        the micro-batch now.

        Args:
            global_batch: samples per optimizer step, all ranks.

        Returns:
            Samples per micro-batch and rank.

        Raises:
            RuntimeError: before setup, which reads the ranks and the micro-batch.
        """
        if self.max_micro_batch_size is None:
            return self._micro
        return micro_batch_for(global_batch, self._counts.data_parallel_size, self.max_micro_batch_size)

    def check_sizes(
        self, sizes: list[int], micro_batch_size: int, data_parallel_size: int, name: str = "scheduled global batch"
    ) -> None:
        """LitCBSConfigError unless every global batch in ``sizes`` divides into micro-batches on every
        data-parallel rank (``lit_cbs.callbacks.warmup_checks.check_sizes``). Also for a run's configuration
        before its Trainer exists.

        Args:
            sizes: global batches (samples per optimizer step, all ranks).
            micro_batch_size: samples per micro-batch and rank (with ``max_micro_batch_size``, any: it grows).
            data_parallel_size: ranks that read their own micro-batches.
            name: what ``sizes`` are, in the message.

        Raises:
            LitCBSConfigError: a size does not divide; the message names the nearest that do.

        Examples:
            >>> from lit_cbs.callbacks import BatchWarmup
            >>> from lit_cbs.rules.batch_schedules import ConstantBatch
            >>> BatchWarmup(ConstantBatch(64)).check_sizes([64, 128], micro_batch_size=16, data_parallel_size=4)
        """
        checks.check_sizes(sizes, micro_batch_size, data_parallel_size, self.max_micro_batch_size, name)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        checks.check_trainer(trainer, pl_module, self.schedule, BatchWarmup)
        accounting = self.accounting = BatchAccounting.attach(trainer, "BatchWarmup", **self._accounting_settings)
        checks.check_clip_rule(self.clip_rule, trainer)
        self._restored = False  # load_state_dict sets it again: Lightning restores a checkpoint after setup
        self._base_gradient_clip_val = trainer.gradient_clip_val
        micro = checks.check_micro_batch(trainer, pl_module, self.max_micro_batch_size)
        self.check_sizes(self.schedule.sizes(0), micro, accounting.data_parallel_size)
        global_batch = self.schedule.batch_size(0)
        if self.max_micro_batch_size is not None:
            micro = self.micro_batch_for(global_batch)
        accumulate = check_divisible(global_batch, micro, accounting.data_parallel_size)
        checks.check_accumulation(trainer, accumulate)
        self._set_batch(global_batch, micro, accumulate)

    def lacks_a_feeder(self, callbacks: list, resumed: bool) -> bool:
        """Whether the schedule is a ``CBSAdaptive`` that nothing among ``callbacks`` feeds readings
        (``CBSProbeCallback``, or a callback of yours that calls ``schedule.observe`` and says so with a
        class attribute ``feeds_cbs_adaptive = True``): it would stay at its start batch for the whole
        run. A resumed run may have none (after its last probe point the recorded decisions replay).

        Args:
            callbacks: the Trainer's callbacks.
            resumed: whether the run resumes from a checkpoint.

        Returns:
            True when nothing would feed the schedule its readings.
        """
        return checks.lacks_a_feeder(self.schedule, callbacks, resumed)

    def _set_batch(self, global_batch: int, micro_batch_size: int, accumulate: int) -> None:
        """Train at ``global_batch`` samples, ``micro_batch_size`` per rank x ``accumulate``, from the next
        micro-batch on, with the clipping threshold of ``clip_factor``: the one place BatchWarmup writes
        the batch (into the Trainer and its accounting)."""
        accounting = self._counts
        trainer = accounting.trainer
        if trainer is None:
            raise RuntimeError("BatchWarmup: the Trainer's BatchAccounting has not been set up")
        self.global_batch = global_batch
        trainer.accumulate_grad_batches = accumulate
        if self.clip_rule is not None:
            base = self._base_gradient_clip_val
            assert base is not None  # check_clip_rule refuses a clip_rule without gradient_clip_val
            trainer.gradient_clip_val = base * self.clip_factor
        accounting.set_micro_batch_size(micro_batch_size)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        checks.check_optimizer_rules(trainer, self.rules, self.schedule, self.consumed, self._batch, self.guard)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        checks.check_adaptive_is_fed(self.schedule, trainer, resumed=self._restored)
        self._step_log.samples_before_step = self.samples_seen
        self._remember_settings(trainer)  # a resumed run's come from the checkpoint's param groups
        micros = {self.micro_batch_for(size) for size in self._sizes_to_come()}
        accounting = self._counts
        checks.check_loader_resizes(trainer, micros, self._micro, self.max_micro_batch_size)
        if accounting.checkpoint_data_parallel_size not in (None, accounting.data_parallel_size):
            self._regroup_for_new_ranks(trainer)
        ranks = accounting.data_parallel_size
        steps = {size // (self.micro_batch_for(size) * ranks) for size in self.schedule.sizes(self.consumed)}
        checks.warn_checkpoints_inside_accumulation(trainer, pl_module, steps | {accounting.accumulate})
        if accounting.budget_reached:
            return  # resumed from a run's final state: the accounting stops the run
        # A change the schedule asked for after a run's last step was not applied then (no step used
        # it); a run resumed from there with a larger budget applies it now, where it would have been.
        if not align.no_step_follows(trainer):
            self._maybe_change(trainer, functools.partial(align.fits_now, trainer, self._counts))

    def _sizes_to_come(self) -> list[int]:
        """Every global batch the run may still train at: the schedule's, and those a guard may revert to."""
        return sorted(
            {self._batch, *self.schedule.sizes(self.consumed), *(self.guard.sizes_needed() if self.guard else [])}
        )

    def _regroup_for_new_ranks(self, trainer: pl.Trainer) -> None:
        """Resumed on another number of data-parallel ranks: the global batch, LR and data position go on;
        the micro-batch and accumulation are chosen for the ranks now (``warmup_align.fits_now`` lets the first
        step after the resume take exactly the new accumulation)."""
        accounting = self._counts
        before = accounting.checkpoint_data_parallel_size
        assert before is not None  # on_train_start regroups only for a checkpoint's other data-parallel size
        ranks = accounting.data_parallel_size
        loader = checks.check_loader_regroups(trainer, before, ranks)
        self.check_sizes(self._sizes_to_come(), self._micro, ranks, name=f"global batch on {ranks} ranks")
        old = (self.micro_batch_size, self.accumulate)
        global_batch = self._batch
        micro = self.micro_batch_for(global_batch)
        accumulate = global_batch // (micro * ranks)
        align.fits_now(trainer, accounting, global_batch, accumulate)  # true: the position is a multiple of the batch
        self._set_batch(global_batch, micro, accumulate)
        rank_zero_info(
            f"BatchWarmup: resumed on {ranks} data-parallel rank(s) (the checkpoint's run had {before}): global batch "
            f"{self.global_batch} = micro {self.micro_batch_size} x accumulate {self.accumulate} x {ranks} (was micro "
            f"{old[0]} x accumulate {old[1]} x {before}), from sample {loader.position:,} of epoch {loader.epoch}"
        )

    # ------------------------------------------------------------------ per batch
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # The accounting's hook ran first: it has resolved seq_len from this batch.
        if not self._token_settings_checked:
            self._token_settings_checked = True
            checks.check_token_data(self.schedule, self._counts)
            before = self._step_log.samples_before_step
            checks.warn_unreachable_batches(trainer, self.schedule, self._counts, self._batch, before)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        if self.rules.settings:
            assert self._settings_set is not None  # remembered at train start, and at every change
            checks.check_settings_kept(self.rules, self._settings_set, trainer, optimizer)
        self._step_log.before_optimizer_step(optimizer)  # the LR and settings this step trains with, for its row

    def _remember_settings(self, trainer: pl.Trainer) -> None:
        if self.rules.settings:
            self._settings_set = [optimizer_settings(optimizer) for optimizer in trainer.optimizers]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        if self._guarded is not None:
            self._guarded.add_micro_batch(trainer, outputs, batch)
        if should_accumulate(trainer):
            return  # no optimizer step this batch
        if self.log_every_step:  # before any change: this row is the step just taken
            self._step_log.log(trainer, pl_module, self._counts, self._batch, self.lr_factor)
        self._step_log.samples_before_step = self.samples_seen
        if self._guarded is not None:
            self._guarded.end_step(trainer, self.consumed, self.schedule.unit, self._counts.data_parallel_size)
        if align.no_step_follows(trainer):
            return
        self._maybe_change(trainer, functools.partial(align.fits_now, trainer, self._counts))

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Between epochs any accumulation fits: the next epoch starts at batch 0.
        if align.no_step_follows(trainer) or trainer.current_epoch + 1 == trainer.max_epochs:
            return
        self._maybe_change(trainer, lambda global_batch, accumulate: True)

    def _maybe_change(self, trainer, fits) -> None:
        target = self.schedule.batch_size(self.consumed)
        if self.guard is not None:
            target = self.guard.allowed_batch(target, self._batch, self.consumed)
        new_micro = self.micro_batch_for(target)
        if target == self.global_batch and new_micro == self.micro_batch_size:
            self._requested_at = None
            return
        if self._requested_at is None or self._requested_at[0] != (target, new_micro):
            self._requested_at = ((target, new_micro), self.samples_seen, self.tokens_seen)
        new_accumulate = target // (new_micro * self._counts.data_parallel_size)
        if not fits(target, new_accumulate):
            return
        self._apply_change(trainer, target, new_accumulate, new_micro)

    def _apply_change(self, trainer, target: int, new_accumulate: int, new_micro: int) -> None:
        """Train at ``target`` samples (``new_micro`` per rank x ``new_accumulate``) from the next optimizer
        step on: move the optimizers' settings, record the change, tell the guard, resize, say so."""
        guarded = self._guarded
        if guarded is not None and guarded.reverts_to(target):  # back to the LR and settings of before the increase
            revert = guarded.revert(trainer, self.schedule, self.lr_rule, self.consumed, self._batch, target)
            lr_change, clip_change, restore = revert
            factors, cause = (restore.lr_factor, restore.clip_factor), "guard"
        else:
            settings_before = guarded.settings_before(trainer) if guarded is not None else None
            lr_change, clip_change = self._scale_optimizers(trainer, target)
            if guarded is not None:  # it watches an increase, keeping what a revert of it puts back
                restore = RevertRestore(self.lr_factor, self.clip_factor, lr_change, clip_change, settings_before)
                guarded.scheduled_change(len(self.history), self.consumed, self._batch, target, restore)
            factors, cause = (self.lr_factor * lr_change, self.clip_factor * clip_change), "schedule"
        change = self._record_change(trainer, target, new_accumulate, new_micro, lr_change, clip_change, cause)
        self.lr_factor, self.clip_factor = factors
        self._set_batch(target, new_micro, new_accumulate)  # the loader yields the new micro-batch from the next one on
        self._remember_settings(trainer)
        self._step_log.announce(trainer, change, self._counts)

    def _scale_optimizers(self, trainer, target: int) -> tuple[float, float]:
        """Move every optimizer by the rules for a change from the batch now to ``target``; return the
        change's LR and clipping-threshold factors (1 when only the micro-batch changes)."""
        if target == self.global_batch:
            return 1.0, 1.0
        ratio = target / self._batch
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        for optimizer in trainer.optimizers:
            self.rules.apply(optimizer, schedulers, ratio, warn=lambda why: rank_zero_warn(f"BatchWarmup: {why}"))
        return self.lr_rule.factor(ratio), self.clip_rule.factor(ratio) if self.clip_rule is not None else 1.0

    def _record_change(
        self,
        trainer,
        target: int,
        new_accumulate: int,
        new_micro: int,
        lr_change: float,
        clip_change: float,
        cause: str,
    ) -> BatchChange:
        """Append the change, from the batch now to ``target``, to ``history``."""
        requested_at = self._requested_at
        assert requested_at is not None  # _maybe_change sets it before it applies a change
        old, new = (self._batch, self._counts.accumulate, self._micro), (target, new_accumulate, new_micro)
        change = BatchChange._after_step(
            trainer, self._counts, old, new, (lr_change, clip_change), requested_at[1:], cause
        )
        self.history.append(change)
        self._requested_at = None
        return change

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        return {
            "global_batch": self.global_batch,
            "accumulate": self.accumulate,
            "micro_batch_size": self.micro_batch_size,
            "lr_factor": self.lr_factor,
            "clip_factor": self.clip_factor,
            "requested_at": self._requested_at,
            "history": [dataclasses.asdict(change) for change in self.history],
            # Closed-loop schedules (CBSAdaptive) carry decisions made during training.
            "schedule": self.schedule.state_dict() if hasattr(self.schedule, "state_dict") else None,
            "guard": self.guard.state_dict() if self.guard is not None else None,
            "step_loss": self._guarded.step_loss() if self._guarded is not None else [0.0, 0],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = True
        self.global_batch = state_dict["global_batch"]
        self.lr_factor = state_dict["lr_factor"]
        self.clip_factor = state_dict["clip_factor"]
        if self._guarded is not None and state_dict["guard"] is not None:
            self._guarded.load(state_dict["guard"], state_dict["step_loss"])
        requested_at = state_dict["requested_at"]
        self._requested_at = None if requested_at is None else (tuple(requested_at[0]), *requested_at[1:])
        self.history = [BatchChange(**change) for change in state_dict["history"]]
        if state_dict["schedule"] is not None:  # saved by a schedule with a state (CBSAdaptive)
            if not hasattr(self.schedule, "load_state_dict"):
                raise LitCBSConfigError(
                    f"the checkpoint holds the state of a closed-loop batch schedule, but this run's {self.schedule!r} "
                    "keeps none: resume with the checkpoint's schedule"
                )
            self.schedule.load_state_dict(state_dict["schedule"])
        # On resume Lightning calls setup first, then this: the checkpoint's accumulate and micro-batch win.
        if self.accounting is not None:
            self._set_batch(self.global_batch, state_dict["micro_batch_size"], state_dict["accumulate"])
