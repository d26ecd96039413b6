"""Where side jobs run (``LocalLauncher``, ``SlurmLauncher``) and how (``SideJobs``)."""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lit_cbs.errors import LitCBSConfigError, positive_int, positive_number

__all__ = ["JobState", "LocalLauncher", "SideJobs", "SlurmLauncher"]


@dataclass(frozen=True)
class JobState:
    """A side job seen from the main run: still ``running`` (or queued), or ended, and why."""

    running: bool
    reason: str = ""


@dataclass(frozen=True)
class LocalLauncher:
    """Side jobs as processes on this machine.

    Args:
        threads: torch threads of each job (None: torch's default); on a CPU machine give the main run and the jobs
            their own cores (e.g. ``OMP_NUM_THREADS=1`` for the main run and ``threads=1`` here).
        devices: ``CUDA_VISIBLE_DEVICES`` of each job (e.g. "7"; None: the main run's).
        timeout_min: a job running longer is stopped and counts as failed (None: no limit).
        max_running: jobs at once; later probes' jobs wait their turn (None: no limit).
        python: the interpreter the jobs run (default: the main run's).

    Examples:
        >>> LocalLauncher(threads=1, devices="7").max_running  # one job at a time, on GPU 7
        1
        >>> LocalLauncher(threads=0)
        Traceback (most recent call last):
        lit_cbs.errors.LitCBSConfigError: threads=0 must be a positive int or None (threads per job)
    """

    threads: int | None = None
    devices: str | None = None
    timeout_min: float | None = None
    max_running: int | None = 1
    python: str = sys.executable

    def __post_init__(self) -> None:
        positive_int("threads", self.threads, "threads per job", optional=True)
        positive_number("timeout_min", self.timeout_min, "minutes", optional=True)
        positive_int("max_running", self.max_running, "jobs at once", optional=True)

    def check(self) -> None:
        """Refuse an interpreter that cannot import ``lit_cbs.probe.side_jobs`` (started once, briefly)."""
        try:
            found = subprocess.run(
                [self.python, "-c", "import lit_cbs.probe.side_jobs"], capture_output=True, text=True
            )
            last = None if found.returncode == 0 else (found.stderr.strip().splitlines() or ["no output"])[-1]
        except OSError as error:  # no such interpreter, not executable
            last = error.strerror
        if last is not None:
            raise LitCBSConfigError(
                f"LocalLauncher(python={self.python!r}) cannot start a side job ({last}): give a python that has "
                "lit_cbs installed"
            )

    def submit(self, command: list[str], folder: Path, name: str) -> dict[str, Any]:
        """``python command...`` in a session of its own, log in ``folder``, without the run's group."""
        env = job_environment()
        if self.threads is not None:
            env["OMP_NUM_THREADS"] = str(self.threads)
        if self.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.devices
        log = (folder / f"{name}.log").open("ab")
        # A session of its own: a signal to the main run (SIGTERM, Ctrl-C) does not reach the job.
        process = subprocess.Popen(
            [self.python, *command], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()
        _STARTED[process.pid] = process  # kept, so that its exit status can be read
        return {"launcher": "local", "pid": process.pid, "started": time.time(), "log": str(folder / f"{name}.log")}

    def state(self, handle: dict[str, Any]) -> JobState:
        """Whether the job runs (stopped past ``timeout_min``); an ended one's status and last log line."""
        process = _STARTED.get(handle["pid"])
        code = process.poll() if process is not None else None  # None for a job of an earlier main process too
        running = process is not None and code is None
        if process is None:  # an earlier main process's: running while /proc names it a side job (not a reused pid)
            cmdline = Path(f"/proc/{handle['pid']}/cmdline")
            with contextlib.suppress(OSError):
                running = "lit_cbs.probe.side_jobs" in cmdline.read_bytes().decode(errors="replace")
        if running:
            if self.timeout_min is not None and time.time() - handle["started"] > 60 * self.timeout_min:
                self.cancel(handle)
                return JobState(False, f"ran past timeout_min={self.timeout_min:g}")
            return JobState(True)
        _STARTED.pop(handle["pid"], None)
        what = "ended (started by an earlier main process)"
        if code is not None:
            what = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        log = Path(handle.get("log") or "")
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()] if log.is_file() else []
        return JobState(False, what + (f": {lines[-1].strip()}" if lines else ""))

    def cancel(self, handle: dict[str, Any]) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(handle["pid"], signal.SIGKILL)


