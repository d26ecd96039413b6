"""Environment for multi-process runs started from inside the test process."""

from __future__ import annotations

import gc
import os

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
