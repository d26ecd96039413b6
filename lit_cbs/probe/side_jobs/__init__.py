"""The side-job runner: a point's branches trained by a job of their own from the main run's checkpoint."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import math
import os
import shutil
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_cbs.callbacks.warmup import BatchWarmup
from lit_cbs.errors import LitCBSConfigError
from lit_cbs.probe.engine import BranchOutcome, ProbeConfig, ProbePoint, Runner, score_from_json
from lit_cbs.probe.from_checkpoint import RunParts
from lit_cbs.probe.side_jobs.launchers import SideJobs

JOBS_FOLDER = "cbs_probe_jobs"  # beside cbs_probe.jsonl: one folder per probe point
JOB_FILE = "job.json"
SCORES_FILE = "scores.json"
MAIN_SCORE_FILE = "main_score.json"
CHECKPOINT_NAME = "start.ckpt"
HEARTBEAT_FILE = "main.alive"  # in JOBS_FOLDER: touched by the main run while it lives
HEARTBEAT_SECONDS = 10.0
# Looks for results come every n optimizer steps, n set at each look (on rank 0, broadcast with its findings, so the
# ranks agree without another collective) so that looks are at most every SideJobs.look_seconds and cost at most
# 1 / LOOK_SHARE of the run's time: squeue and a broadcast cost milliseconds, a small model's step tens of them.
LOOK_SHARE = 100
MAX_LOOK_EVERY = 1000
MAIN_SILENCE_SECONDS = 300.0  # a job waiting for the main run's score stops after this long without a heartbeat

__all__: list[str] = []  # the main run's side of side jobs, and the files they share: the engine's own parts


def write_json(path: Path, content: Any) -> None:
    """``content`` as JSON in ``path``, atomically (a reader never sees half a file)."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(content, indent=1))
    os.replace(partial, path)


def build_parts(build: str, build_args: dict[str, Any]) -> RunParts:
    """The run's parts from ``SideJobs.build``; a ``LitCBSConfigError`` in one line where it fails."""
    module, _, function = build.partition(":")
    try:
        parts = getattr(importlib.import_module(module), function)(**build_args)
    except LitCBSConfigError as error:
        raise LitCBSConfigError(f"side_jobs.build={build!r} fails: {error}") from error
    except Exception as error:  # noqa: BLE001 - any failure of the build is said in one line
        raise LitCBSConfigError(f"side_jobs.build={build!r} fails: {type(error).__name__}: {error}") from error
    if not isinstance(parts, RunParts) or parts.datamodule is None:
        raise LitCBSConfigError(
            f"side_jobs.build={build!r} gave {type(parts).__name__}, not lit_cbs.probe.RunParts with a datamodule "
            "(the job reads the window at the checkpoint's data position)"
        )
    return parts


class Host(Protocol):
    """The main run's loop as its side jobs need it: ranks, a barrier and a broadcast, the point's checkpoint."""

    is_global_zero: bool
    world_size: int

    def barrier(self) -> None: ...
    def broadcast(self, obj: Any) -> Any: ...
    def checkpoint(self, folder: Path) -> Path: ...  # where the point's checkpoint goes in its folder
    def save(self, path: Path) -> None: ...  # on every rank
    def build(self, folder: Path) -> tuple[str, dict[str, Any]]: ...  # the job's build target and its arguments


class TrainerHost:
    """A Lightning Trainer as a side job's ``Host``: ``start.ckpt``, rebuilt by ``SideJobs.build``."""

    def __init__(self, trainer: pl.Trainer, settings: SideJobs):
        self.trainer, self.settings = trainer, settings
        self.is_global_zero, self.world_size = trainer.is_global_zero, trainer.world_size

    def barrier(self) -> None:
        self.trainer.strategy.barrier("SideJobRunner")

    def broadcast(self, obj: Any) -> Any:
        return self.trainer.strategy.broadcast(obj)

    def checkpoint(self, folder: Path) -> Path:
        return folder / CHECKPOINT_NAME

    def save(self, path: Path) -> None:
        self.trainer.save_checkpoint(path, weights_only=False)

    def build(self, folder: Path) -> tuple[str, dict[str, Any]]:
        return self.settings.build, self.settings.build_args