_STARTED: dict[int, subprocess.Popen[bytes]] = {}  # the jobs this process started, by process id

# What the main run's launcher (torchrun, Lightning, SLURM's srun under it) tells its own ranks: a job that inherited
# them would join the main run's process group, or take itself for one of its ranks.
RUN_GROUP_VARIABLES = (
    "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "ROLE_RANK",
    "ROLE_NAME", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE",
)  # fmt: skip


def job_environment() -> dict[str, str]:
    """This process's environment without the main run's process-group variables (and torchrun's TORCHELASTIC_*)."""
    return {
        name: value
        for name, value in os.environ.items()
        if name not in RUN_GROUP_VARIABLES and not name.startswith("TORCHELASTIC_")
    }


@dataclass(frozen=True)
class SlurmLauncher:
    """Side jobs as SLURM jobs through submitit (``pip install -e ".[slurm]"``), with the settings of Hydra's submitit
    launcher: ``nodes`` x ``tasks_per_node`` processes, which Lightning's ``SLURMEnvironment`` makes ranks; the other
    fields are sbatch's options of those names (``additional_parameters``: more, e.g. ``{"requeue": True}``).
    ``timeout_min``: a job that reaches it counts as failed; ``max_running``: jobs submitted at once (None: SLURM
    queues them).

    Examples:
        >>> launcher = SlurmLauncher(partition="spare", gpus_per_node=1, timeout_min=30)
        >>> launcher.nodes, launcher.tasks_per_node, launcher.max_running  # one process; SLURM queues the jobs
        (1, 1, None)
    """

    partition: str | None = None
    timeout_min: int = 60
    nodes: int = 1
    tasks_per_node: int = 1
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    mem_gb: float | None = None
    account: str | None = None
    additional_parameters: dict[str, Any] = field(default_factory=dict)
    max_running: int | None = None
    python: str = sys.executable

    def check(self) -> None:
        """Refuse a machine without submitit or ``sbatch``, or a ``partition`` ``sinfo`` does not list."""
        try:
            importlib.import_module("submitit")
        except ImportError:
            raise LitCBSConfigError(
                'SlurmLauncher submits through submitit, which is not installed: pip install -e ".[slurm]"'
            ) from None
        if shutil.which("sbatch") is None:
            raise LitCBSConfigError("SlurmLauncher: no sbatch on PATH, so no SLURM job can start; use LocalLauncher")
        if self.partition is not None:
            found = subprocess.run(["sinfo", "-h", "-p", self.partition, "-o", "%P"], capture_output=True, text=True)
            if found.returncode != 0 or not found.stdout.strip():
                raise LitCBSConfigError(
                    f"SlurmLauncher(partition={self.partition!r}): SLURM has no such partition (sinfo lists "
                    "them); give one of the cluster's"
                )

    def submit(self, command: list[str], folder: Path, name: str) -> dict[str, Any]:
        """Submit ``python command...`` as a SLURM job (submitit's files in ``folder/slurm``)."""
        import submitit

        optional = {
            "slurm_partition": self.partition,
            "gpus_per_node": self.gpus_per_node,
            "cpus_per_task": self.cpus_per_task,
            "mem_gb": self.mem_gb,
            "slurm_account": self.account,
        }
        # sbatch passes on the environment it is called in (the job then adds SLURM's own): not the main run's group.
        kept = job_environment()
        removed = {variable: os.environ.pop(variable) for variable in set(os.environ) - set(kept)}
        try:
            executor = submitit.AutoExecutor(folder=folder / "slurm", cluster="slurm")
            executor.update_parameters(
                name=name,
                timeout_min=self.timeout_min,
                nodes=self.nodes,
                tasks_per_node=self.tasks_per_node,
                slurm_additional_parameters=dict(self.additional_parameters),
                **{key: value for key, value in optional.items() if value is not None},
            )
            job = executor.submit(submitit.helpers.CommandFunction([self.python, *command], cwd=os.getcwd()))
        finally:
            os.environ.update(removed)
        return {"launcher": "slurm", "job_id": str(job.job_id), "folder": str(folder / "slurm")}

    def state(self, handle: dict[str, Any]) -> JobState:
        """Whether the SLURM job runs or waits; an ended one's reason ("" when it succeeded)."""
        import submitit

        job: submitit.SlurmJob[Any] = submitit.SlurmJob(folder=handle["folder"], job_id=handle["job_id"])
        unreadable = None
        if job.paths.result_pickle.exists():  # submitit wrote how the command ended
            try:
                kind, result = submitit.core.utils.pickle_load(job.paths.result_pickle)
                return JobState(False, "" if kind == "success" else (str(result).strip().splitlines() or [""])[-1])
            except Exception as error:  # noqa: BLE001 - being written while the job ends; a failure once it ended
                unreadable = f"its result {job.paths.result_pickle} is unreadable ({type(error).__name__}: {error})"
        # squeue lists recently ended jobs too; a cluster without accounting forgets one after MinJobAge
        found = subprocess.run(["squeue", "-h", "-j", handle["job_id"], "-o", "%T"], capture_output=True, text=True)
        listed = found.stdout.split() if found.returncode == 0 else []
        state = listed[0] if listed else job.state
        if state in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING", "CONFIGURING", "SUSPENDED", "RESIZING"):
            return JobState(True)
        if unreadable is not None:
            return JobState(False, unreadable)
        if state == "UNKNOWN":  # neither squeue nor sacct knows it any more: gone without a result
            return JobState(False, f"SLURM job {handle['job_id']} ended without a result")
        return JobState(False, f"SLURM job {handle['job_id']} ended {state}")

    def cancel(self, handle: dict[str, Any]) -> None:
        subprocess.run(["scancel", handle["job_id"]], capture_output=True)


