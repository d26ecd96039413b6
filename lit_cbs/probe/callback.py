"""``CBSProbeCallback``: the probe engine (``engine.py``) in a Lightning Trainer. The hooks hand the engine the main
run's steps and counts (``BatchAccounting``); the runner trains the branches in process or as side jobs."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any, cast

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_cbs._internals import logging_step, should_accumulate
from lit_cbs.callbacks.accounting import BatchAccounting, micro_batch_loss, resizable_train_loader
from lit_cbs.callbacks.checkpoint import stop_signal
from lit_cbs.callbacks.warmup import BatchWarmup
from lit_cbs.errors import LitCBSConfigError, require_automatic_optimization
from lit_cbs.probe.branch import BranchTrainer, ProbeAborted, ProbeUnusable
from lit_cbs.probe.config import ProbeConfig
from lit_cbs.probe.engine import ProbeEngine, ProbePoint
from lit_cbs.probe.heldout import load_heldout_batches
from lit_cbs.probe.in_process import InProcessRunner
from lit_cbs.probe.limits import RunEnd
from lit_cbs.probe.placement import ProbeRun
from lit_cbs.probe.reading import BranchScore, ProbeReading
from lit_cbs.probe.record import draw, log_reading, write_history
from lit_cbs.probe.side_jobs import SideJobRunner
from lit_cbs.probe.start import ProbeSkip
from lit_cbs.rules.batch_schedules import CBSAdaptive

__all__ = ["CBSProbeCallback"]


class CBSProbeCallback(Callback):
    """Measure the critical batch size at intervals by branched mini-fits from in-memory copies (or side jobs).

    Reads the global batch B, the micro-batch and the token count from the Trainer's ``BatchAccounting`` (attached
    if absent), so it needs no other callback; beside a ``BatchWarmup`` whose schedule is ``CBSAdaptive``, its
    determined readings grow the batch. Probe points and windows are in tokens: the batches must hold token ids,
    or ``seq_len`` be given (to ``BatchAccounting`` or ``BatchWarmup``).

    Args:
        config: the probe's settings (``ProbeConfig``), checked when it is made.
        **settings: ``ProbeConfig``'s fields as keywords instead (as Hydra's ``_target_`` passes them); not both.

    Attributes:
        history: one ``ProbeReading`` per finished probe.
        failures: probes that gave no reading: tokens, step and reason; the main run goes on.
        tokens_spent: tokens trained in branches so far (all ranks).

    Examples:
        >>> probe = CBSProbeCallback(every_tokens=1_000_000, window_tokens=262_144)
        >>> probe.config.multipliers, probe.history, probe.tokens_spent
        ([1.0, 2.0, 4.0, 8.0], [], 0)
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
        side = self.config.side_jobs
        self._side = SideJobRunner(side, self.config) if side is not None else None
        self._in_process = InProcessRunner(self.config) if side is None else None
        runner = self._side if self._side is not None else self._in_process
        assert runner is not None, "one of the two"
        self.engine = ProbeEngine(self.config, runner, self._said_reading, self._said_failure)
        self.probes_started = 0
        self._run: ProbeRun | None = None  # the run as the probe plans in it, from setup
        self._unusable = False  # a probe found the run cannot be probed: no later one runs
        self._heldout: list | None = None
        self._scorer: BranchTrainer | None = None  # scores the main run's window, at its batch
        self._micro_losses: list[float] = []  # of the optimizer step in progress, while a window is recorded
        self._interrupted: tuple[int, int] | None = None  # (tokens, step) where a stopped probe's window began
        self._resumed = False
        self._deferred = False  # a due probe whose window the run's end would cut: left to a resumed run
        self._waiting_in_epoch: int | None = None  # the epoch whose uneven end a due probe waits out
        self._batch_checked = False
        self._output_dir: Path | None = None

    @property
    def history(self) -> list[ProbeReading]:
        return self.engine.history

    @property
    def failures(self) -> list[dict[str, Any]]:
        return self.engine.failures

    @property
    def tokens_spent(self) -> int:
        return self.engine.tokens_spent

    def status(self) -> dict[str, Any]:
        """How the probe points fared and, beside ``CBSAdaptive``, whether it acted (``ProbeEngine.status``); with side
        jobs, what the main run waited for them.

        Examples:
            >>> CBSProbeCallback(every_tokens=10**6).status()
            {'read': 0, 'determined': 0, 'failed': [], 'pending': []}
        """
        status = self.engine.status()
        if self._side is not None:
            status["side_jobs"] = dict(self._side.waits)  # what the main run waited for its side jobs
        return status

    @property
    def _accounting(self) -> BatchAccounting:
        if self._run is None:
            raise RuntimeError("CBSProbeCallback has no BatchAccounting: it was not set up for a fit (Trainer.fit)")
        return self._run.accounting

    # ------------------------------------------------------------------ checks before training
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """For a fit: attach the Trainer's ``BatchAccounting``, find its ``BatchWarmup`` and choose the runner.

        Raises:
            LitCBSConfigError: manual optimization, a ``BatchWarmup`` whose batch changes and whose optimizer rules
                differ from the probe's, a side-job launcher that cannot start a job, or a side-job build that fails.
        """
        if stage != "fit":
            return
        require_automatic_optimization(pl_module, "CBSProbeCallback", "it trains branches through it")
        accounting = BatchAccounting.attach(trainer)
        callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector, undeclared
        warmup = next((callback for callback in callbacks if isinstance(callback, BatchWarmup)), None)
        self._run = ProbeRun(self.config, accounting, warmup)
        self._run.check_rules_match()
        if self._side is not None:
            self._side.check(trainer, warmup)
        if self._in_process is not None:
            self._in_process.attach(trainer, pl_module, accounting, self._branch_trainer)
        schedule = warmup.schedule if warmup is not None else None
        self.engine.schedule = schedule if isinstance(schedule, CBSAdaptive) else None
        self.engine.consumed = self._consumed
        self.engine.tokens_seen = self._tokens_seen

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Before any data is read: every multiplier's LR rule must apply to the optimizer and its schedulers.

        Raises:
            LitCBSConfigError: the optimizer or a scheduler cannot be moved by the probe's rules at some k.
        """
        assert self._run is not None, "set up for the fit"
        self._run.check_rules_apply(trainer)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Resolve the output folder, load the held-out batches, refuse a first probe point past ``max_tokens``,
        and start the probe a resumed run left due.

        Raises:
            LitCBSConfigError: the first probe point lies past ``max_tokens``, no validation data for
                ``evaluate="heldout"``, or side jobs without an output folder or a ``GlobalOrderLoader``.
        """
        run = self._run
        assert run is not None, "set up for the fit"
        self._resumed, self._deferred = trainer.global_step > 0, False
        max_tokens = run.accounting.max_tokens
        if max_tokens is not None and not self._resumed:  # before any data is read; max_steps, max_epochs later
            run.check_first_point(
                RunEnd(max_tokens, max_tokens, f"max_tokens={max_tokens}"), self.probes_started, False
            )
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
        self._output_dir = output_dir or (Path(log_dir) if log_dir else None)
        if self._output_dir is None and self._side is not None:
            raise LitCBSConfigError(
                "CBSProbeCallback(side_jobs=...) keeps each probe's checkpoint and its jobs' files beside "
                "cbs_probe.jsonl, but the run has no logger and no output_dir: give output_dir=..."
            )
        if self._output_dir is None:
            rank_zero_info("CBSProbeCallback: no logger and no output_dir; readings are kept in .history only")
        elif trainer.is_global_zero:
            self._write_history()
        if self._side is not None:
            assert self._output_dir is not None, "refused above"
            self._side.attach(trainer, self._output_dir)
        if (
            self._resumed
            and not run.accounting.budget_reached
            and run.accounting.tokens_seen >= self.config.probe_point(self.probes_started)
        ):
            # Resumed where a probe was due, or inside one that was stopped: it starts here, before the first batch,
            # as the uninterrupted run started it right after this step.
            self._start_probe(trainer, trainer.fit_loop.epoch_loop.batch_progress.current.ready - 1)

    # ------------------------------------------------------------------ main-run hooks
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self._batch_checked:
            self._batch_checked = True
            assert self._run is not None, "set up for the fit"
            self._run.check_first_batch(trainer, pl_module, batch_idx, self.probes_started, self._resumed)
            for reading in self.history:
                if reading.seq_len is None:  # resumed from a checkpoint of the first readings, which lack it
                    reading.seq_len = self._run.seq_len()
        if self._in_process is not None:
            self._in_process.record_batch(batch)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        recording = self.engine.recording()
        if recording:
            loss = micro_batch_loss(trainer, outputs)
            if loss is None:
                raise TypeError("CBSProbeCallback needs every training_step to return its loss; one returned None")
            self._micro_losses.append(float(loss))
        if should_accumulate(trainer):
            return
        step_loss = sum(self._micro_losses) / len(self._micro_losses) if self._micro_losses else None
        self._micro_losses = []
        accounting = self._accounting
        try:
            self.engine.main_step(
                step_loss,
                accounting.samples_seen,
                self._run_batch(),
                trainer.global_step,
                logging_step(trainer),
                self._score_main,
            )
        except ProbeAborted:
            (point,) = recording
            if stop_signal(trainer) is None:  # else FinalStateCheckpoint says it with the stop, once
                rank_zero_warn(f"CBS probe at {point.tokens:,} tokens stopped by a signal; main state restored")
            self._interrupted = (point.tokens, point.step)
            self.engine.drop(point)
        except ProbeUnusable as error:
            (point,) = recording
            self._unusable = True
            self.engine.fail(
                point,
                f"{error}. The main run goes on from its own state; no later probe runs (CBSProbeCallback.failures "
                "has the reason)",
            )
        self.engine.poll()
        serial = self._in_process is not None and recording  # in process, a due point waits for the open one
        if not serial and not self._deferred and accounting.tokens_seen >= self.config.probe_point(self.probes_started):
            self._start_probe(trainer, batch_idx)

    def on_train_end(self, trainer, pl_module) -> None:
        if self._in_process is not None:
            for point in self.engine.recording():
                if stop_signal(trainer) is None:
                    rank_zero_warn(f"CBS probe at {point.tokens:,} tokens dropped: training ended inside its window")
                else:  # stopped by a signal: a resumed run redoes it (FinalStateCheckpoint keeps its start)
                    self._interrupted = (point.tokens, point.step)
                self.engine.drop(point)
        if self._side is not None:
            if self._side.pending and stop_signal(trainer) is None:
                self._wait_for_side_jobs()
            self._side.detach()
        why_not = self.engine.why_not_adapted()
        if why_not is not None and stop_signal(trainer) is None:
            rank_zero_warn(f"CBSAdaptive never grew the batch: {why_not}")
        self._draw(trainer)

    # ------------------------------------------------------------------ a probe point
    def _run_batch(self) -> int:
        assert self._run is not None, "set up for the fit"
        return self._run.global_batch()

    def _tokens_seen(self) -> int:
        return self._accounting.tokens_seen

    def _consumed(self) -> int:
        """What the CBSAdaptive schedule counts (tokens or samples), trained on so far."""
        schedule, accounting = self.engine.schedule, self._accounting
        assert schedule is not None, "asked only with a CBSAdaptive schedule"
        return accounting.tokens_seen if schedule.unit == "tokens" else accounting.samples_seen

    def _branch_trainer(self, batch_size: int) -> BranchTrainer:
        """Trains and scores branches at the main batch ``batch_size`` (and scores the main run's own window)."""
        trainer, run = self._accounting.trainer, self._run
        assert trainer is not None and run is not None, "set up for the fit"
        return run.branch_trainer(trainer, trainer.lightning_module, batch_size, self._heldout)

    def _score_main(self, point: ProbePoint) -> BranchScore:
        """The main run's score where its window (or an early look) ended, as a branch is scored there."""
        scorer = self._scorer
        trainer = self._accounting.trainer
        if scorer is None or scorer.trainer is not trainer or scorer.pl_module is not trainer.lightning_module:
            self._scorer = scorer = self._branch_trainer(point.batch_size)
        with self._accounting.branching():  # probe work: not the main run's time
            return scorer.score(point.main_step_losses)

    def _start_probe(self, trainer: pl.Trainer, batch_idx: int) -> None:
        run, accounting = self._run, self._accounting
        assert run is not None, "set up for the fit"
        tokens = accounting.tokens_seen
        interrupted, self._interrupted = self._interrupted, None
        if interrupted is not None and interrupted != (tokens, trainer.global_step):
            rank_zero_warn(
                f"CBS probe whose window began at {interrupted[0]:,} tokens (step {interrupted[1]}) was stopped and is "
                f"redone at {tokens:,} tokens (step {trainer.global_step}), where this run resumed: its reading "
                "says so (interrupted_at_tokens). "
                "Resuming from the checkpoint of the probe's start redoes it where it began"
            )
        index = self.probes_started
        self.probes_started += 1
        while self.config.probe_point(self.probes_started) <= tokens:
            self.probes_started += 1  # points passed inside one step (or during an earlier window)
        if self._unusable:
            return  # a probe found this run cannot be probed: no later one would fare better
        schedule = self.engine.schedule
        at_final = schedule is not None and not schedule.wants_readings(self._consumed())
        batch_size = run.global_batch()
        out = [point.tokens for point in self.engine.points.values() if point.batch_size == batch_size]
        if schedule is not None and not at_final and out:
            # CBSAdaptive asks one question of a batch at a time: a second reading at this batch could only repeat it.
            rank_zero_info(
                f"CBS probe at {tokens:,} tokens skipped: the reading at {out[0]:,} tokens, at this batch "
                f"({batch_size}), is still out"
            )
            return
        final = schedule.final if schedule is not None and at_final else None
        plan = run.plan(trainer, batch_idx, self.tokens_spent, self._side is not None, final)
        if isinstance(plan, ProbeSkip) and plan.next_epoch:
            # Said once per epoch (the epoch is the loader's to tell): the point is asked again after every step.
            loader = resizable_train_loader(trainer)
            assert loader is not None, "only an uneven loader's epoch end makes a probe wait for the next epoch"
            if self._waiting_in_epoch != loader.epoch:
                self._waiting_in_epoch = loader.epoch
                rank_zero_info(f"CBS probe at {tokens:,} tokens waits for the next epoch: {plan.reason}")
            self.probes_started = index
            return
        if isinstance(plan, ProbeSkip):
            if plan.stays_due:  # a run resumed from this one's last checkpoint takes it at its start
                self.probes_started, self._deferred = index, True
            message = f"CBS probe at {tokens:,} tokens {'not started' if plan.stays_due else 'skipped'}: {plan.reason}"
            rank_zero_warn(message) if plan.warn else rank_zero_info(message)
            return
        samples, world = accounting.samples_seen, accounting.data_parallel_size
        point = ProbePoint(
            index=index,
            tokens=tokens,
            step=trainer.global_step,
            batch_size=batch_size,
            seq_len=run.seq_len(),
            multipliers=plan.multipliers,
            window_samples=plan.window_samples,
            folder=self._side.folder_for(index, tokens) if self._side is not None else "",
            main_baseline=self.config.search == "bisect" and not self.config.cooldown_fraction,
            window_end_samples=samples + plan.window_samples,
            interrupted_at_tokens=interrupted[0] if interrupted is not None and interrupted[0] != tokens else None,
            replicates=self.config.replicates,
            main_end_samples=None if self._side is not None else samples + plan.window_samples * self.config.replicates,
            looks=[samples + look * world for look in plan.early_stop_samples],
        )
        with accounting.branching():  # the copy, or the side job's checkpoint, is probe work
            self.engine.open(point)
        if self._side is not None:
            rank_zero_info(
                f"CBS probe at {tokens:,} tokens (batch {batch_size}): multipliers "
                f"[{', '.join(f'{k:g}' for k in point.multipliers)}] handed to a side job ({point.folder}); "
                "the main run trains on as k = 1"
            )

    def _wait_for_side_jobs(self) -> None:
        """Training is over: wait (up to ``side_jobs.wait_at_end`` minutes) for the readings still out."""
        side, settings = self._side, self.config.side_jobs
        assert side is not None and settings is not None, "called only with side jobs"
        waiting = ", ".join(f"{tokens:,}" for tokens in sorted(point.tokens for point in side.pending.values()))
        rank_zero_info(
            f"CBS probes at {waiting} tokens: waiting up to {settings.wait_at_end:g} min for their side jobs"
        )
        side.wait(self.engine.poll, settings.wait_at_end * 60)
        if side.pending:
            left = ", ".join(f"{point.tokens:,}" for point in side.pending.values())
            rank_zero_warn(
                f"CBS probes at {left} tokens: their side jobs did not finish within side_jobs.wait_at_end; "
                "they stay in last.ckpt: a run resumed from it collects them"
            )

    # ------------------------------------------------------------------ reporting
    def _said_failure(self, failure: dict[str, Any]) -> None:
        rank_zero_warn(f"CBS probe at {failure['tokens']:,} tokens failed: {failure['reason']}")

    def _said_reading(self, reading: ProbeReading, point: ProbePoint) -> None:
        """A reading is recorded: said, logged (at the step that ended the main run's window), written, drawn."""
        trainer = self._accounting.trainer
        assert trainer is not None, "set up for the fit"
        log_step = None
        if self.engine.runner.late:
            assert point.window_end_step is not None, "a late reading comes after its window ended"
            rank_zero_info(
                f"CBS probe at {point.tokens:,} tokens: the side job's reading arrived at step {trainer.global_step} "
                f"({trainer.global_step - point.window_end_step} steps, "
                f"{self._accounting.tokens_seen - point.tokens - point.window_tokens:,} tokens "
                "after the main run's window ended)"
            )
            log_step = point.window_end_row
        log_reading(trainer, reading, self.tokens_spent, log_step)
        if trainer.is_global_zero and self._output_dir is not None:
            self._write_history()
        if self.engine.schedule is not None:
            if not reading.determined:
                rank_zero_info("CBSAdaptive: the reading is undetermined at this confidence; the batch stays")
            elif reading.adaptive_batch is not None:
                rank_zero_info(
                    f"CBSAdaptive: CBS >= {reading.cbs_lower:g} samples; global batch -> {reading.adaptive_batch}"
                )
        if self.engine.runner.late:
            self._draw(trainer)

    def _write_history(self) -> None:
        """cbs_probe.jsonl holds exactly ``history`` (at the start of a fit and after each reading): a resumed run
        starts it from its checkpoint's readings, so nothing is written twice and no reading after it lingers."""
        assert self._output_dir is not None, "written only where there is an output folder"
        write_history(self._output_dir, self.history)

    def _draw(self, trainer: pl.Trainer) -> None:
        """cbs_curve.png of the readings so far (rank 0)."""
        if trainer.is_global_zero and self.history and self._output_dir is not None:
            warmup = self._run.warmup if self._run is not None else None
            changes = warmup.history if warmup is not None else []
            draw(trainer, self.history, changes, self._output_dir, self._accounting.tokens_seen, self.config.epsilon)

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """The probe's state in a checkpoint: readings, failures, probes started, branch tokens, and the side jobs
        still out. A window in progress in process is recorded as interrupted (a resumed run probes there again).

        Examples:
            >>> CBSProbeCallback(every_tokens=10**6).state_dict()  # doctest: +NORMALIZE_WHITESPACE
            {'history': [], 'tokens_spent': 0, 'probes_started': 0, 'interrupted': None, 'failures': [],
             'unusable': False, 'side_jobs': []}
        """
        # A window in progress in process cannot be finished after a resume (its start snapshot lives only in
        # memory), so a checkpoint taken inside one asks the resumed run to probe again at once: at the same step if
        # the checkpoint is the window's start (FinalStateCheckpoint writes one there).
        open_points = self.engine.recording() if self._in_process is not None else []
        open_window = (open_points[0].tokens, open_points[0].step) if open_points else self._interrupted
        return {
            "history": [dataclasses.asdict(reading) for reading in self.history],
            "tokens_spent": self.tokens_spent,
            "probes_started": self.probes_started - bool(open_points),
            "interrupted": list(open_window) if open_window is not None else None,
            "failures": [dict(failure) for failure in self.failures],
            "unusable": self._unusable,
            "side_jobs": self._side.state_dict() if self._side is not None else [],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take up the state ``state_dict`` made; the side
        jobs it lists are collected if this probe has ``side_jobs``, else dropped with a warning.

        Examples:
            >>> state = CBSProbeCallback(every_tokens=10**6).state_dict()
            >>> state["probes_started"] = 2
            >>> probe = CBSProbeCallback(every_tokens=10**6)
            >>> probe.load_state_dict(state)
            >>> probe.probes_started
            2
        """
        self.engine.history = [ProbeReading.from_record(copy.deepcopy(reading)) for reading in state_dict["history"]]
        self.probes_started = state_dict["probes_started"]
        interrupted = state_dict["interrupted"]
        self._interrupted = tuple(interrupted) if interrupted is not None else None
        self.engine.failures = [dict(failure) for failure in state_dict["failures"]]
        self._unusable = state_dict["unusable"]
        pending = state_dict["side_jobs"]
        if self._side is not None:  # collected, or started again, from the next step
            self.engine.points = {point.index: point for point in self._side.load_state_dict(pending)}
        elif pending:
            rank_zero_warn(
                f"the checkpoint has {len(pending)} CBS probe(s) whose side jobs had not reported; this run has no "
                "side_jobs, so their readings are dropped (give CBSProbeCallback the same side_jobs to collect them)"
            )
