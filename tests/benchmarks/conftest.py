"""The benchmarks' small modes run here as a user runs them (``main([...])``), with one difference in how their runs
start: each ``recipes/*.py`` process a benchmark starts is a forked copy of the test process (tests/launch.py's
``run_forked``), which has torch and Lightning imported already, not a fresh interpreter that imports them again
(about 6 CPU-s a run, most of a small-mode run's cost). The script, its arguments, folder, environment and log are
the benchmark's; what a fresh interpreter does at its start is tested where it matters (tests/recipes,
tests/benchmarks/test_gpu_check.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from launch import run_forked

import benchmarks.common


class ForkedScripts:
    """What ``benchmarks.common`` calls ``subprocess``: ``run`` starts ``python SCRIPT.py ...`` as a forked copy,
    anything else as ``subprocess.run`` does."""

    STDOUT = subprocess.STDOUT

    @staticmethod
    def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
        script = len(command) > 1 and command[0] == sys.executable and command[1].endswith(".py")
        if not script or kwargs.get("stderr") is not subprocess.STDOUT:
            return subprocess.run(command, **kwargs)
        output = Path(kwargs["stdout"].name)
        return run_forked(
            Path(command[1]), *command[2:], cwd=kwargs["cwd"], env=kwargs["env"], output=output, timeout=1800
        )


@pytest.fixture(autouse=True, scope="module")  # module-wide: before the module fixtures that run a benchmark
def forked_benchmark_runs():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(benchmarks.common, "subprocess", ForkedScripts)
        yield
