"""Environment for multi-process runs started from inside the test process."""

from __future__ import annotations

import os

# Set in this process by earlier ddp_spawn tests (Lightning exports the rendezvous to os.environ);
# inherited, they make a new launcher join that finished job's address and port and hang.
DISTRIBUTED_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE")


def subprocess_env(**extra: str) -> dict[str, str]:
    """os.environ without torch.distributed's rendezvous variables, plus ``extra``."""
    env = {key: value for key, value in os.environ.items() if key not in DISTRIBUTED_VARIABLES}
    env.update(extra)
    return env
