"""Environment for multi-process runs started from inside the test process."""

from __future__ import annotations

import gc
import importlib
import logging
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import NoReturn

import torch

# Set in this process by earlier multi-process fits (Lightning exports the rendezvous to os.environ);
# inherited, they make a new launcher join that finished job's address and port and hang.
DISTRIBUTED_VARIABLES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "LOCAL_WORLD_SIZE",
)


def subprocess_env(**extra: str) -> dict[str, str]:
    """os.environ without torch.distributed's rendezvous variables, plus ``extra``."""
    env = {key: value for key, value in os.environ.items() if key not in DISTRIBUTED_VARIABLES}
    env.update(extra)
    return env


def in_process_ddp() -> str:
    """The strategy of a multi-process DDP fit the test process starts: "ddp_fork", whose children are copies of
    this process and import nothing again (about a second), where "ddp_spawn"'s import torch, Lightning and the
    test module afresh (5-20 s on 2 busy cores); a process that initialised CUDA cannot fork, and spawns.

    Collects this process's garbage first: a process group an earlier in-process test left to the garbage
    collector would otherwise be collected in a forked rank, where its destructor waits forever on threads a fork
    does not copy."""
    if torch.cuda.is_initialized():
        return "ddp_spawn"
    gc.collect()
    return "ddp_fork"


def run_forked(
    script: Path,
    *args: str,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    capture_output: bool = False,
    output: Path | None = None,
    start_new_session: bool = False,
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    """``python script args...`` in a forked copy of this process, where torch, Lightning and the test helpers are
    imported already (a fresh interpreter imports them again: about 6 CPU-s), started as ``subprocess.run`` would
    start it (from ``cwd``, with the variables ``env`` added to this environment and the rendezvous variables
    dropped, its output in ``stdout`` and ``stderr`` with ``capture_output``, else in the test's), its outcome as
    ``subprocess.run`` gives it (``returncode`` -N: killed by signal N); with ``output``, both streams go to that
    file, as ``stdout=file, stderr=subprocess.STDOUT`` send them; with ``start_new_session`` the copy is a session
    and process group of its own (a kill of its group takes it and the processes it starts, not pytest). For a
    script whose outcome is its files and what it prints, not how a fresh interpreter starts (its import-time
    warnings were emitted here, once).

    The copy trains on one thread: OpenMP's threads do not survive a fork, and a copy that used this process's
    thread pool would wait on them for ever (as a pytest-xdist worker's processes do anyway, tests/conftest.py). A
    process that initialised CUDA cannot fork: there the script starts afresh. In the copy, warnings, logging and
    Hydra's global state are as a fresh interpreter has them (pytest's recorder and handlers, and a config a test
    composed here, are not the script's). A copy past ``timeout`` seconds is
    killed, and raises ``subprocess.TimeoutExpired`` here, as ``subprocess.run`` does."""
    if capture_output and output is not None:
        raise ValueError("run_forked: capture_output or output, not both")
    command = [sys.executable, str(script), *args]
    if torch.cuda.is_initialized():
        with open(output or os.devnull, "w") as log:
            streams = {"stdout": log, "stderr": subprocess.STDOUT} if output is not None else {}
            return subprocess.run(
                command, cwd=cwd, env=subprocess_env(**(env or {})), capture_output=capture_output, text=True,
                timeout=timeout, start_new_session=start_new_session, **streams,
            )  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        if output is not None:
            outputs = [output, output]
        else:
            outputs = [Path(folder) / "stdout", Path(folder) / "stderr"] if capture_output else []
        gc.collect()  # as in_process_ddp: no process group an earlier test left is collected (and waits) in the copy
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            if start_new_session:
                os.setsid()
            _run_copy(command[1:], cwd, env or {}, outputs)
        deadline = time.monotonic() + timeout
        while not (ended := os.waitpid(pid, os.WNOHANG))[0]:
            if time.monotonic() > deadline:
                (os.killpg if start_new_session else os.kill)(pid, signal.SIGKILL)  # the session's group is pid's
                os.waitpid(pid, 0)
                raise subprocess.TimeoutExpired(command, timeout)
            time.sleep(0.05)
        stdout, stderr = (path.read_text(errors="replace") for path in outputs) if capture_output else (None, None)
    return subprocess.CompletedProcess(command, os.waitstatus_to_exitcode(ended[1]), stdout, stderr)


def _log_where_a_fresh_interpreter_logs(pytests: dict[int, int]) -> None:
    """In run_forked's copy: no handler on the root logger, at its default level (pytest's capture handlers are
    there, and a script's ``logging.basicConfig`` would do nothing), and the handlers libraries added at import
    (Lightning's) writing to the copy's stdout or stderr (``pytests``: pytest's streams' ids, and their fd)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)
    for logger in logging.Logger.manager.loggerDict.values():
        for handler in getattr(logger, "handlers", ()):
            if isinstance(handler, logging.StreamHandler) and id(handler.stream) in pytests:
                handler.setStream(sys.stdout if pytests[id(handler.stream)] == 1 else sys.stderr)


def _run_copy(argv: list[str], cwd: Path | None, env: dict[str, str], outputs: list[Path]) -> NoReturn:
    """run_forked's copy: runs the script ``argv[0]`` as ``__main__`` and exits, never returning into pytest."""
    code = 1
    try:
        opened: dict[Path, int] = {}  # a file both streams go to is opened once: their writes interleave in it
        for fd, path in enumerate(outputs, start=1):
            if path not in opened:
                opened[path] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(opened[path], fd)
        if outputs:  # pytest's sys.stdout and sys.stderr write to files of its own, not to file descriptors 1 and 2
            pytests = {id(sys.stdout): 1, id(sys.stderr): 2, id(sys.__stdout__): 1, id(sys.__stderr__): 2}
            sys.stdout, sys.stderr = (open(fd, "w", closefd=False) for fd in (1, 2))  # noqa: SIM115
            _log_where_a_fresh_interpreter_logs(pytests)
        torch.set_num_threads(1)
        # pytest records each test's warnings (warnings.catch_warnings, on a copy of the filters): the copy prints
        # its own to stderr, as a fresh interpreter does, under the filters the interpreter started with.
        importlib.reload(warnings)
        warnings._filters_mutated()  # type: ignore[attr-defined]  # what was shown once here may show again
        if "hydra" in sys.modules:  # a recipe's @hydra.main starts Hydra afresh: no config a test composed here
            from hydra.core.global_hydra import GlobalHydra

            GlobalHydra.instance().clear()
        for name in DISTRIBUTED_VARIABLES:
            os.environ.pop(name, None)
        os.environ.update(env)
        if cwd is not None:
            os.chdir(cwd)
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exit_:  # as the interpreter ends on it: sys.exit("why") prints why, and exits 1
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
