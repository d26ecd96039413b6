"""benchmarks/transfer.py --quick end to end: it trains through train.py, reads its schedules with
schedule_from_probe.py, and its numbers, JSON, plot and markdown agree with what the runs wrote."""

from __future__ import annotations

import json
import shutil

import pytest

from benchmarks import transfer
from lit_cbs.analysis import schedule_from_probe

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("transfer")
    markdown = out / "RESULTS.md"
    markdown.write_text("# Results\n\nkept\n")
    outcome = transfer.main(["--quick", "--jobs", "2", "--out", str(out / "runs"), "--markdown", str(markdown)])
    return out, outcome


def test_schedules_come_from_the_curves_and_drive_the_runs(result):
    out, outcome = result
    runs = outcome["runs"]
    tiny_records = [r for key in ("tiny_curve_seed1", "tiny_curve_seed2") for r in runs[key]["readings"]]
    assert len(tiny_records) >= 4 and all(r["batch_size"] == 16 for r in tiny_records)
    expected = schedule_from_probe(tiny_records, start=16, final=64)
    written = outcome["schedules"]["from_tiny"]
    assert (written["batch_sizes"], written["thresholds"]) == (expected.batch_sizes, expected.thresholds)
    own = schedule_from_probe(runs["tiny4x_curve_seed1"]["readings"], start=16, final=64)
    for key, schedule in (("tiny4x_from_tiny", expected), ("tiny4x_from_tiny4x", own)):
        changes = runs[key]["batch_changes"]
        # BatchWarmup switches at the first optimizer step boundary at or after each threshold.
        assert [c["new"] for c in changes] == schedule.batch_sizes[1:]
        assert all(0 <= c["tokens"] - t < 64 * 128 for c, t in zip(changes, schedule.thresholds[1:]))


def test_numbers_come_from_the_runs(result):
    out, outcome = result
    budget = transfer.QUICK.tokens
    control = json.loads((out / "runs" / "tiny4x_control" / "summary.json").read_text())
    assert control["optimizer_steps"] == budget // (16 * 128)
    for key, row in outcome["rows"].items():
        summary = json.loads((out / "runs" / key / "summary.json").read_text())
        assert row["steps"] == summary["optimizer_steps"] and row["tokens"] == summary["tokens"] == budget
        assert row["loss"] == pytest.approx(summary["final_val_loss"])
        assert row["steps_saved"] == pytest.approx(1 - summary["optimizer_steps"] / control["optimizer_steps"])
    # Every curve was read at the same points: the goal compares like with like.
    points = {key: [r["tokens"] for r in outcome["runs"][key]["readings"]] for key in ("tiny_curve_seed1", "tiny4x_curve_seed1")}
    assert points["tiny_curve_seed1"] == points["tiny4x_curve_seed1"] == [p["tokens"] for p in outcome["points"]]
    # The probed tiny4x run's main run is the control's run (a probe leaves the main run untouched).
    assert outcome["runs"]["tiny4x_curve_seed1"]["final_val_loss"] == pytest.approx(control["final_val_loss"], abs=1e-4)


def test_report_files(result):
    out, outcome = result
    saved = json.loads((out / "runs" / "transfer.json").read_text())
    assert saved["rows"] == outcome["rows"] and set(saved["runs"]) == {r.key for r in [*transfer.CURVES, *transfer.TRAINED]}
    assert (out / "transfer.png").stat().st_size > 10_000  # next to the markdown
    text = (out / "RESULTS.md").read_text()
    assert text.startswith("# Results\n\nkept\n") and "<!-- transfer:start -->" in text
    assert "Incomplete" not in text and f"Budget: {transfer.QUICK.tokens:,} tokens per run" in text
    for goal in outcome["goals"]:
        assert f"- {goal['goal']}: {'met' if goal['met'] else 'MISSED'}" in text


def test_report_only_rebuilds_from_finished_runs(result, tmp_path):
    out, outcome = result
    again = transfer.main(["--report-only", "--quick", "--out", str(out / "runs"), "--plot", str(tmp_path / "again.png")])
    assert again["rows"] == outcome["rows"] and again["points"] == outcome["points"]


def test_report_only_keeps_the_readings_of_a_curve_cut_short(result, tmp_path):
    out, outcome = result
    shutil.copytree(out / "runs", tmp_path / "runs")
    (tmp_path / "runs" / "tiny4x_curve_seed1" / "summary.json").unlink()  # as while it still trains
    shutil.rmtree(tmp_path / "runs" / "tiny4x_from_tiny4x")
    markdown = tmp_path / "RESULTS.md"
    cut = transfer.main(["--report-only", "--quick", "--out", str(tmp_path / "runs"), "--markdown", str(markdown)])
    assert cut["points"] == outcome["points"] and "tiny4x_from_tiny4x" not in cut["rows"]
    text = markdown.read_text()
    assert "Incomplete: not run (yet): tiny4x, schedule from its own curve." in text
    assert "Unfinished when reported (its readings so far are shown): tiny4x CBS curve, seed 1." in text
