"""Environment for multi-process runs started from inside the test process."""

from __future__ import annotations

import gc
import os
import runpy
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

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


def run_forked(script: Path, *args: str, timeout: float = 300) -> int:
    """``python script args...``'s exit code (-N: killed by signal N), the script run in a forked copy of this
    process, where torch, Lightning and the test helpers are imported already (a fresh interpreter imports them
    again: about 6 CPU-s). For a script whose outcome is its files: what it prints goes to the test's output.

    The copy trains on one thread: OpenMP's threads do not survive a fork, and a child that used this process's
    thread pool would wait on them for ever (as a pytest-xdist worker's processes do anyway, tests/conftest.py). A
    process that initialised CUDA cannot fork: there the script starts afresh. A copy past ``timeout`` seconds is
    killed, and raises ``subprocess.TimeoutExpired`` here, as ``subprocess.run`` does."""
    if torch.cuda.is_initialized():
        command = [sys.executable, str(script), *args]
        return subprocess.run(command, env=subprocess_env(), timeout=timeout).returncode
    gc.collect()  # as in_process_ddp: no process group an earlier test left is collected (and waits) in the copy
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the copy: never returns into pytest
        code = 1
        try:
            torch.set_num_threads(1)
            for name in DISTRIBUTED_VARIABLES:
                os.environ.pop(name, None)
            sys.argv = [str(script), *args]
            runpy.run_path(str(script), run_name="__main__")
            code = 0
        except SystemExit as ended:
            code = ended.code if isinstance(ended.code, int) else int(ended.code is not None)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise subprocess.TimeoutExpired([str(script), *args], timeout)
        time.sleep(0.05)
