"""Probe branches as side jobs: the main run never waits for them.

``CBSProbeCallback(side_jobs=SideJobs(...))``: at a probe point the main run writes a checkpoint (the branches'
start; with a ``GlobalOrderLoader`` it holds the data position too, so the window is the run's next
``window_tokens`` of data) and a job description, hands them to a launcher, and trains on as the k = 1 branch. A
side job (``python -m lit_cbs.probe.side_jobs JOB.json``, the program in this package's ``__main__.py``) rebuilds
the run (``SideJobs.build``), resumes it from the checkpoint on its own processes or devices, and trains the
branches there (``CheckpointProbe``); it writes each measured k's score to ``scores.json``. With
``search="bisect"`` the main run's own score over the window stands in for k = 1: the job trains the first midpoint
while the main run trains its window, then waits for the main run's score (``main_score.json``, written when its
window ends) to steer the bisection. The main run looks for results after every optimizer step; when they arrive it
decides the reading (the same rule as in process), logs it at its probe point, appends it to ``cbs_probe.jsonl`` and
feeds ``CBSAdaptive``, which changes the batch at the next step it can.

A job that fails (crashes, is preempted and not requeued, runs past its time) is started again up to
``retries`` times, then the probe is recorded as failed, with the reason. What is pending is in the checkpoint: a
resumed main run collects the results of jobs that finished meanwhile and starts again those that did not.

Launching is the engine's: ``LocalLauncher`` starts processes on this machine (their own thread count or GPUs),
``SlurmLauncher`` submits to SLURM through submitit (the engine of Hydra's SLURM launcher).

What a user gives is ``SideJobs`` (``lit_cbs.probe.launchers``); what this package holds is the main run's
machinery (``SideJobRuns``, made by ``CBSProbeCallback``) and the job files' layout, so it exports nothing. The
files of a probe point live in ``JOBS_FOLDER`` ("cbs_probe_jobs", beside cbs_probe.jsonl), one folder per probe:
``JOB_FILE`` (the job description), ``CHECKPOINT_NAME`` (the branches' start), ``SCORES_FILE`` (each measured k's
score) and ``MAIN_SCORE_FILE`` (the main run's own score over its window).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info

from lit_cbs._internals import logging_step
from lit_cbs.callbacks.accounting import resizable_train_loader
from lit_cbs.errors import LitCBSConfigError
from lit_cbs.probe.launchers import SideJobs
from lit_cbs.probe.reading import BranchScore

JOBS_FOLDER = "cbs_probe_jobs"  # beside cbs_probe.jsonl: one folder per probe point
JOB_FILE = "job.json"
SCORES_FILE = "scores.json"
MAIN_SCORE_FILE = "main_score.json"
CHECKPOINT_NAME = "start.ckpt"

__all__: list[str] = []


def write_json(path: Path, content: Any) -> None:
    """Write ``content`` as JSON to ``path`` atomically (a reader never sees half a file)."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(content, indent=1))
    os.replace(partial, path)


def score_to_json(score: BranchScore) -> dict[str, Any]:
    """``score`` as JSON-able fields (``scores.json``, ``main_score.json``, the checkpoint); a failed branch's
    loss (inf or NaN) as None, which JSON can hold.

    Examples:
        >>> score_to_json(BranchScore.heldout([2.0, 2.5]))
        {'loss': 2.25, 'batch_losses': [2.0, 2.5], 'se': None, 'replicate_losses': []}
        >>> score_to_json(BranchScore(float("nan")))["loss"] is None
        True
    """
    return {
        "loss": score.loss if math.isfinite(score.loss) else None,
        "batch_losses": list(score.batch_losses),
        "se": score.se,
        "replicate_losses": [list(window) for window in score.replicate_losses],
    }


def score_from_json(content: dict[str, Any]) -> BranchScore:
    """The score ``score_to_json`` wrote; a None loss reads back as inf (a failed branch).

    Examples:
        >>> score = BranchScore.heldout([2.0, 2.5])
        >>> score_from_json(score_to_json(score)) == score
        True
        >>> score_from_json(score_to_json(BranchScore(float("nan")))).failed
        True
    """
    loss = content["loss"]
    return BranchScore(
        math.inf if loss is None else float(loss),
        tuple(content["batch_losses"]),
        content["se"],
        tuple(tuple(window) for window in content["replicate_losses"]),
    )


