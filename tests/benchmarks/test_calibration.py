"""benchmarks/calibration.py --quick end to end, so that a documented command cannot break unseen: it judges
every reading of its runs with one window and with two, counts each kind of reading apart, and reports."""

from __future__ import annotations

import json

import pytest

from benchmarks import calibration
from lit_cbs.probe.reading import BranchScore, difference

pytestmark = pytest.mark.slow


def test_calibration_quick_judges_every_reading_both_ways_and_reports(tmp_path):
    markdown = tmp_path / "RESULTS.md"
    result = calibration.main(["--quick", "--out", str(tmp_path / "runs"), "--markdown", str(markdown)])
    runs = result["runs"]
    assert [run["key"] for run in runs] == ["default_s1", "default_s2", "default_s3"]
    for run in runs:
        summary = json.loads((tmp_path / "runs" / run["key"] / "summary.json").read_text())
        assert result["costs"][run["key"]]["tokens"] == summary["probe"]["tokens"]
        for reading in run["readings"]:
            assert reading.replicates == 2 and set(reading.replicate_batch_losses) == set(reading.losses)
            alone = calibration.first_window(reading, run["multipliers"])
            # The first window alone: each k's loss is its first window's mean held-out loss, judged without the second.
            for k, windows in reading.replicate_batch_losses.items():
                assert alone.losses[k] == pytest.approx(sum(windows[0]) / len(windows[0]))
            base = reading.replicate_batch_losses["1"][0]
            for k, se in alone.loss_se.items():  # the paired held-out SE of the first window alone
                if k != "1":
                    window = reading.replicate_batch_losses[k][0]
                    first = difference(BranchScore.heldout(window), BranchScore.heldout(base))
                    assert se == pytest.approx(first.se)
            assert alone.replicate_se == {}
    rows = result["rows"]
    assert len(rows) == sum(len(run["readings"]) for run in runs)
    for row in rows:  # the two-window judgement is the probe's own
        seeds = [run for run in runs if run["seed"] == row["seed"]]
        reading = next(r for run in seeds for r in run["readings"] if r.tokens == row["tokens"])
        assert (row["two"]["lower"], row["two"]["determined"]) == (reading.cbs_lower, reading.determined)
        assert row["two"]["interval"][0] <= reading.cbs_lower or not reading.determined
    # Each reading counted under its kind; the goal counts only determined readings above the floor of the grid.
    for row in rows:
        reading = next(
            r for run in runs if run["seed"] == row["seed"] for r in run["readings"] if r.tokens == row["tokens"]
        )
        floor = reading.k_star == min(float(k) for k in reading.losses)
        expected = "undetermined" if not reading.determined else "trivial" if floor else "determined"
        assert row["two"]["kind"] == expected
    counted = [row for row in rows if row["two"]["holds"] is not None and row["two"]["kind"] == "determined"]
    goal = next((g["goal"] for g in result["goals"] if "non-trivial" in g["goal"]), None)
    assert (goal is None) == (not counted)
    if counted:
        assert f"in {sum(row['two']['holds'] for row in counted)} of {len(counted)} " in goal
    assert json.loads((tmp_path / "runs" / "calibration.json").read_text())["goals"] == result["goals"]
    text = markdown.read_text()
    assert "<!-- calibration:start -->" in text and (tmp_path / "calibration.png").read_bytes()[:4] == b"\x89PNG"
    for goal in result["goals"]:
        assert f"- {goal['goal']}: {'met' if goal['met'] else 'MISSED'}" in text