@dataclass(frozen=True)
class SideJobs:
    """How ``CBSProbeCallback(side_jobs=...)`` trains its branches as side jobs.

    Args:
        launcher: ``LocalLauncher(...)`` or ``SlurmLauncher(...)``.
        build: ``"package.module:function"`` returning the run's ``RunParts``, importable where the job runs; the
            main run calls it once at setup (nothing trains), so a build that fails stops the run first.
        build_args: its keyword arguments, JSON-able (the recipes pass their run's configuration file).
        retries: times a failed job starts again before the probe is recorded as failed.
        keep_checkpoints: keep each probe's start checkpoint once its reading is recorded.
        wait_at_end: minutes to wait for the readings still out when training ends (0: a resumed run or
            ``recipes/probe.py`` collects them).
        look_seconds: look for finished jobs at most this often (seconds; at most 1% of the run's time; 0: every
            optimizer step).

    Examples:
        >>> jobs = SideJobs(LocalLauncher(threads=1), build="my_project.parts:build_parts")
        >>> jobs.retries, jobs.wait_at_end  # restarts of a failed job; minutes waited at the end
        (2, 60.0)
        >>> SideJobs(LocalLauncher(), build="parts.py")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        lit_cbs.errors.LitCBSConfigError: side_jobs.build='parts.py' must be 'package.module:function' ...
    """

    launcher: Any  # LocalLauncher, SlurmLauncher or any object with their check, submit, state, cancel, max_running
    build: str
    retries: int = 2
    keep_checkpoints: bool = False
    wait_at_end: float = 60.0
    build_args: dict[str, Any] = field(default_factory=dict)
    look_seconds: float = 2.0

    def __post_init__(self) -> None:
        module, _, function = self.build.partition(":")
        for ok, refusal in (
            (hasattr(self.launcher, "submit"),
             f"launcher={self.launcher!r} is not a launcher: give LocalLauncher(...) or SlurmLauncher(...)"),
            (module and function.isidentifier(),
             f"build={self.build!r} must be 'package.module:function' (a function that returns "
             "lit_cbs.probe.RunParts)"),
            (isinstance(self.build_args, dict),
             f"build_args={self.build_args!r} must be a mapping of keyword arguments"),
            (not isinstance(self.retries, bool) and isinstance(self.retries, int) and self.retries >= 0,
             f"retries={self.retries!r} must be an int >= 0 (times a failed job restarts)"),
            (self.wait_at_end >= 0, f"wait_at_end={self.wait_at_end!r} must be >= 0 (minutes)"),
            (self.look_seconds >= 0, f"look_seconds={self.look_seconds!r} must be >= 0 (seconds; 0: after every step)"),
        ):  # fmt: skip
            if not ok:
                raise LitCBSConfigError(f"side_jobs.{refusal}")
