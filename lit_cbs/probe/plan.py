"""Where and on what a due probe starts (``plan_probe``), where the run ends, and the checks of the first batch."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden

from lit_cbs.callbacks.accounting import BatchAccounting, resizable_train_loader
from lit_cbs.callbacks.module_state import logging_muted
from lit_cbs.data.loader import GlobalOrderLoader
from lit_cbs.errors import LitCBSConfigError
from lit_cbs.probe.branch import (
    BranchTrainer,
    ProbeUnusable,
    TrainingSnapshot,
    branch_micro_batch,
    callbacks_hidden,
    known,
    lr_scaled_for_step,
    module_optimizer,
)
from lit_cbs.probe.engine import ProbeConfig, ProbePoint
from lit_cbs.probe.in_process import load_heldout_batches
from lit_cbs.probe.reading import max_branches
from lit_cbs.rules.batch_schedules import CBSAdaptive

if TYPE_CHECKING:
    from lit_cbs.callbacks.warmup import BatchWarmup

__all__: list[str] = []  # the probe's own parts


@dataclass(frozen=True)
class ProbePlan:
    """What a starting probe measures: its ks, each window's samples, early looks (samples per rank)."""

    multipliers: list[float]
    window_samples: int
    early_stop_samples: list[int]


@dataclass(frozen=True)
class ProbeSkip:
    """A due probe that does not start, and why (``stays_due``: a resumed run takes it)."""

    reason: str
    stays_due: bool = False
    warn: bool = False
    next_epoch: bool = False