@dataclass
class PendingProbe:
    """A probe whose branches run as side jobs, from its start until its reading is recorded (JSON-able: it is
    in the main run's checkpoint). Samples global, tokens global."""

    index: int  # which probe point (0-based)
    tokens: int  # tokens trained when its window began
    step: int  # optimizer steps then
    batch_size: int  # the main run's global batch B then (samples)
    seq_len: int
    multipliers: list[float]
    window_samples: int  # each replicate window
    folder: str  # the job folder: job.json, start.ckpt, scores.json, main_score.json, logs
    main_baseline: bool  # the main run's own window is k = 1's first window
    window_end_samples: int  # samples_seen where the main run's (first) window ends
    interrupted_at_tokens: int | None = None
    main_step_losses: list[float] = field(default_factory=list)  # this rank's, over the window so far
    main_score: dict[str, Any] | None = None  # the main run's score over its window, once it ended
    window_end_step: int | None = None  # the optimizer step that ended the main run's window
    window_end_row: int | None = None  # the loggers' row of that step (where the reading is logged)
    main_changed_batch: bool = False  # the batch changed inside the window: k = 1 trains as a branch
    handle: dict[str, Any] | None = None  # the launcher's, while a job runs (None: waiting its turn, or done)
    job_done: bool = False  # its job wrote its scores
    attempts: int = 0
    failures: list[str] = field(default_factory=list)  # why each failed attempt ended

    @property
    def window_tokens(self) -> int:
        return self.window_samples * self.seq_len

    @property
    def path(self) -> Path:
        return Path(self.folder)


def job_description(pending: PendingProbe, config: Any, build: str, checkpoint: Path) -> dict[str, Any]:
    """What a side job is told (``job.json``): the checkpoint, how to rebuild the run, the probe's settings and
    the window the main run planned."""
    settings = {
        name: getattr(config, name)
        for name in (
            "multipliers", "window_tokens", "epsilon", "confidence", "ema_alpha", "lr_rule", "weight_decay_rule",
            "beta2_rule", "search", "evaluate", "heldout_batches", "cooldown_fraction", "replicates", "snapshot_device",
        )
    }  # fmt: skip
    if not isinstance(settings["lr_rule"], str):
        raise LitCBSConfigError(
            f"side jobs rebuild the probe's rules by name: give lr_rule as a name ('sqrt', 'linear', ...), not "
            f"{settings['lr_rule']!r}"
        )
    return {
        "checkpoint": str(checkpoint),
        "build": build,
        "config": settings,
        "multipliers": pending.multipliers,
        "window_samples": pending.window_samples,
        "main_baseline": pending.main_baseline,
        "main_score": str(pending.path / MAIN_SCORE_FILE),
        "scores": str(pending.path / SCORES_FILE),
    }