def job_description(
    point: ProbePoint, config: ProbeConfig, checkpoint: Path, build: str, build_args: dict[str, Any]
) -> dict[str, Any]:
    """What a side job is told (``job.json``): checkpoint, build, settings, plan, the main run."""
    settings = {
        name: getattr(config, name)
        for name in (
            "multipliers", "window_tokens", "epsilon", "confidence", "ema_alpha", "lr_rule", "weight_decay_rule",
            "beta2_rule", "beta2_floor", "search", "evaluate", "heldout_batches", "cooldown_fraction", "replicates",
            "snapshot_device",
        )
    }  # fmt: skip
    folder = Path(point.folder)
    return {
        "checkpoint": str(checkpoint),
        "build": build,
        "build_args": build_args,
        "config": settings,
        **{name: getattr(point, name) for name in ("multipliers", "window_samples", "main_baseline")},
        "main_score": str(folder / MAIN_SCORE_FILE),
        "scores": str(folder / SCORES_FILE),
        "main": {"host": socket.gethostname(), "pid": os.getpid(), "heartbeat": str(folder.parent / HEARTBEAT_FILE)},
    }


class SideJobRunner(Runner):
    """The main run's side of side jobs: rank 0 writes files and asks the launcher; all ranks learn alike."""

    mode = "side_jobs"
    late = True

    def __init__(self, settings: SideJobs, config: ProbeConfig):
        self.settings, self.config = settings, config
        self.host: Host | None = None
        self.folder: Path | None = None  # JOBS_FOLDER of the run
        self.pending: dict[int, ProbePoint] = {}  # points started whose outcome is not taken
        self._heartbeat: threading.Event | None = None
        # What the main run paid for its side jobs on its own clock (seconds): each point's checkpoint and job
        # description, every step's look for outcomes, and the wait for the last readings when training ended.
        self.waits = {"checkpoint": 0.0, "checkpoints": 0, "poll": 0.0, "polls": 0, "at_end": 0.0}
        self.look_every = 1  # optimizer steps between looks for results (all ranks alike)
        self._steps_since_look = 0
        self._last_look: tuple[float, float] | None = None  # (when it began, what it cost), rank 0's clock
        self.every_call = False  # training ended: look at every call

    def check(self, trainer: pl.Trainer, warmup: BatchWarmup | None) -> None:
        """Refuse, on every rank before any work, a launcher that cannot start or a build that differs."""
        problem = None
        if trainer.is_global_zero:
            try:
                self.settings.launcher.check()
                parts = build_parts(self.settings.build, self.settings.build_args)
                theirs = next((c for c in parts.callbacks if isinstance(c, BatchWarmup)), None)
                if (
                    warmup is not None
                    and not warmup.schedule.is_constant
                    and (theirs is None or theirs.rules.names() != warmup.rules.names())
                ):
                    what = "no BatchWarmup" if theirs is None else f"BatchWarmup({theirs.rules.describe()})"
                    raise LitCBSConfigError(
                        f"side_jobs.build={self.settings.build!r} rebuilds the run with {what}, but the run's is "
                        f"BatchWarmup({warmup.rules.describe()}): a job's branches would not move the optimizer as "
                        "the run does; give the build the run's BatchWarmup"
                    )
            except LitCBSConfigError as error:
                problem = str(error)
        if (problem := trainer.strategy.broadcast(problem)) is not None:
            raise LitCBSConfigError(problem)

    def attach(self, host: Host, output_dir: Path) -> None:
        """At the fit's start: the run's folder, and the heartbeat jobs watch."""
        self.host, self.folder = host, output_dir / JOBS_FOLDER
        self.look_every, self._steps_since_look, self._last_look, self.every_call = 1, 0, None, False
        if host.is_global_zero and self._heartbeat is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._heartbeat = threading.Event()
            threading.Thread(target=_beat, args=(self.folder / HEARTBEAT_FILE, self._heartbeat), daemon=True).start()

    def detach(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.set()
            self._heartbeat = None

    @property
    def _host(self) -> Host:
        assert self.host is not None, "attached at the fit's start"
        return self.host

    def folder_for(self, index: int, tokens: int) -> str:
        assert self.folder is not None, "attached at the fit's start"
        return str(self.folder / f"probe{index:03d}_{tokens}tokens")

    def start(self, point: ProbePoint) -> None:
        """Write the point's checkpoint (every rank) and job description; start (or queue) its job."""
        host, started, folder = self._host, time.perf_counter(), Path(point.folder)
        if host.is_global_zero:
            if folder.exists():  # from a timeline this run's resume left behind
                shutil.rmtree(folder)
            folder.mkdir(parents=True)
        host.barrier()
        checkpoint = host.checkpoint(folder)
        host.save(checkpoint)
        self.pending[point.index] = point
        if host.is_global_zero:
            write_json(folder / JOB_FILE, job_description(point, self.config, checkpoint, *host.build(folder)))
            self._start_queued()
        self.waits["checkpoint"] += time.perf_counter() - started
        self.waits["checkpoints"] += 1
        rank_zero_info(
            f"CBS probe at {point.tokens:,} tokens (batch {point.batch_size}): multipliers "
            f"[{', '.join(f'{k:g}' for k in point.multipliers)}] handed to a side job ({point.folder}); "
            "the main run trains on as k = 1"
        )

    def window_ended(self, point: ProbePoint) -> None:
        """The main run's score over the window is in: a job bisecting from it may go on."""
        if self._host.is_global_zero:
            content = {"score": point.main_score, "changed_batch": point.main_changed_batch}
            write_json(Path(point.folder) / MAIN_SCORE_FILE, content)

    def _start_queued(self) -> None:
        """Start the jobs waiting their turn, oldest point first, up to the launcher's ``max_running`` (rank 0)."""
        limit = self.settings.launcher.max_running
        running = sum(point.handle is not None for point in self.pending.values())
        for point in sorted(self.pending.values(), key=lambda point: point.index):
            if limit is not None and running >= limit:
                return
            if point.handle is None and not point.job_done:
                point.attempts += 1
                command = ["-m", "lit_cbs.probe.side_jobs", str(Path(point.folder) / JOB_FILE)]
                point.handle = self.settings.launcher.submit(command, Path(point.folder), f"attempt{point.attempts}")
                running += 1

    def poll(self) -> list[tuple[ProbePoint, BranchOutcome | str]]:
        """The points whose outcome (or failure) is in; rank 0 looks every ``look_every`` calls."""
        host = self._host
        self._steps_since_look += 1
        if not (self.every_call or self._steps_since_look >= self.look_every):
            return []
        started = time.perf_counter()
        found: list[tuple[int, dict[str, Any] | str]] = []
        if host.is_global_zero:
            found = [(point.index, out) for point in self.pending.values() if (out := self._outcome(point)) is not None]
        every = self._next_look_every(started) if host.is_global_zero else 1
        if host.world_size > 1:
            found, every = host.broadcast((found, every))
        self.look_every, self._steps_since_look = every, 0
        finished: list[tuple[ProbePoint, BranchOutcome | str]] = []
        for index, content in found:
            point = self.pending.pop(index)
            if isinstance(content, str):  # why its jobs failed
                finished.append((point, content))
                continue
            scores = {float(k): score_from_json(score) for k, score in content["scores"].items()}
            trained, failed, tokens = content["trained"], content["failed"], content["tokens_trained"]
            finished.append((point, BranchOutcome(scores, trained, failed, tokens, point.window_tokens)))
        if host.is_global_zero:
            self._start_queued()
        cost = time.perf_counter() - started
        self._last_look = (started, cost)
        if not self.every_call:  # the looks while training (those at the end are its wait at the end)
            self.waits["poll"] += cost
            self.waits["polls"] += 1
        return finished

    def _next_look_every(self, now: float) -> int:
        """Steps to the next look: at most every ``look_seconds``, 1 / LOOK_SHARE of the time."""
        if self._last_look is None or self.every_call or not self.settings.look_seconds:
            return 1
        began, cost = self._last_look
        step_seconds = max(1e-6, (now - began - cost) / self._steps_since_look)
        interval = max(self.settings.look_seconds, LOOK_SHARE * cost)
        return max(1, min(MAX_LOOK_EVERY, math.ceil(interval / step_seconds)))

    def _outcome(self, point: ProbePoint) -> dict[str, Any] | str | None:
        scores = Path(point.folder) / SCORES_FILE
        if scores.is_file():
            if point.handle is not None and self.settings.launcher.state(point.handle).running:
                return None  # its scores are written and it is ending: taken once it ended (no process left over)
            point.handle, point.job_done = None, True
            # Taken once the main run's part of the window is trained (and its score is in, where it stands for k = 1).
            ready = not point.main_open and (point.main_score is not None or not point.main_baseline)
            return json.loads(scores.read_text()) if ready else None
        if point.handle is None:  # waiting its turn
            return None
        state = self.settings.launcher.state(point.handle)
        if state.running or scores.is_file():
            return None
        point.handle = None
        point.failures.append(state.reason or "ended without writing its scores")
        repeated = len(point.failures) >= 2 and point.failures[-1] == point.failures[-2]
        if point.attempts > self.settings.retries or repeated:  # each reason said once, whole
            failures, counts = point.failures, Counter(point.failures)
            each = "; ".join(reason if n == 1 else f"({n} times) {reason}" for reason, n in counts.items())
            said = f", each: {failures[0]}" if len(counts) == 1 else f": {each}"
            said = f": {failures[0]}" if len(failures) == 1 else f" {len(failures)} times{said}"
            return f"side job failed{said}" + ("; not started again after the same error twice" if repeated else "")
        rank_zero_info(
            f"CBS probe at {point.tokens:,} tokens: side job attempt {point.attempts} {point.failures[-1]}; "
            f"it starts again ({point.attempts} of {self.settings.retries + 1} attempts)"
        )
        return None

    def wait_at_end(self, poll: Callable[[], None]) -> None:
        """``poll`` until no point is pending, at most ``SideJobs.wait_at_end`` minutes."""
        waiting = ", ".join(f"{tokens:,}" for tokens in sorted(point.tokens for point in self.pending.values()))
        minutes = self.settings.wait_at_end
        rank_zero_info(f"CBS probes at {waiting} tokens: waiting up to {minutes:g} min for their side jobs")
        started = time.monotonic()
        self.every_call = True
        while self.pending and time.monotonic() - started < minutes * 60:
            poll()
            if self.pending:
                time.sleep(0.25)
        self.waits["at_end"] += time.monotonic() - started
        if self.pending:
            left = ", ".join(f"{point.tokens:,}" for point in self.pending.values())
            rank_zero_warn(
                f"CBS probes at {left} tokens: their side jobs did not finish within side_jobs.wait_at_end; "
                "they stay in last.ckpt: a run resumed from it collects them"
            )

    def close(self, point: ProbePoint) -> None:
        """The point's reading is recorded (or it failed): its start checkpoint goes, unless ``keep_checkpoints``."""
        host = self.host
        self.pending.pop(point.index, None)
        if host is not None and host.is_global_zero and not self.settings.keep_checkpoints:
            checkpoint = host.checkpoint(Path(point.folder))
            if checkpoint.is_dir():
                shutil.rmtree(checkpoint)
            else:
                checkpoint.unlink(missing_ok=True)

    def state_dict(self) -> list[dict[str, Any]]:
        return [dataclasses.asdict(point) for point in self.pending.values()]

    def load_state_dict(self, state: list[dict[str, Any]]) -> list[ProbePoint]:
        """The points a checkpoint left pending, to be collected (or their jobs started again) from the next step."""
        points = [ProbePoint(**item) for item in state]
        for point in points:
            point.window_done = point.window_done or point.main_score is not None
            point.main_open = point.main_open and point.main_score is None
        self.pending = {point.index: point for point in points}
        return points


def _beat(path: Path, stop: threading.Event) -> None:
    while not stop.is_set():
        with contextlib.suppress(OSError):
            path.touch()
        stop.wait(HEARTBEAT_SECONDS)


def main_is_gone(main: dict[str, Any], now: float | None = None) -> str | None:
    """Why a job's main run is gone (process ended, heartbeat silent), else None."""
    if main["host"] == socket.gethostname() and not Path(f"/proc/{main['pid']}").exists():
        return f"the main run (process {main['pid']}) has ended"
    heartbeat = Path(main["heartbeat"])
    now = time.time() if now is None else now
    with contextlib.suppress(OSError):
        silence = now - heartbeat.stat().st_mtime
        if silence > MAIN_SILENCE_SECONDS:
            return f"the main run has not been heard from for {silence:.0f} s ({heartbeat})"
    return None
