"""The real SLURM cluster the tests marked ``slurm`` run on (tests/slurm/cluster.sh): started once per
session by the first test that asks for it, stopped at the session's end. Where it cannot start (not
root, no apt-get, a daemon that does not come up) those tests skip with the reason in one line."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

CLUSTER = Path(__file__).resolve().parent / "cluster.sh"


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory) -> dict[str, str]:
    """The environment a command needs to use the cluster (``SLURM_CONF``), the cluster up."""
    folder = tmp_path_factory.mktemp("slurm")
    env = {**os.environ, "LIT_CBS_SLURM_DIR": str(folder)}
    started = subprocess.run([str(CLUSTER), "up"], env=env, capture_output=True, text=True)
    if started.returncode != 0:
        reason = (started.stderr.strip().splitlines() or ["cluster.sh up failed"])[-1]
        subprocess.run([str(CLUSTER), "down"], env=env, capture_output=True)
        pytest.skip(f"no SLURM cluster here: {reason}")
    yield {"SLURM_CONF": str(folder / "slurm.conf"), "LIT_CBS_SLURM_DIR": str(folder)}
    subprocess.run([str(CLUSTER), "down"], env=env, capture_output=True)
