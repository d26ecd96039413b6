"""``CBSProbeCallback``: measure the critical batch size (CBS) online by branched training.

How it runs the paper's protocol (``reading.py``) inside one Trainer, without re-entering Lightning's loops:

1. At a probe point (tokens seen), after an optimizer step, snapshot the training state S0
   (``TrainingSnapshot``: parameters, optimizer, schedulers, grad scaler, RNG and metric states).
2. The main run goes on for one window; its micro-batches and step losses are recorded as they
   stream by (``RecordedWindow``): the main run *is* the k = 1 branch.
3. At the window's end, snapshot the main state S1, then for each k restore S0 and train batch k*B
   on the recorded micro-batches (``branch.py``): every branch sees exactly the tokens the main run
   saw. Then restore S1: the main run is untouched (parameters, optimizer state, RNG streams, data).
4. Apply the k* rule to the branches' losses (``ProbeReading.decide``), log the reading, append it
   to ``cbs_probe.jsonl``, and feed a ``CBSAdaptive`` batch schedule if one is in use.

The batch and token counts come from ``BatchAccounting``, so the probe runs on a fixed-batch run
alone; with ``BatchWarmup`` it also feeds ``CBSAdaptive`` and draws the batch changes in its plot.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import json
import math
import time
from pathlib import Path
from typing import Any, cast

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_cbs import legacy, metrics
from lit_cbs._internals import should_accumulate
from lit_cbs.callbacks.accounting import BatchAccounting, micro_batch_loss, resizable_train_loader
from lit_cbs.callbacks.logs import log_figures, log_to_loggers
from lit_cbs.callbacks.module_state import logging_muted
from lit_cbs.callbacks.warmup import BatchWarmup
from lit_cbs.errors import LitCBSConfigError, require_automatic_optimization
from lit_cbs.probe.branch import (
    BranchMeasurer,
    BranchTrainer,
    ProbeAborted,
    ProbeUnusable,
    RecordedWindow,
    branch_micro_batch,
    no_baseline,
    optimizer_step_writes_lr,
)
from lit_cbs.probe.config import ProbeConfig
from lit_cbs.probe.heldout import load_heldout_batches
from lit_cbs.probe.limits import RunEnd, known, run_end
from lit_cbs.probe.reading import BranchScore, ProbeReading
from lit_cbs.probe.side_jobs import JOBS_FOLDER, PendingProbe, SideJobRuns, score_from_json
from lit_cbs.probe.snapshot import TrainingSnapshot
from lit_cbs.probe.start import EpochEnd, ProbeSkip, plan_probe, window_at
from lit_cbs.rules.batch_schedules import CBSAdaptive

__all__ = ["CBSProbeCallback"]

JSONL_FILE = "cbs_probe.jsonl"
PLOT_FILE = "cbs_curve.png"


class CBSProbeCallback(Callback):
    """Measure the critical batch size at intervals by branched mini-fits from in-memory copies.

    Reads the global batch B, the micro-batch and the token count from the Trainer's
    ``BatchAccounting`` (attached if absent), so it needs no other callback. Probe points and windows
    are in tokens: the batches must hold token ids, or ``seq_len`` be given (to ``BatchAccounting``
    or ``BatchWarmup``).

    Args:
        config: the probe's settings (``ProbeConfig``: where to probe, the grid of k, the window,
            the k* rule, how branches are scored), checked when it is made.
        **settings: ``ProbeConfig``'s fields as keywords instead (as Hydra's ``_target_`` passes
            them); not both. The settings are read back at ``probe.config``.

    Attributes:
        history: one ``ProbeReading`` per finished probe.
        failures: probes that found the run cannot be probed (an ``optimizer_step`` that writes the
            LR): tokens, step and reason; the main run goes on and no later probe runs.
        tokens_spent: tokens trained in branches so far (all ranks).

    Raises:
        LitCBSConfigError: both ``config`` and ``settings``, no placement (``every_tokens``, ``at_tokens`` or
            ``geometric``), or a setting ``ProbeConfig`` refuses; at ``setup`` and the first batch, what needs the
            Trainer (no token ids, a window that holds no step of the largest branch, ...).

    Examples:
        >>> probe = CBSProbeCallback(every_tokens=1_000_000, window_tokens=262_144)
        >>> probe.config.multipliers, probe.probe_point(1), probe.span_tokens  # k; tokens; tokens
        ([1.0, 2.0, 4.0, 8.0], 2000000, 262144)
        >>> probe.history, probe.tokens_spent
        ([], 0)
        >>> CBSProbeCallback(multipliers=[1, 2])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        lit_cbs.errors.LitCBSConfigError: CBSProbeCallback needs where to probe: give every_tokens, at_tokens or ...

        ``Trainer(callbacks=[probe])`` then probes at 1M, 2M, ... tokens and writes ``cbs_probe.jsonl``.
    """

    feeds_cbs_adaptive = True  # BatchWarmup lets a CBSAdaptive schedule start only beside a callback that feeds it

    def __init__(self, config: ProbeConfig | None = None, **settings: Any):
        if config is not None and settings:
            raise LitCBSConfigError(
                "CBSProbeCallback: give a ProbeConfig or its fields as keywords, not both "
                f"(got config and {sorted(settings)})"
            )
        self.config = config if config is not None else ProbeConfig(**settings)
        if all(getattr(self.config, name) is None for name in ("every_tokens", "at_tokens", "geometric")):
            raise LitCBSConfigError(
                "CBSProbeCallback needs where to probe: give every_tokens, at_tokens or geometric=(first_tokens, ratio)"
            )

        self.history: list[ProbeReading] = []
        self.failures: list[dict] = []  # probes that found the run cannot be probed: tokens, step, reason
        self.tokens_spent = 0
        self.probes_started = 0
        self._attached_accounting: BatchAccounting | None = None  # the Trainer's, from setup: read as _accounting
        self._warmup: BatchWarmup | None = None  # only for CBSAdaptive and the batch changes in the plot
        self._window: RecordedWindow | None = None  # the probe whose window the main run is training
        self._branches: BranchTrainer | None = None  # trains and scores that window's branches
        self._branches_batch: int | None = None  # the main batch it was made for
        self._micro_losses: list[float] = []  # of the optimizer step in progress, while a window is being trained
        self._trained: list[float] = []  # multipliers trained as branches in that window
        self._failed: list[float] = []
        self._unusable = False  # a probe found the run cannot be probed: no later one runs
        self._side = SideJobRuns(self.config.side_jobs) if self.config.side_jobs is not None else None
        self._heldout: list | None = None
        self._first_window_main: BranchScore | None = (
            None  # the main run's score after a replicated probe's first window
        )
        self._interrupted: tuple[int, int] | None = None  # (tokens, step) where a stopped probe's window began
        self._resumed = False
        self._deferred = False  # a due probe whose window the run's end would cut: left to a resumed run
        self._waiting_in_epoch: int | None = None  # the epoch whose uneven end a due probe waits out
        self._batch_checked = False
        self._resolved_output_dir: Path | None = None

    @property
    def span_tokens(self) -> int:
        """Tokens of the main run one probe records (``ProbeConfig.span_tokens``).

        Examples:
            >>> probe = CBSProbeCallback(every_tokens=10**6, window_tokens=262_144, replicates=2, evaluate="heldout")
            >>> probe.span_tokens  # two windows of 262,144 tokens
            524288
        """
        return self.config.span_tokens

    @property
    def lr_rule(self):
        """The LR rule (``config.rules.lr``): the factor a branch's LR moves by for batch ratio k.

        Examples:
            >>> CBSProbeCallback(every_tokens=10**6, lr_rule="linear").lr_rule
            LRRule('linear')
        """
        return self.config.rules.lr

    @property
    def _accounting(self) -> BatchAccounting:
        """The Trainer's ``BatchAccounting``, attached in ``setup``."""
        if self._attached_accounting is None:
            raise RuntimeError("CBSProbeCallback has no BatchAccounting: it was not set up for a fit (Trainer.fit)")
        return self._attached_accounting

    def _seq_len(self) -> int:
        """Tokens per sample, known from the first batch on (``_check_batch`` refuses a run without)."""
        return known(self._accounting.seq_len, "BatchAccounting.seq_len")

    def _global_batch(self) -> int:
        """Samples per optimizer step, all ranks, known from the first batch on."""
        return known(self._accounting.global_batch, "BatchAccounting.global_batch")

    def probe_point(self, index: int) -> float:
        """Token count of the index-th probe (0-based; ``ProbeConfig.probe_point``).

        Args:
            index: which probe, 0 for the first.

        Returns:
            Its point in tokens (global); inf past the last of ``at_tokens``.

        Examples:
            >>> CBSProbeCallback(geometric=(1_000_000, 2)).probe_point(3)
            8000000
        """
        return self.config.probe_point(index)

    # ------------------------------------------------------------------ checks before training
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """For a fit: attach the Trainer's ``BatchAccounting`` and find its ``BatchWarmup``.

        Raises:
            LitCBSConfigError: manual optimization, a ``BatchWarmup`` whose batch changes and whose optimizer rules
                differ from the probe's, or a side-job launcher that cannot start a job.
        """
        if stage != "fit":
            return
        require_automatic_optimization(pl_module, "CBSProbeCallback", "it trains branches through it")
        self._attached_accounting = BatchAccounting.attach(trainer)
        callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector, undeclared
        self._warmup = next((callback for callback in callbacks if isinstance(callback, BatchWarmup)), None)
        warmup = self._warmup
        if warmup is not None and not warmup.schedule.is_constant and warmup.rules.names() != self.config.rules.names():
            raise LitCBSConfigError(
                f"CBSProbeCallback({self.config.rules.describe()}) and BatchWarmup({warmup.rules.describe()}) "
                "move the optimizer differently at a batch change, so a branch at k x B would not train as the run "
                "does after growing its batch k-fold: give both the same lr_rule, weight_decay_rule, beta2_rule "
                "and beta2_floor"
            )
        if self._side is not None:
            self._side.check(trainer)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Before any data is read: every multiplier's LR rule must apply to the optimizer and its schedulers.

        Raises:
            LitCBSConfigError: the optimizer or a scheduler cannot be moved by the probe's rules at some k.
        """
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        ratios = list(self.config.multipliers)
        warmup = self._warmup
        if warmup is not None and warmup.lr_rule.name == self.config.rules.lr.name == "adam_sde":
            # BatchWarmup's adam_sde shrinks the betas as the batch grows; branches start from there.
            sizes = warmup.schedule.sizes()
            ratios = [k * max(sizes) / min(sizes) for k in ratios]
        who = (
            f"CBSProbeCallback({self.config.rules.describe()}, "
            f"multipliers=[{', '.join(f'{k:g}' for k in self.config.multipliers)}])"
        )
        for optimizer in trainer.optimizers:
            self.config.rules.check(optimizer, schedulers, ratios, who)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Resolve the output folder, load the held-out batches, refuse a first probe point past ``max_tokens``,
        and start the probe a resumed run left due.

        Raises:
            LitCBSConfigError: the first probe point lies past ``max_tokens``, no validation data for
                ``evaluate="heldout"``, or side jobs without an output folder or a ``GlobalOrderLoader``.
        """
        self._resumed, self._deferred = trainer.global_step > 0, False
        max_tokens = self._accounting.max_tokens
        if (
            max_tokens is not None and not self._resumed
        ):  # before any data is read; max_steps, max_epochs at the first batch
            self._check_first_point(RunEnd(max_tokens, max_tokens, f"max_tokens={max_tokens}"))
        if self.config.evaluate == "heldout":
            self._heldout = load_heldout_batches(trainer, self.config.heldout_batches, self.config.snapshot_device)
            if len(self._heldout) < self.config.heldout_batches:
                rank_zero_warn(
                    f"CBSProbeCallback: heldout_batches={self.config.heldout_batches} but the validation data has "
                    f"{len(self._heldout)} batches (per rank); "
                    f"the readings' error bars rest on those {len(self._heldout)}"
                )
        self._batch_checked = False
        # trainer.log_dir broadcasts from rank 0: resolve it on every rank, once. Without a logger
        # and without output_dir the readings stay in `history` (no files in the working directory).
        log_dir = trainer.log_dir if trainer.loggers else None
        output_dir = cast("Path | None", self.config.output_dir)  # ProbeConfig made it a Path
        self._resolved_output_dir = output_dir or (Path(log_dir) if log_dir else None)
        if self._resolved_output_dir is None and self._side is not None:
            raise LitCBSConfigError(
                "CBSProbeCallback(side_jobs=...) keeps each probe's checkpoint and its jobs' files beside "
                "cbs_probe.jsonl, but the run has no logger and no output_dir: give output_dir=..."
            )
        if self._resolved_output_dir is None:
            rank_zero_info("CBSProbeCallback: no logger and no output_dir; readings are kept in .history only")
        elif trainer.is_global_zero:
            self._write_history()
        if self._side is not None:
            self._side.check_loader(trainer)
        if (
            self._resumed
            and not self._accounting.budget_reached
            and self._accounting.tokens_seen >= self.config.probe_point(self.probes_started)
        ):
            # Resumed where a probe was due, or inside one that was stopped: it starts here, before the first batch,
            # as the uninterrupted run started it right after this step.
            self._start_probe(trainer, pl_module, trainer.fit_loop.epoch_loop.batch_progress.current.ready - 1)

    def _write_history(self) -> None:
        """Make cbs_probe.jsonl hold exactly ``history`` (at the start of a fit and after each reading):
        a resumed run starts it from its checkpoint's readings, so nothing is written twice and no
        reading after the checkpoint lingers."""
        folder = self._resolved_output_dir
        assert folder is not None, "written only where there is an output folder"
        path = folder / JSONL_FILE
        if not self.history:
            path.unlink(missing_ok=True)
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(dataclasses.asdict(reading)) + "\n" for reading in self.history))

    def _run_end(self, trainer: pl.Trainer, batch_idx: int, into_step: int) -> RunEnd:
        """Where the run ends (tokens), by whichever limit ends it first; ``into_step``: micro-batches
        of the step not yet taken, counted already."""
        return run_end(trainer, self._accounting, batch_idx + 1, into_step, self._largest_batch())

    def _largest_batch(self) -> int:
        """The largest global batch (samples) the run's schedule may reach."""
        sizes = self._warmup.schedule.sizes() if self._warmup is not None else [self._global_batch()]
        return max(sizes)

    def _check_first_point(self, end: RunEnd, whole_span: bool = False) -> None:
        """Refuse a fresh run whose next probe point lies at or past the run's latest end, or with
        ``whole_span`` (at the first batch, where the batch is known), whose first window, as that probe
        would record it at the batch the schedule gives there, ends past it (``ProbeConfig.check_inside_run``).
        A resumed run past its last probe point is told so and goes on."""
        if end.latest is None:
            return
        point = self.config.probe_point(self.probes_started)
        if not self._resumed:
            window = None
            if whole_span and point < end.latest:
                _, samples = self._window_at(self._batch_at(point))
                window = samples * self._seq_len() if samples else None  # none: no probe runs there
            assert end.limit is not None, "a run end with tokens names its limit"
            self.config.check_inside_run(
                end.latest,
                end.limit,
                whole_span=window is not None,
                next_probe=self.probes_started,
                window_tokens=window,
            )
            return
        if point < end.latest:
            return
        after = "after the one in progress" if self._window is not None else "in the rest of this run"
        if math.isinf(point):
            at_tokens = self.config.at_tokens
            assert at_tokens is not None, "only at_tokens run out of probe points"
            why = f"the last of at_tokens is at {at_tokens[-1]:,}"
        else:
            why = (
                f"the next, at {point:,.0f} tokens, lies past its end by {end.limit} at {end.latest:,} tokens or sooner"
            )
        rank_zero_info(f"CBSProbeCallback: no probe point is left {after} ({why})")

    def _batch_at(self, tokens: float) -> int:
        """The global batch (samples) a probe at ``tokens`` would run at: the one BatchWarmup's schedule gives
        there (a CBSAdaptive's start: its later batches wait on readings), else the run's batch."""
        warmup = self._warmup
        if warmup is None:
            return self._global_batch()
        schedule = warmup.schedule
        if isinstance(schedule, CBSAdaptive):
            return schedule.start
        return schedule.batch_size(int(tokens if schedule.unit == "tokens" else tokens // self._seq_len()))

    def _check_window(self, end: RunEnd) -> None:
        """Refuse a window that holds no step of the largest branch at a probe point the run can still reach
        (before its latest end; the next point where no end is known), at the batch that probe would run at.
        A point past the end is never checked: a run resumed after its last probe goes on, whatever its batch."""
        largest = max(self.config.multipliers)
        seq_len = self._seq_len()  # known: _check_batch refused a run without before calling this
        points = self.config.points_before(math.inf if end.latest is None else end.latest, self.probes_started)
        for point in itertools.islice(points, 1) if end.latest is None else points:
            batch = self._batch_at(point)
            largest_step = largest * batch * seq_len
            if self.config.window_tokens < largest_step:
                raise LitCBSConfigError(
                    f"window_tokens={self.config.window_tokens} is smaller than one step of the largest branch "
                    f"(k={largest:g} x batch {batch} x {seq_len} tokens = {largest_step:g}) "
                    f"at the probe at {point:,.0f} tokens; raise window_tokens or drop the largest multipliers"
                )

    def _check_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch_idx: int) -> None:
        """At the first batch, where the accounting has seen what the loader yields: tokens per
        sample, an optimizer_step that leaves the LR to the schedulers (tried once on a copy), a probe point
        inside the run, and a window that holds a step of the largest branch at every point still to come."""
        accounting = self._accounting
        seq_len = accounting.seq_len
        if seq_len is None:
            raise LitCBSConfigError(
                "CBSProbeCallback places probes and windows in tokens, but the batches hold no token ids (no 2-D "
                "integer tensor): give seq_len=... to BatchAccounting or BatchWarmup (or the datamodule a "
                "`tokens_per_sample` attribute)"
            )
        batch = self._global_batch()
        written = optimizer_step_writes_lr(trainer, pl_module, batch_idx)
        if written is not None:
            raise LitCBSConfigError(
                f"CBSProbeCallback: the module's optimizer_step sets the learning rate itself ({written}, tried once "
                "on a copy of the run's state), so no probe branch could train at lr_rule(k) x the run's LR: set "
                "the LR with an LR scheduler (configure_optimizers, TokenLRScheduler) instead of writing param_groups "
                "in optimizer_step, or drop the probe"
            )
        end = self._run_end(trainer, batch_idx, into_step=batch_idx % accounting.accumulate + 1)
        self._check_first_point(end, whole_span=True)
        self._check_window(end)
        for reading in self.history:
            if reading.seq_len is None:  # resumed from a checkpoint of the first readings, which lack it
                reading.seq_len = seq_len
        sizes = self._warmup.schedule.sizes(self._warmup.consumed) if self._warmup is not None else [batch]
        if (
            max(
                len([k for k in self.config.multipliers if self._micro_batch_for(size)(k) is not None])
                for size in sizes
            )
            < 2
        ):
            raise LitCBSConfigError(
                f"multipliers={[f'{k:g}' for k in self.config.multipliers]}: at most one of them gives a batch "
                f"that is a whole number of micro-batches ({accounting.micro_batch_size} samples on each of "
                f"{accounting.data_parallel_size} ranks) at the run's global batches {sizes}, and one batch "
                "brackets no CBS: give at least two that fit, e.g. [1, 2]"
            )
        too_small = [k for k in self.config.multipliers if self._micro_batch_for(batch)(k) is None]
        if too_small:
            rank_zero_warn(
                f"multipliers {too_small} give batches that are not a whole number of micro-batches "
                f"({accounting.micro_batch_size} samples on each of {accounting.data_parallel_size} ranks) at batch "
                f"{batch}; they are skipped while that holds"
            )

    # ------------------------------------------------------------------ main-run hooks
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self._batch_checked:
            self._batch_checked = True
            self._check_batch(trainer, pl_module, batch_idx)
        if self._window is not None:
            self._window.record_batch(batch, self.config.snapshot_device)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        window = self._window
        open_windows = self._side.windows_open() if self._side is not None else []
        if window is not None or open_windows:
            loss = micro_batch_loss(trainer, outputs)
            if loss is None:
                raise TypeError("CBSProbeCallback needs every training_step to return its loss; one returned None")
            self._micro_losses.append(float(loss))
        if should_accumulate(trainer):
            return
        step_loss = sum(self._micro_losses) / len(self._micro_losses) if self._micro_losses else None
        self._micro_losses = []
        if window is not None:
            assert step_loss is not None, "every micro-batch of a window's step returned its loss"
            window.step_losses.append(step_loss)
            if window.first_window_complete and self._accounting.global_batch == window.batch_size:
                with self._accounting.branching():  # the main run is the k = 1 branch of the first window
                    scorer = self._branch_trainer(trainer, pl_module, window.batch_size)
                    self._first_window_main = scorer.score(window.step_losses)
            if window.complete or window.at_early_stop:
                self._finish_probe(trainer, pl_module)
        elif not self._deferred and self._accounting.tokens_seen >= self.config.probe_point(self.probes_started):
            self._start_probe(trainer, pl_module, batch_idx)
        if self._side is not None:
            self._side_step(trainer, pl_module, open_windows, step_loss)

    def on_train_end(self, trainer, pl_module) -> None:
        if self._window is not None:
            if self._accounting.stop_signal is None:
                rank_zero_warn(f"CBS probe at {self._window.tokens:,} tokens dropped: training ended inside its window")
                self._accounting.probe_window_step = None
            else:  # stopped by a signal: a resumed run redoes it (FinalStateCheckpoint keeps its start)
                self._interrupted = (self._window.tokens, self._window.step)
            self._window = None
        if self._side is not None and self._side.pending and self._accounting.stop_signal is None:
            self._wait_for_side_jobs(trainer)
        self._draw(trainer)

    def _draw(self, trainer: pl.Trainer) -> None:
        """cbs_curve.png of the readings so far (rank 0), sent to the loggers that take images."""
        if not (trainer.is_global_zero and self.history and self._resolved_output_dir is not None):
            return
        from lit_cbs.probe.plot import plot_cbs_curve  # matplotlib only where a curve is drawn

        batch_changes = self._warmup.history if self._warmup is not None else []
        path = plot_cbs_curve(
            self.history,
            batch_changes,
            self._resolved_output_dir / PLOT_FILE,
            self._accounting.tokens_seen,
            self.config.epsilon,
        )
        log_figures(trainer.loggers, [path], trainer.global_step)

    # ------------------------------------------------------------------ a probe
    def _micro_batch_for(self, batch_size: int):
        """``branch_micro_batch`` at the main batch ``batch_size``: samples per rank of branch k's micro-batch."""
        return functools.partial(
            branch_micro_batch, batch_size=batch_size, accounting=self._accounting, warmup=self._warmup
        )

    def _branch_trainer(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch_size: int) -> BranchTrainer:
        """Trains and scores the branches of a window at the main batch ``batch_size`` (and scores the main run's
        own window as a branch is scored); kept while that window is open."""
        if self._branches is None or self._branches.trainer is not trainer or self._branches_batch != batch_size:
            self._branches_batch = batch_size
            self._branches = BranchTrainer(
                trainer,
                pl_module,
                self._accounting,
                self.config.rules,
                self.config.evaluate,
                self.config.ema_alpha,
                micro_batch_for=self._micro_batch_for(batch_size),
                heldout=self._heldout,
                cooldown_fraction=self.config.cooldown_fraction,
            )
        return self._branches

    def _window_at(self, batch_size: int) -> tuple[list[float], int]:
        """The multipliers a probe at global batch ``batch_size`` trains and the samples its window records
        (``start.window_at``; 0 where fewer than two fit, or not k = 1: no probe runs there)."""
        return window_at(self.config, batch_size, self._seq_len(), self._micro_batch_for(batch_size))

    def _start_probe(self, trainer, pl_module, batch_idx: int) -> None:
        accounting = self._accounting
        tokens = accounting.tokens_seen
        interrupted, self._interrupted = self._interrupted, None
        if interrupted is not None and interrupted != (tokens, trainer.global_step):
            rank_zero_warn(
                f"CBS probe whose window began at {interrupted[0]:,} tokens (step {interrupted[1]}) was stopped and is "
                f"redone at {tokens:,} tokens (step {trainer.global_step}), where this run resumed: its reading "
                "says so (interrupted_at_tokens). "
                "Resuming from the checkpoint of the probe's start redoes it where it began"
            )
        pending = self.probes_started
        self.probes_started += 1
        while self.config.probe_point(self.probes_started) <= tokens:
            self.probes_started += 1  # points passed inside one step (or during an earlier window)
        if self._unusable:
            return  # a probe found this run cannot be probed: no later one would fare better
        schedule = self._adaptive_schedule()
        at_final = schedule is not None and not schedule.wants_readings(self._consumed(schedule))
        loader = resizable_train_loader(trainer)
        uneven = loader is not None and loader.deals_unevenly
        batch_size = self._global_batch()
        end = self._run_end(trainer, batch_idx, into_step=0)  # right after an optimizer step
        plan = plan_probe(
            self.config,
            tokens=tokens,
            batch_size=batch_size,
            seq_len=self._seq_len(),
            data_parallel_size=accounting.data_parallel_size,
            branch_micro_batch=self._micro_batch_for(batch_size),
            run_end_tokens=end.earliest,
            run_end=f"the run's end ({end.describe()})",
            tokens_spent=self.tokens_spent,
            main_span_tokens=self.config.window_tokens if self._side is not None else None,
            adaptive_final=schedule.final if schedule is not None and at_final else None,
            epoch_end=EpochEnd(loader.num_samples, loader.position) if loader is not None and uneven else None,
            largest_batch=self._largest_batch(),
        )
        if isinstance(plan, ProbeSkip) and plan.next_epoch:
            # Said once per epoch (the epoch is the loader's to tell): the point is asked again after every step.
            assert loader is not None, "only an uneven loader's epoch end makes a probe wait for the next epoch"
            if self._waiting_in_epoch != loader.epoch:
                self._waiting_in_epoch = loader.epoch
                rank_zero_info(f"CBS probe at {tokens:,} tokens waits for the next epoch: {plan.reason}")
            self.probes_started = pending
            return
        if isinstance(plan, ProbeSkip):
            if (
                plan.stays_due
            ):  # the point stays due: a run resumed from this one's last checkpoint takes it at its start
                self.probes_started, self._deferred = pending, True
            message = f"CBS probe at {tokens:,} tokens {'not started' if plan.stays_due else 'skipped'}: {plan.reason}"
            rank_zero_warn(message) if plan.warn else rank_zero_info(message)
            return
        moved = interrupted[0] if interrupted is not None and interrupted[0] != tokens else None
        if self._side is not None:
            self._start_side_probe(trainer, pending, plan, moved)
            return
        self._branches = None  # built afresh for this window's batch
        self._trained, self._failed, self._first_window_main = [], [], None
        with accounting.branching():  # the copy is probe work, not the main run's time
            start = TrainingSnapshot(trainer, pl_module, self.config.snapshot_device)
        self._window = RecordedWindow(
            early_stop_samples=plan.early_stop_samples,
            tokens=tokens,
            step=trainer.global_step,
            batch_size=batch_size,
            accumulate=accounting.accumulate,
            micro_batch_size=known(accounting.micro_batch_size, "BatchAccounting.micro_batch_size"),
            data_parallel_size=accounting.data_parallel_size,
            seq_len=self._seq_len(),
            multipliers=plan.multipliers,
            window_samples=plan.window_samples,
            start=start,
            replicates=self.config.replicates,
            interrupted_at_tokens=moved,
        )
        accounting.probe_window_step = trainer.global_step

    def _finish_probe(self, trainer, pl_module) -> None:
        """Train and score the branches over the window recorded so far; record the reading if the
        window is complete or the reading is determined at an early-stop point."""
        window, accounting = self._window, self._accounting
        assert window is not None, "called only while a window is open"
        final = window.complete
        main_changed_batch = accounting.global_batch != window.batch_size
        branches = self._branch_trainer(trainer, pl_module, window.batch_size)
        spent_before = branches.tokens_trained

        def main_baseline() -> BranchScore | None:
            """k = 1 of the first window is the main run's own, when it trained batch B there."""
            if window.replicates == 1 and not main_changed_batch:
                return main_score
            return self._first_window_main

        main_is_baseline = self.config.search == "bisect" and not self.config.cooldown_fraction
        with accounting.branching():  # probe work: not the main run's time or gradients
            after_window = TrainingSnapshot(trainer, pl_module, self.config.snapshot_device)
            try:
                main_score = branches.score(window.step_losses)
                measurer = BranchMeasurer(
                    functools.partial(branches.loss, window, keep=not final),
                    window.replicates,
                    main_baseline if main_is_baseline else no_baseline,
                    self._trained,
                    self._failed,
                )
                with logging_muted(pl_module):
                    scores = measurer.scores(self.config.search, window.multipliers, self.config.epsilon)
            except ProbeAborted:
                if accounting.stop_signal is None:  # else FinalStateCheckpoint says it with the stop, once
                    rank_zero_warn(f"CBS probe at {window.tokens:,} tokens stopped by a signal; main state restored")
                self._interrupted, self._window = (window.tokens, window.step), None
                return
            except ProbeUnusable as error:
                rank_zero_warn(
                    f"CBS probe at {window.tokens:,} tokens failed: {error}. The main run goes on from its own state; "
                    "no later probe runs (CBSProbeCallback.failures has the reason)"
                )
                self._unusable = True
                self.failures.append({"tokens": window.tokens, "step": window.step, "reason": str(error)})
                self._window, accounting.probe_window_step = None, None
                return
            finally:
                after_window.restore(trainer, pl_module)
                accounting.set_gradient_sync(None)
        self.tokens_spent += branches.tokens_trained - spent_before
        reading = self.config.decide(
            scores,
            window.multipliers,
            window.batch_size,
            tokens=window.tokens,
            step=window.step,
            seq_len=window.seq_len,
            window_tokens=window.tokens_of(min(window.recorded_samples, window.samples_per_rank)),
            main_loss=main_score.loss,
            branches_trained=list(self._trained),
            failed=list(self._failed),
            tokens_spent=branches.tokens_trained,
            overhead=self.tokens_spent / max(1, accounting.tokens_seen),
            planned_window_tokens=window.window_tokens,
            interrupted_at_tokens=window.interrupted_at_tokens,
            replicates=window.replicates,
        )
        if not (final or reading.determined):
            return  # undetermined at an early-stop point: the window goes on
        self._window = None
        accounting.probe_window_step = None
        self._record(trainer, reading)

    def _record(self, trainer: pl.Trainer, reading: ProbeReading, log_step: int | None = None) -> None:
        """A reading is in: CBSAdaptive hears it, it joins ``history``, is logged (at ``log_step``, default this
        step) and written."""
        self._feed_adaptive_schedule(reading)
        self.history.append(reading)
        self.history.sort(key=lambda reading: reading.tokens)  # side jobs may report out of order
        self._report(trainer, reading, log_step)

    def _adaptive_schedule(self) -> CBSAdaptive | None:
        """The run's BatchWarmup schedule if it is a CBSAdaptive the readings drive."""
        schedule = self._warmup.schedule if self._warmup is not None else None
        return schedule if isinstance(schedule, CBSAdaptive) else None

    def _consumed(self, schedule: CBSAdaptive) -> int:
        """What ``schedule`` counts (tokens or samples), trained on so far."""
        return self._accounting.tokens_seen if schedule.unit == "tokens" else self._accounting.samples_seen

    def _feed_adaptive_schedule(self, reading: ProbeReading) -> None:
        """Tell a CBSAdaptive batch schedule the measured CBS lower bound; note the batch it moves to."""
        schedule = self._adaptive_schedule()
        if schedule is None:
            return
        if not reading.determined:
            rank_zero_info("CBSAdaptive: the reading is undetermined at this confidence; the batch stays")
            return
        consumed = self._consumed(schedule)
        if schedule.observe(consumed, reading.cbs_lower):
            reading.adaptive_batch = schedule.batch_size(consumed)
            rank_zero_info(
                f"CBSAdaptive: CBS >= {reading.cbs_lower:g} samples; global batch -> {reading.adaptive_batch}"
            )

    # ------------------------------------------------------------------ side jobs
    def _start_side_probe(self, trainer: pl.Trainer, index: int, plan, moved: int | None) -> None:
        """Write the probe's start checkpoint, hand its branches to a side job, and train on as k = 1."""
        accounting, side, folder = self._accounting, self._side, self._resolved_output_dir
        assert side is not None and folder is not None, "side jobs run with an output folder (on_train_start)"
        pending = PendingProbe(
            index=index,
            tokens=accounting.tokens_seen,
            step=trainer.global_step,
            batch_size=self._global_batch(),
            seq_len=self._seq_len(),
            multipliers=plan.multipliers,
            window_samples=plan.window_samples,
            folder=str(folder / JOBS_FOLDER / f"probe{index:03d}_{accounting.tokens_seen}tokens"),
            main_baseline=self.config.search == "bisect" and not self.config.cooldown_fraction,
            window_end_samples=accounting.samples_seen + plan.window_samples,
            interrupted_at_tokens=moved,
        )
        with accounting.branching():  # the checkpoint is probe work, not the main run's time
            side.open(trainer, pending, self.config)
        rank_zero_info(
            f"CBS probe at {pending.tokens:,} tokens (batch {pending.batch_size}): multipliers "
            f"[{', '.join(f'{k:g}' for k in pending.multipliers)}] handed to a side job ({pending.folder}); "
            "the main run trains on as k = 1"
        )

    def _side_step(self, trainer, pl_module, open_windows: list[PendingProbe], step_loss: float | None) -> None:
        """After a main-run optimizer step: the main run's windows of side-job probes move on (scored where they
        end), and the readings whose jobs are done are decided."""
        accounting, side = self._accounting, self._side
        assert side is not None, "called only with side jobs"
        for pending in open_windows:
            assert step_loss is not None, "every micro-batch of an open window's step returned its loss"
            pending.main_step_losses.append(step_loss)
            pending.main_changed_batch |= accounting.global_batch != pending.batch_size
            if accounting.samples_seen >= pending.window_end_samples:
                with accounting.branching():
                    scorer = self._branch_trainer(trainer, pl_module, pending.batch_size)
                    score = scorer.score(pending.main_step_losses)
                side.window_ended(trainer, pending, score, pending.main_changed_batch)
        self._take_finished(trainer, side, "; the main run goes on")

    def _take_finished(self, trainer: pl.Trainer, side: SideJobRuns, after_failure: str = "") -> None:
        """The side jobs that ended: a reading decided for each that gave scores, a failure recorded (and said,
        with ``after_failure`` appended) for each that gave up; each one's folder closed."""
        for pending, outcome in side.poll(trainer):
            if isinstance(outcome, str):
                rank_zero_warn(f"CBS probe at {pending.tokens:,} tokens failed: {outcome}{after_failure}")
                self.failures.append({"tokens": pending.tokens, "step": pending.step, "reason": outcome})
            else:
                self._collect(trainer, pending, outcome)
            side.close(trainer, pending)

    def _collect(self, trainer: pl.Trainer, pending: PendingProbe, outcome: dict[str, Any]) -> None:
        """Decide the reading of a side-job probe from its job's scores, as an in-process probe decides its own."""
        accounting = self._accounting
        main_score, window_end_step = pending.main_score, pending.window_end_step
        assert main_score is not None and window_end_step is not None, "SideJobRuns.poll waits for the window's end"
        scores = {float(k): score_from_json(score) for k, score in outcome["scores"].items()}
        self.tokens_spent += outcome["tokens_trained"]
        reading = self.config.decide(
            scores,
            pending.multipliers,
            pending.batch_size,
            tokens=pending.tokens,
            step=pending.step,
            seq_len=pending.seq_len,
            window_tokens=pending.window_tokens,
            main_loss=score_from_json(main_score).loss,
            branches_trained=outcome["trained"],
            failed=outcome["failed"],
            tokens_spent=outcome["tokens_trained"],
            overhead=self.tokens_spent / max(1, accounting.tokens_seen),
            planned_window_tokens=pending.window_tokens,
            interrupted_at_tokens=pending.interrupted_at_tokens,
            replicates=self.config.replicates,
            mode="side_jobs",
            arrived_at_tokens=accounting.tokens_seen,
        )
        rank_zero_info(
            f"CBS probe at {pending.tokens:,} tokens: the side job's reading arrived at step {trainer.global_step} "
            f"({trainer.global_step - window_end_step} steps, "
            f"{accounting.tokens_seen - pending.tokens - pending.window_tokens:,} tokens "
            "after the main run's window ended)"
        )
        self._record(trainer, reading, log_step=pending.window_end_row)
        self._draw(trainer)

    def _wait_for_side_jobs(self, trainer: pl.Trainer) -> None:
        """Training is over: wait (up to ``side_jobs.wait_at_end`` minutes) for the readings still out."""
        side, settings = self._side, self.config.side_jobs
        assert side is not None and settings is not None, "called only with side jobs"
        limit = settings.wait_at_end * 60
        waiting = sorted(pending.tokens for pending in side.pending.values())
        rank_zero_info(
            f"CBS probes at {', '.join(f'{tokens:,}' for tokens in waiting)} tokens: waiting up to "
            f"{settings.wait_at_end:g} min for their side jobs"
        )
        started = time.monotonic()
        while side.pending and time.monotonic() - started < limit:
            self._take_finished(trainer, side)
            if side.pending:
                time.sleep(2.0)
        if side.pending:
            left = ", ".join(f"{p.tokens:,}" for p in side.pending.values())
            rank_zero_warn(
                f"CBS probes at {left} tokens: their side jobs did not finish within side_jobs.wait_at_end; "
                "they stay in last.ckpt: a run resumed from it collects them"
            )

    # ------------------------------------------------------------------ reporting
    def _report(self, trainer: pl.Trainer, reading: ProbeReading, log_step: int | None = None) -> None:
        logged = {
            metrics.CBS_LOWER: float(reading.cbs_lower),
            metrics.CBS_ESTIMATE: float(reading.cbs_estimate),
            metrics.CBS_K_STAR: float(reading.k_star),
            metrics.CBS_DETERMINED: float(reading.determined),
            metrics.PROBE_OVERHEAD: float(reading.overhead),
            metrics.PROBE_TOKENS_SPENT: float(self.tokens_spent),
        }
        if reading.cbs_upper is not None:
            logged[metrics.CBS_UPPER] = float(reading.cbs_upper)
        base = min(reading.losses, key=float)
        base_loss = reading.losses[base]
        for k, loss in reading.losses.items():  # each branch's loss gap to the smallest k, and its standard error
            if k != base and loss is not None and base_loss is not None:
                logged[metrics.cbs_gap(k)] = float(loss - base_loss)
                gap_se = reading.loss_se.get(k)
                if gap_se is not None:
                    logged[metrics.cbs_gap_se(k)] = float(gap_se)
        log_to_loggers(trainer, lambda _: logged, every_step=True, step=log_step)  # the step that ended the window

        def between_windows(k: str) -> str:
            return (
                f"; from the spread between data windows alone {reading.replicate_se[k]:.4f}"
                if k in reading.replicate_se
                else ""
            )

        losses = ", ".join(
            f"k={k}: "
            + (
                f"{v:.4f}"
                + (
                    f" (SE of the difference from k={base}: {reading.loss_se[k]:.4f}{between_windows(k)})"
                    if reading.loss_se.get(k) is not None
                    else ""
                )
                if v is not None
                else "failed"
            )
            for k, v in reading.losses.items()
        )
        rank_zero_info(
            f"CBS probe at {reading.tokens:,} tokens (batch {reading.batch_size}): k*={reading.k_star:g}, "
            f"CBS in {reading.bracket} samples at {reading.confidence * 100:g}% confidence; {losses}; "
            f"{reading.tokens_spent:,} branch tokens"
            + (f" over {reading.replicates} data windows" if reading.replicates > 1 else "")
            + f"; probe overhead {reading.overhead:.2f}"
        )
        if trainer.is_global_zero and self._resolved_output_dir is not None:
            self._write_history()

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """The probe's state in a checkpoint: readings, failures, probes started, branch tokens, and the side
        jobs still out. A window in progress is recorded as interrupted (a resumed run probes there again).

        Returns:
            A JSON-able dict, read back by ``load_state_dict``.

        Examples:
            >>> CBSProbeCallback(every_tokens=10**6).state_dict()  # doctest: +NORMALIZE_WHITESPACE
            {'history': [], 'tokens_spent': 0, 'probes_started': 0, 'interrupted': None, 'failures': [],
             'unusable': False, 'side_jobs': []}
        """
        # A window in progress cannot be finished after a resume (its start snapshot lives only in
        # memory), so a checkpoint taken inside one asks the resumed run to probe again at once: at the
        # same step if the checkpoint is the window's start (FinalStateCheckpoint writes one there).
        open_window = (self._window.tokens, self._window.step) if self._window is not None else self._interrupted
        return {
            "history": [dataclasses.asdict(reading) for reading in self.history],
            "tokens_spent": self.tokens_spent,
            "probes_started": self.probes_started - (open_window is not None),
            "interrupted": list(open_window) if open_window is not None else None,
            "failures": copy.deepcopy(self.failures),
            "unusable": self._unusable,
            "side_jobs": self._side.state_dict() if self._side is not None else [],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take up the state ``state_dict`` made (any lit_cbs version's, ``lit_cbs.legacy.probe_state``); the side
        jobs it lists are collected if this probe has ``side_jobs``, else dropped with a warning.

        Args:
            state_dict: what ``state_dict`` returned, from a checkpoint.

        Examples:
            >>> state = CBSProbeCallback(every_tokens=10**6).state_dict()
            >>> state["tokens_spent"], state["probes_started"] = 524_288, 2
            >>> probe = CBSProbeCallback(every_tokens=10**6)
            >>> probe.load_state_dict(state)
            >>> probe.tokens_spent, probe.probes_started
            (524288, 2)
        """
        state_dict = legacy.probe_state(state_dict)
        # The first readings carry no seq_len; the first batch tells it (_check_batch).
        self.history = [ProbeReading.from_record(copy.deepcopy(reading)) for reading in state_dict["history"]]
        self.tokens_spent = state_dict["tokens_spent"]
        self.probes_started = state_dict["probes_started"]
        interrupted = state_dict["interrupted"]
        self._interrupted = tuple(interrupted) if interrupted is not None else None
        self.failures = copy.deepcopy(state_dict["failures"])
        self._unusable = state_dict["unusable"]
        pending = state_dict["side_jobs"]
        if self._side is not None:
            self._side.load_state_dict(pending)  # collected, or started again, at the next step
        elif pending:
            rank_zero_warn(
                f"the checkpoint has {len(pending)} CBS probe(s) whose side jobs had not reported; this run has no "
                "side_jobs, so their readings are dropped (give CBSProbeCallback the same side_jobs to collect them)"
            )