class SideJobRuns:
    """The main run's side of side-job probes: each probe's folder, checkpoint and job, the main run's own score
    over its window, and what became of the job. Rank 0 writes the files and talks to the launcher; every rank
    learns an outcome at the same optimizer step (a broadcast), so a reading acts on every rank alike.

    Attributes:
        pending: the probes whose readings are not recorded yet, by probe index.
    """

    def __init__(self, settings: SideJobs):
        self.settings = settings
        self.pending: dict[int, PendingProbe] = {}

    def check(self, trainer: pl.Trainer) -> None:
        """Refuse, on every rank alike and before any work, a launcher that cannot start a job."""
        problem = None
        if trainer.is_global_zero:
            try:
                self.settings.launcher.check()
            except LitCBSConfigError as error:
                problem = str(error)
        problem = trainer.strategy.broadcast(problem)
        if problem is not None:
            raise LitCBSConfigError(problem)

    def check_loader(self, trainer: pl.Trainer) -> None:
        """A side job reads its window at the checkpoint's data position: only a ``GlobalOrderLoader`` has one."""
        if resizable_train_loader(trainer) is None:
            raise LitCBSConfigError(
                "CBSProbeCallback(side_jobs=...) hands each probe's window to a job as a data position, which only a "
                "lit_cbs.GlobalOrderLoader train loader keeps: give the datamodule one, or drop side_jobs (in-process "
                "probing records the window as the run trains it)"
            )

    def open(self, trainer: pl.Trainer, pending: PendingProbe, config: Any) -> None:
        """Write the probe's start checkpoint (every rank: a distributed checkpoint is written by all) and its job
        description into a fresh folder, and start its job (or queue it behind the jobs running)."""
        folder = pending.path
        if trainer.is_global_zero:
            if folder.exists():  # from a timeline this run's resume left behind
                shutil.rmtree(folder)
            folder.mkdir(parents=True)
        trainer.strategy.barrier("SideJobRuns.open")
        trainer.save_checkpoint(folder / CHECKPOINT_NAME)
        if trainer.is_global_zero:
            write_json(
                folder / JOB_FILE, job_description(pending, config, self.settings.build, folder / CHECKPOINT_NAME)
            )
        self.pending[pending.index] = pending
        if trainer.is_global_zero:
            self._start_queued()

    def _start_queued(self) -> None:
        """Start the jobs waiting their turn, oldest probe first, up to the launcher's ``max_running`` (rank 0)."""
        limit = self.settings.launcher.max_running
        running = sum(pending.handle is not None for pending in self.pending.values())
        for pending in sorted(self.pending.values(), key=lambda pending: pending.index):
            if limit is not None and running >= limit:
                return
            if pending.handle is None and not pending.job_done:
                pending.attempts += 1
                command = ["-m", "lit_cbs.probe.side_jobs", str(pending.path / JOB_FILE)]
                pending.handle = self.settings.launcher.submit(command, pending.path, f"attempt{pending.attempts}")
                running += 1

    def windows_open(self) -> list[PendingProbe]:
        """The probes whose main-run window is still being trained."""
        return [pending for pending in self.pending.values() if pending.main_score is None]

    def window_ended(self, trainer: pl.Trainer, pending: PendingProbe, score: BranchScore, changed_batch: bool) -> None:
        """The main run finished its window with ``score``; a job bisecting from it may go on."""
        pending.main_score, pending.main_changed_batch = score_to_json(score), changed_batch
        pending.window_end_step, pending.window_end_row = trainer.global_step, logging_step(trainer)
        if trainer.is_global_zero:
            write_json(pending.path / MAIN_SCORE_FILE, {"score": pending.main_score, "changed_batch": changed_batch})

    def poll(self, trainer: pl.Trainer) -> list[tuple[PendingProbe, dict[str, Any] | str]]:
        """The probes whose outcome is in: (probe, its scores) when its job wrote them and the main run's window
        ended (the reading needs the main run's own score); (probe, why) when its job failed ``retries`` + 1
        times. A failed job with retries left waits its turn to start again. Rank 0 looks; every rank gets the
        same answer."""
        outcomes: list[tuple[int, dict[str, Any] | str]] = []
        if trainer.is_global_zero:
            for pending in self.pending.values():
                outcome = self._outcome(pending)
                if outcome is not None:
                    outcomes.append((pending.index, outcome))
        if trainer.world_size > 1:
            outcomes = trainer.strategy.broadcast(outcomes)
        finished = [(self.pending.pop(index), outcome) for index, outcome in outcomes]
        if trainer.is_global_zero:
            self._start_queued()
        return finished

    def _outcome(self, pending: PendingProbe) -> dict[str, Any] | str | None:
        scores = pending.path / SCORES_FILE
        if scores.is_file():
            if pending.handle is not None and self.settings.launcher.state(pending.handle).running:
                return None  # its scores are written and it is ending: taken once it ended (no process left over)
            pending.handle, pending.job_done = None, True
            return json.loads(scores.read_text()) if pending.main_score is not None else None
        if pending.handle is None:  # waiting its turn
            return None
        state = self.settings.launcher.state(pending.handle)
        if state.running or scores.is_file():
            return None
        pending.handle = None
        pending.failures.append(state.reason or "ended without writing its scores")
        if pending.attempts > self.settings.retries:
            return f"side job failed {pending.attempts} times: " + "; ".join(pending.failures)
        rank_zero_info(
            f"CBS probe at {pending.tokens:,} tokens: side job attempt {pending.attempts} {pending.failures[-1]}; "
            f"it starts again ({pending.attempts} of {self.settings.retries + 1} attempts)"
        )
        return None

    def close(self, trainer: pl.Trainer, pending: PendingProbe) -> None:
        """The probe's reading is recorded: its start checkpoint goes, unless ``keep_checkpoints``."""
        checkpoint = pending.path / CHECKPOINT_NAME
        if trainer.is_global_zero and not self.settings.keep_checkpoints and checkpoint.exists():
            shutil.rmtree(checkpoint) if checkpoint.is_dir() else checkpoint.unlink()

    def state_dict(self) -> list[dict[str, Any]]:
        return [dataclasses.asdict(pending) for pending in self.pending.values()]

    def load_state_dict(self, state: list[dict[str, Any]]) -> None:
        self.pending = {item["index"]: PendingProbe(**item) for item in state}