def window_at(
    config: ProbeConfig, batch_size: int, seq_len: int, branch_micro_batch: Callable[[float], int | None]
) -> tuple[list[float], int]:
    """The ks a probe at ``batch_size`` trains, and its window (whole steps of the largest; 0: none fits)."""
    window_samples = config.window_tokens // seq_len
    ks = [k for k in config.multipliers if branch_micro_batch(k) is not None and k * batch_size <= window_samples]
    if len(ks) < 2 or 1.0 not in ks:
        return ks, 0
    largest = max(ks) * batch_size
    return ks, int(window_samples // largest * largest)


def plan_probe(
    run: ProbeRun,
    *,
    end: RunEnd | None = None,
    tokens_spent: int = 0,
    main_span_tokens: int | None = None,
    adaptive_final: int | None = None,
    uneven_loader: GlobalOrderLoader | None = None,
) -> ProbePlan | ProbeSkip:
    """The probe due now at the run's global batch, or why it is skipped; ``main_span_tokens``: the main run's tokens
    it records (None: ``replicates`` windows); ``uneven_loader``: one whose epoch's last round leaves the ranks
    different numbers of samples."""
    batch_size = run.global_batch()
    return plan_at(
        run.config,
        run.accounting.tokens_seen,
        batch_size,
        run.seq_len(),
        run.accounting.data_parallel_size,
        run.micro_batch_for(batch_size),
        end=end,
        tokens_spent=tokens_spent,
        main_span_tokens=main_span_tokens,
        adaptive_final=adaptive_final,
        uneven_at=(uneven_loader, run.largest_batch()) if uneven_loader is not None else None,
    )


def plan_at(
    config: ProbeConfig,
    tokens: int,
    batch_size: int,
    seq_len: int,
    data_parallel_size: int,
    branch_micro_batch: Callable[[float], int | None],
    *,
    end: RunEnd | None = None,
    tokens_spent: int = 0,
    main_span_tokens: int | None = None,
    adaptive_final: int | None = None,
    uneven_at: tuple[GlobalOrderLoader, int] | None = None,
) -> ProbePlan | ProbeSkip:
    """``plan_probe`` of any loop, from its numbers: ``tokens`` trained, the global batch, ``branch_micro_batch`` (k
    -> samples per rank, None where k x B does not divide), ``uneven_at``: (the uneven loader, the largest batch)."""
    if adaptive_final is not None:
        return ProbeSkip(
            f"CBSAdaptive is at its final batch {adaptive_final}, where no reading can move it "
            "(CBSAdaptive(probe_after_final=True) keeps probing)"
        )
    ks, window_samples = window_at(config, batch_size, seq_len, branch_micro_batch)
    if not window_samples:
        return ProbeSkip(f"fewer than two multipliers, k = 1 among them, fit batch {batch_size}", warn=True)
    largest = max(ks) * batch_size
    window_tokens = window_samples * seq_len
    span = window_tokens * config.replicates if main_span_tokens is None else min(main_span_tokens, window_tokens)
    if end is not None and end.earliest is not None and tokens + span > end.earliest:
        return ProbeSkip(
            f"its window of {span:,} tokens would end past the run's end ({end.limit}, at {end.earliest:,} tokens); "
            "a run resumed from this one's last checkpoint starts it there",
            stays_due=True,
        )
    if config.max_overhead is not None:
        expected = max_branches(config.search, len(ks)) * window_tokens * config.replicates
        overhead = (tokens_spent + expected) / max(1, tokens + window_tokens * config.replicates)
        if overhead > config.max_overhead:
            return ProbeSkip(f"it would bring probe overhead to {overhead:.2f} > max_overhead={config.max_overhead}")
    if uneven_at is not None:
        # Each rank records its own micro-batches and the branches need as many on every rank, so a window stays
        # clear of an epoch's last round; the main run may change its batch inside it and pass it by a step.
        uneven_loader, largest_batch = uneven_at
        reach = window_samples * config.replicates + max(batch_size, largest_batch)
        uneven = f"leave the {data_parallel_size} ranks different numbers of samples"
        epoch_samples = uneven_loader.num_samples
        if reach > epoch_samples:
            return ProbeSkip(
                f"its window and a step ({reach:,} samples) do not fit in an epoch of {epoch_samples:,} samples, "
                f"whose last micro-batches {uneven}: shorten window_tokens",
                warn=True,
            )
        if uneven_loader.position + reach > epoch_samples:
            return ProbeSkip(f"its window would reach this epoch's last micro-batches, which {uneven}", next_epoch=True)
    largest_step = round(largest) // data_parallel_size  # samples per rank
    length = window_samples // data_parallel_size
    fractions = config.early_stop
    assert fractions is not None, "ProbeConfig makes early_stop a list"
    early_stop = sorted({int(f * length) // largest_step * largest_step for f in fractions} - {0, length})
    return ProbePlan(ks, window_samples, early_stop)


@dataclass(frozen=True)
class RunEnd:
    """Where the run ends (tokens): at the batch in use, at the largest; ``limit`` names the soonest."""

    earliest: int | None
    latest: int | None
    limit: str | None


def run_end(
    trainer: pl.Trainer,
    accounting: BatchAccounting,
    micro_batches_this_epoch: int,
    micro_batches_into_step: int,
    largest_batch: int,
) -> RunEnd:
    """The run's end by ``max_tokens``, ``max_steps`` or ``max_epochs``, from a hook of the current micro-batch."""
    seq_len = known(accounting.seq_len, "BatchAccounting.seq_len")
    micro = known(accounting.micro_batch_size, "BatchAccounting.micro_batch_size")
    global_batch = known(accounting.global_batch, "BatchAccounting.global_batch")
    per_micro_batch = micro * accounting.data_parallel_size * seq_len  # tokens, all ranks
    step_start = accounting.tokens_seen - micro_batches_into_step * per_micro_batch
    ends: dict[str, tuple[int, int]] = {}
    if accounting.max_tokens is not None:
        ends[f"max_tokens={accounting.max_tokens}"] = (accounting.max_tokens, accounting.max_tokens)
    if trainer.max_steps is not None and trainer.max_steps >= 0:
        steps_left = trainer.max_steps - trainer.global_step
        ends[f"max_steps={trainer.max_steps}"] = (
            step_start + steps_left * global_batch * seq_len,
            step_start + steps_left * max(largest_batch, global_batch) * seq_len,
        )
    epochs, per_epoch, loader = trainer.max_epochs, trainer.num_training_batches, resizable_train_loader(trainer)
    if epochs is not None and epochs >= 0 and (loader is not None or math.isfinite(per_epoch)):
        if loader is not None:  # its epochs train every sample, the last round short: count samples
            left = (epochs - trainer.current_epoch) * loader.num_samples - loader.position
            tokens = accounting.tokens_seen + left * seq_len
        else:
            batches_left = (epochs - trainer.current_epoch) * per_epoch - micro_batches_this_epoch
            tokens = accounting.tokens_seen + int(batches_left) * per_micro_batch
        ends[f"max_epochs={epochs}"] = (tokens, tokens)
    if not ends:
        return RunEnd(None, None, None)
    limit = min(ends, key=lambda name: ends[name][0])
    return RunEnd(ends[limit][0], min(latest for _, latest in ends.values()), limit)


def check_optimizer_step_lr(trainer: pl.Trainer, pl_module: pl.LightningModule, batch_idx: int) -> None:
    """Refuse a module whose own ``optimizer_step`` writes the LR, tried once on a copy at half the run's LRs."""
    if not is_overridden("optimizer_step", pl_module):
        return
    snapshot = TrainingSnapshot(trainer, pl_module, "cpu")
    parameters = [parameter for parameter in pl_module.parameters() if parameter.requires_grad]
    gradients = [parameter.grad for parameter in parameters]
    try:
        for parameter in parameters:
            parameter.grad = torch.zeros_like(parameter)  # every optimizer steps on them (some refuse none at all)
        with (
            lr_scaled_for_step(trainer.optimizers, 0.5, None),
            BatchAccounting.attach(trainer).branching(),
            callbacks_hidden(trainer),
            logging_muted(pl_module),
        ):
            zero_loss = functools.partial(torch.zeros, (), device=trainer.strategy.root_device)
            pl_module.optimizer_step(trainer.current_epoch, batch_idx, module_optimizer(pl_module), zero_loss)
    except ProbeUnusable as error:
        raise LitCBSConfigError(
            f"CBSProbeCallback: the module's optimizer_step sets the learning rate itself ({error.written}, tried once "
            "on a copy of the run's state), so no probe branch could train at lr_rule(k) x the run's LR: set the LR "
            "with an LR scheduler (configure_optimizers, TokenLRScheduler) instead of writing param_groups in "
            "optimizer_step, or drop the probe"
        ) from None
    finally:
        snapshot.restore(trainer, pl_module)  # the param groups too: the LRs are the run's again
        for parameter, gradient in zip(parameters, gradients):
            parameter.grad = gradient


@dataclass
class ProbeRun:
    """The run as a probe plans in it: its counts, its ``BatchWarmup`` (None: fixed batch), the checks."""

    config: ProbeConfig
    accounting: BatchAccounting
    warmup: BatchWarmup | None

    def check_rules_apply(self, trainer: pl.Trainer) -> None:
        """Every k's rules must apply to the optimizer and its schedulers."""
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        ratios, warmup, rules = list(self.config.multipliers), self.warmup, self.config.rules
        if warmup is not None and warmup.lr_rule.name == rules.lr.name == "adam_sde":
            # BatchWarmup's adam_sde shrinks the betas as the batch grows; branches start from there.
            sizes = warmup.schedule.sizes()
            ratios = [k * max(sizes) / min(sizes) for k in ratios]
        grid = ", ".join(f"{k:g}" for k in self.config.multipliers)
        who = f"CBSProbeCallback({rules.describe()}, multipliers=[{grid}])"
        for optimizer in trainer.optimizers:
            rules.check(optimizer, schedulers, ratios, who)

    def seq_len(self) -> int:
        if self.accounting.seq_len is None:
            raise LitCBSConfigError(
                "CBSProbeCallback places probes and windows in tokens, but the batches hold no token ids (no 2-D "
                "integer tensor): give seq_len=... to BatchAccounting or BatchWarmup (or the datamodule a "
                "`tokens_per_sample` attribute)"
            )
        return self.accounting.seq_len

    def global_batch(self) -> int:
        return known(self.accounting.global_batch, "BatchAccounting.global_batch")

    def largest_batch(self) -> int:
        return max(self.warmup.schedule.sizes() if self.warmup is not None else [self.global_batch()])

    def micro_batch_for(self, batch_size: int) -> Callable[[float], int | None]:
        """Samples per rank of branch k's micro-batch at the main batch ``batch_size`` (``branch_micro_batch``)."""
        return functools.partial(
            branch_micro_batch, batch_size=batch_size, accounting=self.accounting, warmup=self.warmup
        )

    def batch_at(self, tokens: float) -> int:
        """The global batch a probe at ``tokens`` would run at: the schedule's there (a CBSAdaptive's start)."""
        if self.warmup is None:
            return self.global_batch()
        schedule = self.warmup.schedule
        if isinstance(schedule, CBSAdaptive):
            return schedule.start
        return schedule.batch_size(int(tokens if schedule.unit == "tokens" else tokens // self.seq_len()))

    def heldout(self, trainer: pl.Trainer) -> list[Any] | None:
        """The held-out batches of ``evaluate="heldout"`` (a warning where there are fewer than asked for)."""
        config = self.config
        if config.evaluate != "heldout":
            return None
        heldout = load_heldout_batches(trainer, config.heldout_batches, config.snapshot_device)
        if len(heldout) < config.heldout_batches:
            rank_zero_warn(
                f"CBSProbeCallback: heldout_batches={config.heldout_batches} but the validation data has "
                f"{len(heldout)} batches (per rank); the readings' error bars rest on those {len(heldout)}"
            )
        return heldout

    def branch_trainer(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch_size: int, heldout: list[Any] | None
    ) -> BranchTrainer:
        """Trains and scores branches at the main batch ``batch_size`` (and the main run's own window)."""
        return BranchTrainer(
            trainer, pl_module, self.accounting, self.config, self.micro_batch_for(batch_size), heldout
        )

    def plan(
        self, trainer: pl.Trainer, batch_idx: int, tokens_spent: int, side_jobs: bool, adaptive_final: int | None
    ) -> ProbePlan | ProbeSkip:
        """``plan_probe`` for the point due right after this step (side jobs record one window of the main run)."""
        loader = resizable_train_loader(trainer)
        return plan_probe(
            self,
            end=self.end(trainer, batch_idx, into_step=0),
            tokens_spent=tokens_spent,
            main_span_tokens=self.config.window_tokens if side_jobs else None,
            adaptive_final=adaptive_final,
            uneven_loader=loader if loader is not None and loader.deals_unevenly else None,
        )

    def point(
        self, index: int, plan: ProbePlan, step: int, interrupted: tuple[int, int] | None, folder: str
    ) -> ProbePoint:
        """The point ``plan`` starts now, the ``index``-th; ``interrupted``: where a stopped probe's window began."""
        accounting, config, tokens = self.accounting, self.config, self.accounting.tokens_seen
        samples, world = accounting.samples_seen, accounting.data_parallel_size
        return ProbePoint(
            index=index,
            tokens=tokens,
            step=step,
            batch_size=self.global_batch(),
            seq_len=self.seq_len(),
            multipliers=plan.multipliers,
            window_samples=plan.window_samples,
            folder=folder,
            main_baseline=config.search == "bisect" and not config.cooldown_fraction,
            window_end_samples=samples + plan.window_samples,
            interrupted_at_tokens=interrupted[0] if interrupted is not None and interrupted[0] != tokens else None,
            replicates=config.replicates,
            main_end_samples=samples + plan.window_samples * config.replicates if not folder else None,
            looks=[samples + look * world for look in plan.early_stop_samples],
        )

    def end(self, trainer: pl.Trainer, batch_idx: int, into_step: int) -> RunEnd:
        return run_end(trainer, self.accounting, batch_idx + 1, into_step, self.largest_batch())

    def check_first_point(self, end: RunEnd, next_probe: int, resumed: bool, whole_span: bool = False) -> None:
        """Refuse a fresh run whose next point (or window) lies past its end; tell a resumed one."""
        if end.latest is None:
            return
        point = self.config.probe_point(next_probe)
        if not resumed:
            window = None
            if whole_span and point < end.latest:
                batch = self.batch_at(point)
                _, samples = window_at(self.config, batch, self.seq_len(), self.micro_batch_for(batch))
                window = samples * self.seq_len() if samples else None  # none: no probe runs there
            assert end.limit is not None, "a run end with tokens names its limit"
            self.config.check_inside_run(
                end.latest, end.limit, whole_span=window is not None, next_probe=next_probe, window_tokens=window
            )
            return
        if point >= end.latest:
            past = (
                f"the next, at {point:,.0f} tokens, lies past its end by {end.limit} at {end.latest:,} tokens or sooner"
            )
            why = f"the last of at_tokens is at {(self.config.at_tokens or [0])[-1]:,}" if math.isinf(point) else past
            rank_zero_info(f"CBSProbeCallback: no probe point is left in the rest of this run ({why})")

    def check_first_batch(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch_idx: int, next_probe: int, resumed: bool
    ) -> None:
        """At the first batch: refuse no tokens, an LR-writing ``optimizer_step``, unfit points."""
        accounting, batch = self.accounting, self.global_batch()
        self.seq_len()  # refuses batches without tokens
        check_optimizer_step_lr(trainer, pl_module, batch_idx)
        end = self.end(trainer, batch_idx, into_step=batch_idx % accounting.accumulate + 1)
        self.check_first_point(end, next_probe, resumed, whole_span=True)
        # Refuse a window without a step of the largest branch at a point the run still reaches.
        config, seq_len, end_tokens = self.config, self.seq_len(), math.inf if end.latest is None else end.latest
        largest = max(config.multipliers)
        points = itertools.takewhile(lambda at: at < end_tokens, map(config.probe_point, itertools.count(next_probe)))
        for point in itertools.islice(points, 1) if end.latest is None else points:
            largest_step = largest * (batch := self.batch_at(point)) * seq_len
            if self.config.window_tokens < largest_step:
                raise LitCBSConfigError(
                    f"window_tokens={self.config.window_tokens} is smaller than one step of the largest branch "
                    f"(k={largest:g} x batch {batch} x {seq_len} tokens = {largest_step:g}) "
                    f"at the probe at {point:,.0f} tokens; raise window_tokens or drop the largest multipliers"
                )
        sizes = self.warmup.schedule.sizes(self.warmup.consumed) if self.warmup is not None else [batch]
        fitting = max(
            len([k for k in self.config.multipliers if self.micro_batch_for(size)(k) is not None]) for size in sizes
        )
        if fitting < 2:
            raise LitCBSConfigError(
                f"multipliers={[f'{k:g}' for k in self.config.multipliers]}: at most one of them gives a batch "
                f"that is a whole number of micro-batches ({accounting.micro_batch_size} samples on each of "
                f"{accounting.data_parallel_size} ranks) at the run's global batches {sizes}, and one batch "
                "brackets no CBS: give at least two that fit, e.g. [1, 2]"
            )
        too_small = [k for k in self.config.multipliers if self.micro_batch_for(batch)(k) is None]
        if too_small:
            rank_zero_warn(
                f"multipliers {too_small} give batches that are not a whole number of micro-batches "
                f"({accounting.micro_batch_size} samples on each of {accounting.data_parallel_size} ranks) at batch "
                f"{batch}; they are skipped while that holds"
            )
