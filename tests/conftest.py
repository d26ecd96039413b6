"""Fixtures several test modules share, and the order the tests run in."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import pytest
import torch
from launch import DISTRIBUTED_VARIABLES


def pytest_configure(config: pytest.Config) -> None:
    """On a pytest-xdist worker, this process and the processes it starts use its share of the cores (one of 2 with
    -n 2), unless OMP_NUM_THREADS says otherwise: torch's threads, more than the cores a worker has, would wait on
    each other and on the other workers' threads."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is not None and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, (os.cpu_count() or 1) // int(workers))
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Test files with SLURM tests first, then those with other slow tests, then the rest, each file's tests
    together and in their order (a module fixture is built once). On 2 workers (pytest-xdist hands out work in this
    order) the SLURM tests, which mostly wait on the cluster, overlap the rest from the start, and the short tests
    fill in at the end, so the workers finish together."""
    marked: dict[Path, tuple[bool, bool]] = {}
    for item in items:
        slurm, slow = marked.get(item.path, (False, False))
        marked[item.path] = (
            slurm or item.get_closest_marker("slurm") is not None,
            slow or item.get_closest_marker("slow") is not None,
        )
    items.sort(key=lambda item: tuple(not flag for flag in marked[item.path]))


@pytest.fixture(autouse=True)
def forget_rendezvous():
    """A multi-process fit (ddp_spawn, ddp_fork) exports its rendezvous (MASTER_PORT, ...) into this process's
    environment, and a later one would reuse that port, which by then another test process may hold (pytest-xdist):
    dropped after each test, so every fit picks a free port of its own."""
    yield
    for name in DISTRIBUTED_VARIABLES:
        os.environ.pop(name, None)


@pytest.fixture(scope="session")
def prepared(tmp_path_factory) -> Path:
    """A few standard-library files (about 140 kB), tokenized once per session: a prepared data folder."""
    from lit_cbs.data.prepare import resolve_data

    folder = tmp_path_factory.mktemp("texts")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("argparse.py", "textwrap.py", "string.py"):
        (folder / name).write_bytes((stdlib / name).read_bytes())
    return resolve_data(input_dir=folder, cache_dir=tmp_path_factory.mktemp("cache"), val_fraction=0.1)
