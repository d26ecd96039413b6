"""``CBSProbeCallback``: the probe engine in a Lightning Trainer, its readings logged and written to cbs_probe.jsonl."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, cast

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_cbs import metrics
from lit_cbs._internals import logging_step, should_accumulate
from lit_cbs.callbacks.accounting import BatchAccounting, micro_batch_loss, resizable_train_loader, trainer_callbacks
from lit_cbs.callbacks.checkpoint import stop_signal
from lit_cbs.callbacks.logs import log_figures, log_to_loggers
from lit_cbs.callbacks.warmup import BatchWarmup
from lit_cbs.errors import LitCBSConfigError, require_automatic_optimization
from lit_cbs.probe.branch import BranchTrainer, ProbeAborted, ProbeUnusable, known
from lit_cbs.probe.engine import ProbeConfig, ProbeEngine, ProbePoint
from lit_cbs.probe.in_process import InProcessRunner
from lit_cbs.probe.plan import ProbeRun, ProbeSkip, RunEnd
from lit_cbs.probe.reading import BranchScore, ProbeReading
from lit_cbs.probe.side_jobs import SideJobRunner, TrainerHost
from lit_cbs.rules.batch_schedules import CBSAdaptive

__all__ = ["CBSProbeCallback"]

JSONL_FILE = "cbs_probe.jsonl"
PLOT_FILE = "cbs_curve.png"


class CBSProbeCallback(Callback):
    """Measure the critical batch size at probe points by branched mini-fits from in-memory copies (or side jobs).

    It reads the global batch B, the micro-batch and the tokens from the Trainer's ``BatchAccounting`` (attached
    if absent); beside a ``BatchWarmup`` whose schedule is ``CBSAdaptive`` its determined readings grow the batch.
    Tokens are global (all ranks); the batches must hold token ids, or ``seq_len`` be given to ``BatchAccounting``.
    Every setting is checked when the callback is made (docs/guides/probe.md has the protocol).

    Keyword Args:
        every_tokens: probe every this many tokens; or ``at_tokens``, at these; or ``geometric=(first_tokens,
            ratio)``, at first, first x ratio, ... tokens. One of the three.
        multipliers: the grid of k (batch k x B per branch), 1 among them.
        window_tokens: tokens every branch trains on (rounded down to whole steps of the largest branch).
        epsilon: the k* rule's tolerance (nats), in [0, 0.5).
        confidence: one-sided, in [0.5, 1), at which a reading is determined (0.5: the mean losses decide).
        ema_alpha: weight of the newest step loss in the EMA of ``evaluate="train_ema"``.
        lr_rule: LR factor for batch ratio k ("sqrt", "linear", ...); ``weight_decay_rule``, ``beta2_rule`` and
            ``beta2_floor`` as in ``BatchWarmup``, whose they must be beside a BatchWarmup whose batch changes.
        search: "grid" (every k) or "bisect" (the main run as k = 1, bisection over the rest).
        evaluate: "train_ema" (the paper's) or "heldout": the loss on the first ``heldout_batches`` validation
            micro-batches (per rank), the same for every branch (the module's ``probe_loss(batch)`` if it has one).
        cooldown_fraction: share in [0, 1) of each branch's last steps over which its LR decays towards 0.
        early_stop: fractions of the window (e.g. ``(0.25, 0.5)``) where a determined reading ends it early.
        replicates: disjoint data windows each k trains on (2 or more: ``evaluate="heldout"``).
        max_overhead: skip a probe that would bring branch tokens above this fraction of the training tokens.
        snapshot_device: where snapshots and recorded batches live.
        side_jobs: ``SideJobs``: the branches train as side jobs while the main run trains on (None: in process).
        output_dir: folder of ``cbs_probe.jsonl`` and ``cbs_curve.png`` (None: the logger's log_dir).

    Examples:
        >>> probe = CBSProbeCallback(every_tokens=1_000_000, window_tokens=262_144, multipliers=[1, 2, 4])
        >>> probe.history, probe.tokens_spent, probe.status()
        ([], 0, {'read': 0, 'determined': 0, 'failed': [], 'pending': []})
        >>> CBSProbeCallback(multipliers=[2, 4], every_tokens=1_000_000)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        lit_cbs.errors.LitCBSConfigError: multipliers=[2, 4] has no k = 1: ...

        ``Trainer(callbacks=[probe])`` then probes at 1M, 2M, ... tokens and writes ``cbs_probe.jsonl``.
    """

    feeds_cbs_adaptive = True  # BatchWarmup lets a CBSAdaptive schedule start only beside a callback that feeds it

    def __init__(self, **settings: Any) -> None:
        self.config = ProbeConfig(**settings)
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
        self.history = self.engine.history  # one ProbeReading per finished probe
        self.failures = self.engine.failures  # probes that gave no reading: tokens, step, reason
        self.probes_started = 0
        self._run: ProbeRun | None = None  # from setup
        self._unusable = False  # a probe found the run cannot be probed: no later one runs
        self._heldout: list[Any] | None = None
        self._scorer: BranchTrainer | None = None  # scores the main run's window, at its batch
        self._micro_losses: list[float] = []  # of the optimizer step in progress, while a window is recorded
        self._interrupted: tuple[int, int] | None = None  # (tokens, step) where a stopped probe's window began
        self._resumed = False
        self._deferred = False  # a due probe whose window the run's end would cut: left to a resumed run
        self._waiting_in_epoch: int | None = None  # the epoch whose uneven end a due probe waits out
        self._batch_checked = False
        self._output_dir: Path | None = None

    @property
    def tokens_spent(self) -> int:
        return self.engine.tokens_spent

    def status(self) -> dict[str, Any]:
        """How the probe points fared, whether a ``CBSAdaptive`` acted, what side jobs cost the main run."""
        status = self.engine.status()
        if self._side is not None:
            status["side_jobs"] = dict(self._side.waits)  # what the main run waited for its side jobs
        return status

    @property
    def _set_up(self) -> ProbeRun:
        if self._run is None:
            raise RuntimeError("CBSProbeCallback has no BatchAccounting: it was not set up for a fit (Trainer.fit)")
        return self._run

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Attach the ``BatchAccounting``; refuse manual optimization, other rules, unusable side jobs."""
        if stage != "fit":
            return
        require_automatic_optimization(pl_module, "CBSProbeCallback", "it trains branches through it")
        accounting = BatchAccounting.attach(trainer)
        warmup = next((c for c in trainer_callbacks(trainer) if isinstance(c, BatchWarmup)), None)
        self._run = ProbeRun(self.config, accounting, warmup)
        rules = self.config.rules  # beside a BatchWarmup whose batch changes, branch k x B is the run grown k-fold
        if warmup is not None and not warmup.schedule.is_constant and warmup.rules.names() != rules.names():
            raise LitCBSConfigError(
                f"CBSProbeCallback({rules.describe()}) and BatchWarmup({warmup.rules.describe()}) move the optimizer "
                "differently at a batch change, so a branch at k x B would not train as the run does after growing "
                "its batch k-fold: give both the same lr_rule, weight_decay_rule, beta2_rule and beta2_floor"
            )
        if self._side is not None:
            self._side.check(trainer, warmup)
        if self._in_process is not None:
            self._in_process.attach(trainer, accounting, self._branch_trainer)
        schedule = warmup.schedule if warmup is not None else None
        self.engine.schedule = schedule if isinstance(schedule, CBSAdaptive) else None
        if self.engine.schedule is not None:
            unit = self.engine.schedule.unit
            self.engine.consumed = lambda: accounting.tokens_seen if unit == "tokens" else accounting.samples_seen
        self.engine.tokens_seen = lambda: accounting.tokens_seen

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Before any data is read: refuse an optimizer or scheduler the rules cannot move at some k."""
        self._set_up.check_rules_apply(trainer)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Refuse a point past ``max_tokens``, load held-out batches, start a probe left due."""
        run = self._set_up
        self._resumed, self._deferred = trainer.global_step > 0, False
        max_tokens = run.accounting.max_tokens
        if max_tokens is not None and not self._resumed:  # before any data is read; max_steps, max_epochs later
            run.check_first_point(
                RunEnd(max_tokens, max_tokens, f"max_tokens={max_tokens}"), self.probes_started, False
            )
        self._heldout = run.heldout(trainer)
        self._batch_checked = False
        self._output_dir = output_folder(trainer, self.config)
        if self._output_dir is not None and trainer.is_global_zero:
            self._write_history()
        if self._side is not None:
            assert self._output_dir is not None, "refused above"
            if resizable_train_loader(trainer) is None:
                raise LitCBSConfigError(
                    "CBSProbeCallback(side_jobs=...) hands each probe's window to a job as a data position, which "
                    "only a lit_cbs.GlobalOrderLoader train loader keeps: give the datamodule one, or drop side_jobs "
                    "(in-process probing records the window as the run trains it)"
                )
            self._side.attach(TrainerHost(trainer, self._side.settings), self._output_dir)
        due = run.accounting.tokens_seen >= self.config.probe_point(self.probes_started)
        if self._resumed and due and not run.accounting.budget_reached:
            # Resumed where a probe was due (or inside a stopped one): it starts here, as it did after this step.
            self._start_probe(trainer, trainer.fit_loop.epoch_loop.batch_progress.current.ready - 1)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._batch_checked:
            self._batch_checked = True
            self._set_up.check_first_batch(trainer, pl_module, batch_idx, self.probes_started, self._resumed)
        if self._in_process is not None:
            self._in_process.record_batch(batch)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
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
        accounting = self._set_up.accounting
        try:
            self.engine.main_step(
                step_loss,
                accounting.samples_seen,
                known(accounting.global_batch, "BatchAccounting.global_batch"),
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

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._in_process is not None:
            for point in self.engine.recording():
                if stop_signal(trainer) is None:
                    rank_zero_warn(f"CBS probe at {point.tokens:,} tokens dropped: training ended inside its window")
                else:  # stopped by a signal: a resumed run redoes it (FinalStateCheckpoint keeps its start)
                    self._interrupted = (point.tokens, point.step)
                self.engine.drop(point)
        if self._side is not None:
            if self._side.pending and stop_signal(trainer) is None:
                self._side.wait_at_end(self.engine.poll)
            self._side.detach()
        why_not = self.engine.why_not_adapted()
        if why_not is not None and stop_signal(trainer) is None:
            rank_zero_warn(f"CBSAdaptive never grew the batch: {why_not}")
        self._draw(trainer)

    def _branch_trainer(self, batch_size: int) -> BranchTrainer:
        trainer, run = self._set_up.accounting.trainer, self._set_up
        assert trainer is not None, "set up for the fit"
        return run.branch_trainer(trainer, trainer.lightning_module, batch_size, self._heldout)

    def _score_main(self, point: ProbePoint) -> BranchScore:
        scorer = self._scorer
        trainer = self._set_up.accounting.trainer
        if scorer is None or scorer.trainer is not trainer or scorer.pl_module is not trainer.lightning_module:
            self._scorer = scorer = self._branch_trainer(point.batch_size)
        with self._set_up.accounting.branching():  # probe work: not the main run's time
            return scorer.score(point.main_step_losses)

    def _start_probe(self, trainer: pl.Trainer, batch_idx: int) -> None:
        run, accounting = self._set_up, self._set_up.accounting
        tokens = accounting.tokens_seen
        interrupted, self._interrupted = self._interrupted, None
        if interrupted is not None and interrupted != (tokens, trainer.global_step):
            rank_zero_warn(
                f"CBS probe whose window began at {interrupted[0]:,} tokens (step {interrupted[1]}) was stopped and is "
                f"redone at {tokens:,} tokens (step {trainer.global_step}), where this run resumed: its reading says "
                "so (interrupted_at_tokens). Resuming from the checkpoint of the probe's start redoes it where it began"
            )
        index = self.probes_started
        self.probes_started += 1
        while self.config.probe_point(self.probes_started) <= tokens:
            self.probes_started += 1  # points passed inside one step (or during an earlier window)
        if self._unusable:
            return  # a probe found this run cannot be probed: no later one would fare better
        batch_size = run.global_batch()
        out, final = self.engine.adaptive_asks(batch_size)
        if out is not None:
            rank_zero_info(
                f"CBS probe at {tokens:,} tokens skipped: the reading at {out:,} tokens, at this batch "
                f"({batch_size}), is still out"
            )
            return
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
        folder = self._side.folder_for(index, tokens) if self._side is not None else ""
        point = run.point(index, plan, trainer.global_step, interrupted, folder)
        with accounting.branching():  # the copy, or the side job's checkpoint, is probe work
            self.engine.open(point)

    def _said_failure(self, failure: dict[str, Any]) -> None:
        rank_zero_warn(f"CBS probe at {failure['tokens']:,} tokens failed: {failure['reason']}")

    def _said_reading(self, reading: ProbeReading, point: ProbePoint) -> None:
        """A reading is recorded: said, logged (on the row of the step that ended its window), written, drawn."""
        trainer = self._set_up.accounting.trainer
        assert trainer is not None, "set up for the fit"
        late = self.engine.runner.late
        log_reading(trainer, reading, self.tokens_spent, point if late else None, self._set_up.accounting.tokens_seen)
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
        """cbs_probe.jsonl holds exactly ``history`` (none: no file), at the fit's start and after each reading."""
        assert self._output_dir is not None, "written only where there is an output folder"
        path = self._output_dir / JSONL_FILE
        if not self.history:
            path.unlink(missing_ok=True)
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(reading.to_record()) + "\n" for reading in self.history))

    def _draw(self, trainer: pl.Trainer) -> None:
        if trainer.is_global_zero and self.history and self._output_dir is not None:
            warmup = self._run.warmup if self._run is not None else None
            changes = warmup.history if warmup is not None else []
            from lit_cbs.probe.plot import plot_cbs_curve  # matplotlib only where a curve is drawn

            tokens = self._set_up.accounting.tokens_seen
            path = plot_cbs_curve(self.history, changes, self._output_dir / PLOT_FILE, tokens, self.config.epsilon)
            log_figures(trainer.loggers, [path], trainer.global_step)

    def state_dict(self) -> dict[str, Any]:
        """Readings, failures, points started, side jobs out; an in-process window open is interrupted."""
        open_points = self.engine.recording() if self._in_process is not None else []
        open_window = (open_points[0].tokens, open_points[0].step) if open_points else self._interrupted
        return {
            "history": [reading.to_record() for reading in self.history],
            "tokens_spent": self.tokens_spent,
            "probes_started": self.probes_started - bool(open_points),
            "interrupted": list(open_window) if open_window is not None else None,
            "failures": [dict(failure) for failure in self.failures],
            "unusable": self._unusable,
            "side_jobs": self._side.state_dict() if self._side is not None else [],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take up ``state_dict``; the side jobs it lists are collected with ``side_jobs``, else dropped (a warning)."""
        self.history[:] = [ProbeReading.from_record(copy.deepcopy(reading)) for reading in state_dict["history"]]
        self.probes_started = state_dict["probes_started"]
        interrupted = state_dict["interrupted"]
        self._interrupted = tuple(interrupted) if interrupted is not None else None
        self.failures[:] = [dict(failure) for failure in state_dict["failures"]]
        self._unusable = state_dict["unusable"]
        pending = state_dict["side_jobs"]
        if self._side is not None:  # collected, or started again, from the next step
            self.engine.points = {point.index: point for point in self._side.load_state_dict(pending)}
        elif pending:
            rank_zero_warn(
                f"the checkpoint has {len(pending)} CBS probe(s) whose side jobs had not reported; this run has no "
                "side_jobs, so their readings are dropped (give CBSProbeCallback the same side_jobs to collect them)"
            )


def log_reading(
    trainer: pl.Trainer, reading: ProbeReading, tokens_spent: int, late: ProbePoint | None, tokens_seen: int
) -> None:
    """Log ``reading``'s metrics and say it; a ``late`` one on the row of the step that ended its window."""
    if late is not None:
        assert late.window_end_step is not None, "a late reading comes after its window ended"
        rank_zero_info(
            f"CBS probe at {late.tokens:,} tokens: the side job's reading arrived at step {trainer.global_step} "
            f"({trainer.global_step - late.window_end_step} steps, "
            f"{tokens_seen - late.tokens - late.window_tokens:,} tokens after the main run's window ended)"
        )
    logged = {
        metrics.CBS_LOWER: float(reading.cbs_lower),
        metrics.CBS_ESTIMATE: float(reading.cbs_estimate),
        metrics.CBS_K_STAR: float(reading.k_star),
        metrics.CBS_DETERMINED: float(reading.determined),
        metrics.PROBE_OVERHEAD: float(reading.overhead),
        metrics.PROBE_TOKENS_SPENT: float(tokens_spent),
    }
    if reading.cbs_upper is not None:
        logged[metrics.CBS_UPPER] = float(reading.cbs_upper)
    base = min(reading.losses, key=float)
    base_loss, said = reading.losses[base], []
    for k, loss in reading.losses.items():  # each branch's loss gap to the smallest k, and its standard error
        se, windows = reading.loss_se.get(k), reading.replicate_se.get(k)
        if k != base and loss is not None and base_loss is not None:
            logged[metrics.cbs_gap(k)] = float(loss - base_loss)
            if se is not None:
                logged[metrics.cbs_gap_se(k)] = float(se)
        spread = f"; from the spread between data windows alone {windows:.4f}" if windows is not None else ""
        gap = f" (SE of the difference from k={base}: {se:.4f}{spread})" if se is not None else ""
        said.append(f"k={k}: " + (f"{loss:.4f}{gap}" if loss is not None else "failed"))
    log_to_loggers(trainer, lambda _: logged, every_step=True, step=late.window_end_row if late is not None else None)
    rank_zero_info(
        f"CBS probe at {reading.tokens:,} tokens (batch {reading.batch_size}): k*={reading.k_star:g}, "
        f"CBS in {reading.bracket} samples at {reading.confidence * 100:g}% confidence; {', '.join(said)}; "
        f"{reading.tokens_spent:,} branch tokens"
        + (f" over {reading.replicates} data windows" if reading.replicates > 1 else "")
        + f"; probe overhead {reading.overhead:.2f}"
    )


def output_folder(trainer: pl.Trainer, config: ProbeConfig) -> Path | None:
    """Where ``cbs_probe.jsonl`` goes: ``output_dir``, else the logger's log_dir (None: readings kept in memory)."""
    log_dir = trainer.log_dir if trainer.loggers else None  # broadcast from rank 0: asked on every rank, once
    folder = cast("Path | None", config.output_dir) or (Path(log_dir) if log_dir else None)
    if folder is None and config.side_jobs is not None:
        raise LitCBSConfigError(
            "CBSProbeCallback(side_jobs=...) keeps each probe's checkpoint and its jobs' files beside "
            "cbs_probe.jsonl, but the run has no logger and no output_dir: give output_dir=..."
        )
    if folder is None:
        rank_zero_info("CBSProbeCallback: no logger and no output_dir; readings are kept in .history only")
    return folder
