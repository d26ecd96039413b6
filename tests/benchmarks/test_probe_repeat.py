"""benchmarks/probe_repeat.py --quick end to end: two seeds' runs probed at the same points and compared."""

from __future__ import annotations

import pytest

from benchmarks import probe_repeat

pytestmark = pytest.mark.slow


def test_probe_repeat_quick_compares_two_runs_at_every_probe_point(tmp_path):
    result = probe_repeat.main(["--quick", "--out", str(tmp_path)])
    runs = result["runs"]["default"]
    assert [run["key"] for run in runs] == ["default_s1_t1", "default_s2_t1"]
    # Points 8,192, 16,384, 32,768; the second falls inside the first window (8,192 tokens of batch 16, then
    # 32 after the default job's change), so it is probed when that window ends.
    assert all([reading.tokens for reading in run["readings"]] == [8192, 18432, 32768] for run in runs)
    rows = result["repeatability"]["default"]["rows"]
    assert [row["point"] for row in rows] == [8192, 18432, 32768]
    assert all(row["measured"] == 2 for row in rows)  # both runs read every point
    assert (tmp_path / "probe_repeat.json").exists() and not result["runs"]["curve"]
