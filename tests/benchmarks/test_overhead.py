"""benchmarks/overhead.py --quick end to end, as its documented command runs it: every part measures
and reports, (e1) on a probe with a real schedule of points."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from launch import subprocess_env

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_the_quick_overhead_benchmark_runs_every_part_and_writes_its_report(tmp_path):
    report, results = tmp_path / "overhead.md", tmp_path / "RESULTS.md"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.overhead",
            "--quick",
            "--repeats",
            "1",
            "--output",
            str(report),
            "--results",
            str(results),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(PYTHONPATH=str(ROOT)),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    text = report.read_text()
    for part in (
        "(a) + BatchWarmup(ConstantBatch(16))",
        "(b) extra cost of the change",
        "(d) + GradientNoiseScale()",
        "(e1) + BatchWarmup(ConstantBatch(16)) + CBSProbeCallback between probes",
        "(e2) + CBSProbeCallback(search='grid')",
    ):
        assert part in text, part
    assert "- (e1) CBSProbeCallback between probes: " in text and "<!-- overhead:start -->" in results.read_text()
