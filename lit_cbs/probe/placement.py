"""The run as a probe plans in it: its batch and tokens per sample, the batch its schedule gives at each probe point,
where it ends, and the checks a run's first batch makes of the probe's placement."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_cbs.callbacks.accounting import BatchAccounting, resizable_train_loader
from lit_cbs.errors import LitCBSConfigError
from lit_cbs.probe.branch import BranchTrainer, branch_micro_batch, optimizer_step_writes_lr
from lit_cbs.probe.config import ProbeConfig
from lit_cbs.probe.limits import RunEnd, known, run_end
from lit_cbs.probe.start import EpochEnd, ProbePlan, ProbeSkip, plan_probe, window_at
from lit_cbs.rules.batch_schedules import CBSAdaptive

if TYPE_CHECKING:
    from lit_cbs.callbacks.warmup import BatchWarmup

__all__: list[str] = []  # the probe engine's own parts


@dataclass
class ProbeRun:
    """The run as a probe plans in it: the Trainer's counts, the ``BatchWarmup`` whose schedule sets the batch at
    each point (None: the batch is fixed), and the checks a run's first batch makes of the probe's placement."""

    config: ProbeConfig
    accounting: BatchAccounting
    warmup: BatchWarmup | None

    def check_rules_match(self) -> None:
        """Beside a BatchWarmup whose batch changes, the probe's optimizer rules must be the BatchWarmup's: a branch at
        k x B measures what the run would train after growing its batch k-fold."""
        warmup, rules = self.warmup, self.config.rules
        if warmup is not None and not warmup.schedule.is_constant and warmup.rules.names() != rules.names():
            raise LitCBSConfigError(
                f"CBSProbeCallback({rules.describe()}) and BatchWarmup({warmup.rules.describe()}) move the optimizer "
                "differently at a batch change, so a branch at k x B would not train as the run does after growing "
                "its batch k-fold: give both the same lr_rule, weight_decay_rule, beta2_rule and beta2_floor"
            )

    def check_rules_apply(self, trainer: pl.Trainer) -> None:
        """Every multiplier's LR rule must apply to the optimizer and its schedulers (before any data is read)."""
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
        """Tokens per sample, known from the first batch on (``check_first_batch`` refuses a run without)."""
        return known(self.accounting.seq_len, "BatchAccounting.seq_len")

    def global_batch(self) -> int:
        """Samples per optimizer step, all ranks, known from the first batch on."""
        return known(self.accounting.global_batch, "BatchAccounting.global_batch")

    def largest_batch(self) -> int:
        """The largest global batch (samples) the run's schedule may reach."""
        return max(self.warmup.schedule.sizes() if self.warmup is not None else [self.global_batch()])

    def micro_batch_for(self, batch_size: int) -> Callable[[float], int | None]:
        """``branch_micro_batch`` at the main batch ``batch_size``: samples per rank of branch k's micro-batch."""
        return functools.partial(
            branch_micro_batch, batch_size=batch_size, accounting=self.accounting, warmup=self.warmup
        )

    def window_at(self, batch_size: int) -> tuple[list[float], int]:
        """The multipliers a probe at global batch ``batch_size`` trains and the samples its window records
        (``start.window_at``; 0 where fewer than two fit, or not k = 1: no probe runs there)."""
        return window_at(self.config, batch_size, self.seq_len(), self.micro_batch_for(batch_size))

    def batch_at(self, tokens: float) -> int:
        """The global batch (samples) a probe at ``tokens`` would run at: the one BatchWarmup's schedule gives
        there (a CBSAdaptive's start: its later batches wait on readings), else the run's batch."""
        if self.warmup is None:
            return self.global_batch()
        schedule = self.warmup.schedule
        if isinstance(schedule, CBSAdaptive):
            return schedule.start
        return schedule.batch_size(int(tokens if schedule.unit == "tokens" else tokens // self.seq_len()))

    def branch_trainer(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch_size: int, heldout: list | None
    ) -> BranchTrainer:
        """Trains and scores branches at the main batch ``batch_size`` (and scores the main run's own window)."""
        return BranchTrainer(
            trainer,
            pl_module,
            self.accounting,
            self.config.rules,
            self.config.evaluate,
            self.config.ema_alpha,
            micro_batch_for=self.micro_batch_for(batch_size),
            heldout=heldout,
            cooldown_fraction=self.config.cooldown_fraction,
        )

    def plan(
        self,
        trainer: pl.Trainer,
        batch_idx: int,
        tokens_spent: int,
        side_jobs: bool,
        adaptive_final: int | None,
    ) -> ProbePlan | ProbeSkip:
        """``plan_probe`` for the point due right after this optimizer step: the run's batch, its end, its epoch's
        end where the last round is uneven; ``side_jobs`` record only the first window of the main run."""
        accounting, batch_size = self.accounting, self.global_batch()
        loader = resizable_train_loader(trainer)
        uneven = loader is not None and loader.deals_unevenly
        end = self.end(trainer, batch_idx, into_step=0)
        return plan_probe(
            self.config,
            tokens=accounting.tokens_seen,
            batch_size=batch_size,
            seq_len=self.seq_len(),
            data_parallel_size=accounting.data_parallel_size,
            branch_micro_batch=self.micro_batch_for(batch_size),
            run_end_tokens=end.earliest,
            run_end=f"the run's end ({end.describe()})",
            tokens_spent=tokens_spent,
            main_span_tokens=self.config.window_tokens if side_jobs else None,
            adaptive_final=adaptive_final,
            epoch_end=EpochEnd(loader.num_samples, loader.position) if loader is not None and uneven else None,
            largest_batch=self.largest_batch(),
        )

    def end(self, trainer: pl.Trainer, batch_idx: int, into_step: int) -> RunEnd:
        """Where the run ends (tokens), by whichever limit ends it first; ``into_step``: micro-batches of the step
        not yet taken, counted already."""
        return run_end(trainer, self.accounting, batch_idx + 1, into_step, self.largest_batch())

    def check_first_point(
        self, end: RunEnd, next_probe: int, resumed: bool, whole_span: bool = False, in_window: bool = False
    ) -> None:
        """Refuse a fresh run whose next probe point lies at or past the run's latest end, or with ``whole_span``
        (at the first batch, where the batch is known), whose first window, as that probe would record it at the
        batch the schedule gives there, ends past it (``ProbeConfig.check_inside_run``). A resumed run past its last
        probe point is told so (``in_window``: a probe's window is open) and goes on."""
        if end.latest is None:
            return
        point = self.config.probe_point(next_probe)
        if not resumed:
            window = None
            if whole_span and point < end.latest:
                _, samples = self.window_at(self.batch_at(point))
                window = samples * self.seq_len() if samples else None  # none: no probe runs there
            assert end.limit is not None, "a run end with tokens names its limit"
            self.config.check_inside_run(
                end.latest, end.limit, whole_span=window is not None, next_probe=next_probe, window_tokens=window
            )
            return
        if point < end.latest:
            return
        after = "after the one in progress" if in_window else "in the rest of this run"
        if math.isinf(point):
            at_tokens = self.config.at_tokens
            assert at_tokens is not None, "only at_tokens run out of probe points"
            why = f"the last of at_tokens is at {at_tokens[-1]:,}"
        else:
            why = (
                f"the next, at {point:,.0f} tokens, lies past its end by {end.limit} at {end.latest:,} tokens or sooner"
            )
        rank_zero_info(f"CBSProbeCallback: no probe point is left {after} ({why})")

    def check_window(self, end: RunEnd, next_probe: int) -> None:
        """Refuse a window that holds no step of the largest branch at a probe point the run can still reach
        (before its latest end; the next point where no end is known), at the batch that probe would run at.
        A point past the end is never checked: a run resumed after its last probe goes on, whatever its batch."""
        largest = max(self.config.multipliers)
        seq_len = self.seq_len()
        points = self.config.points_before(math.inf if end.latest is None else end.latest, next_probe)
        for point in itertools.islice(points, 1) if end.latest is None else points:
            batch = self.batch_at(point)
            largest_step = largest * batch * seq_len
            if self.config.window_tokens < largest_step:
                raise LitCBSConfigError(
                    f"window_tokens={self.config.window_tokens} is smaller than one step of the largest branch "
                    f"(k={largest:g} x batch {batch} x {seq_len} tokens = {largest_step:g}) "
                    f"at the probe at {point:,.0f} tokens; raise window_tokens or drop the largest multipliers"
                )

    def check_first_batch(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch_idx: int, next_probe: int, resumed: bool
    ) -> None:
        """At the first batch, where the accounting has seen what the loader yields: tokens per sample, an
        optimizer_step that leaves the LR to the schedulers (tried once on a copy), a probe point inside the run, a
        window that holds a step of the largest branch at every point still to come, and two multipliers that fit."""
        accounting = self.accounting
        if accounting.seq_len is None:
            raise LitCBSConfigError(
                "CBSProbeCallback places probes and windows in tokens, but the batches hold no token ids (no 2-D "
                "integer tensor): give seq_len=... to BatchAccounting or BatchWarmup (or the datamodule a "
                "`tokens_per_sample` attribute)"
            )
        batch = self.global_batch()
        written = optimizer_step_writes_lr(trainer, pl_module, batch_idx)
        if written is not None:
            raise LitCBSConfigError(
                f"CBSProbeCallback: the module's optimizer_step sets the learning rate itself ({written}, tried once "
                "on a copy of the run's state), so no probe branch could train at lr_rule(k) x the run's LR: set "
                "the LR with an LR scheduler (configure_optimizers, TokenLRScheduler) instead of writing param_groups "
                "in optimizer_step, or drop the probe"
            )
        end = self.end(trainer, batch_idx, into_step=batch_idx % accounting.accumulate + 1)
        self.check_first_point(end, next_probe, resumed, whole_span=True)
        self.check_window(end, next_probe)
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
