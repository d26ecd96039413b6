"""benchmarks/side_waits.py's small mode: a run with side-job probes, what its main run waited for them read from its
summary.json, and said per checkpoint write and per look."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import side_waits

pytestmark = pytest.mark.slow


def test_the_small_mode_reads_the_waits_each_run_measured(tmp_path):
    outcome = side_waits.main(["--quick", "--out", str(tmp_path)])
    (result,) = outcome["results"]
    waits = json.loads((Path(result["run_dir"]) / "summary.json").read_text())["probe"]["side_jobs"]
    assert result["waits"] == waits and waits["checkpoints"] >= 1 and waits["polls"] >= 1
    per_look = 1000 * waits["poll"] / waits["polls"]
    written = 1000 * waits["checkpoint"] / waits["checkpoints"]
    assert f"| local | {written:.1f} ({waits['checkpoints']} points) | {per_look:.2f} (" in outcome["text"]
    assert f") | {waits['polls']:,} | {waits['poll'] / result['run_seconds']:.2%} |" in outcome["text"]
    assert "- SLURM: not measured (--quick)" in outcome["text"]
