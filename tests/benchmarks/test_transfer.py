"""benchmarks/transfer.py --quick end to end: it trains through train.py, forecasts its schedule with
schedule_from_probe.py --forecast-to, and its numbers, JSON, plots and markdown agree with what the runs wrote."""

from __future__ import annotations

import json
import shutil

import pytest

from benchmarks import transfer
from lit_cbs.analysis import brackets_from_records, forecast_cbs
from lit_cbs.analysis.forecast import noise_scale_over_tokens, schedule_from_forecast

pytestmark = pytest.mark.slow
ROSTER = transfer.Roster(transfer.QUICK.seeds)  # the runs --quick trains (one seed)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("transfer")
    markdown = out / "RESULTS.md"
    markdown.write_text("# Results\n\nkept\n")
    outcome = transfer.main(["--quick", "--jobs", "2", "--out", str(out / "runs"), "--markdown", str(markdown)])
    return out, outcome


def test_schedules_come_from_the_forecast_and_drive_the_runs(result):
    out, outcome = result
    runs = outcome["runs"]
    tiny_records = {key: runs[key]["readings"] for key in ROSTER.tiny_curves}
    for records in tiny_records.values():
        assert len(records) >= 2 and all(r.batch_size == 16 and r.replicates == 2 for r in records)
    # The schedule is the one schedule_from_probe.py forecasts from the tiny curves' files.
    forecast = forecast_cbs(
        [
            b
            for key, records in tiny_records.items()
            for b in brackets_from_records(records, run=str(transfer.probe_file(out / "runs" / key)))
        ],
        coverage=transfer.COVERAGE,
    )
    expected, _ = schedule_from_forecast(forecast, transfer.START, transfer.QUICK.tokens, final=transfer.FINAL)
    written = outcome["schedules"]["from_tiny"]
    assert (written["batch_sizes"], written["thresholds"]) == (expected.batch_sizes, expected.thresholds)
    assert outcome["forecast"]["description"] == forecast.describe()
    comment = (out / "runs" / "conf" / "batch" / "from_tiny.yaml").read_text()
    assert f"--forecast-to {transfer.QUICK.tokens:,}" in comment and forecast.describe() in comment
    for run in ROSTER.scheduled:
        changes = runs[run.key]["batch_changes"]
        # BatchWarmup switches at the first optimizer step boundary at or after each threshold.
        assert [c["new"] for c in changes] == expected.batch_sizes[1:]
        assert all(0 <= c["tokens"] - t < 64 * 128 for c, t in zip(changes, expected.thresholds[1:]))


def test_numbers_come_from_the_runs(result):
    out, outcome = result
    budget = transfer.QUICK.tokens
    for seed in transfer.QUICK.seeds:
        control = json.loads((out / "runs" / f"tiny4x_control_seed{seed}" / "summary.json").read_text())
        assert control["optimizer_steps"] == budget // (16 * 128)
        scheduled = outcome["rows"][f"tiny4x_from_tiny_seed{seed}"]
        summary = json.loads((out / "runs" / f"tiny4x_from_tiny_seed{seed}" / "summary.json").read_text())
        assert scheduled["steps"] == summary["optimizer_steps"] and scheduled["tokens"] == summary["tokens"] == budget
        assert scheduled["loss"] == pytest.approx(summary["final_val_loss"])
        assert scheduled["loss_vs_control"] == pytest.approx(summary["final_val_loss"] - control["final_val_loss"])
        assert scheduled["steps_saved"] == pytest.approx(1 - summary["optimizer_steps"] / control["optimizer_steps"])
        # The probed tiny4x run's main run is the control's run (a probe leaves the main run untouched).
        assert outcome["runs"][f"tiny4x_curve_seed{seed}"]["final_val_loss"] == pytest.approx(
            control["final_val_loss"], abs=1e-4
        )
    # Every curve was read at the same points: the goal compares like with like.
    points = {run.key: [r.tokens for r in outcome["runs"][run.key]["readings"]] for run in ROSTER.curves}
    assert all(tokens == [p["tokens"] for p in outcome["points"]] for tokens in points.values())
    # The noise-scale run logged B_simple, which the report puts beside the forecast.
    tokens, b_simple = noise_scale_over_tokens(out / "runs" / transfer.NOISE.key / "metrics.csv")
    assert len(tokens) > 3 and (b_simple > 0).all()


def test_report_files(result):
    out, outcome = result
    saved = json.loads((out / "runs" / "transfer.json").read_text())
    assert saved["rows"] == outcome["rows"]
    assert set(saved["runs"]) == {r.key for r in [*ROSTER.curves, transfer.NOISE, *ROSTER.trained]}
    assert (out / "transfer.png").stat().st_size > 10_000  # next to the markdown
    assert (out / "forecast.png").stat().st_size > 10_000
    text = (out / "RESULTS.md").read_text()
    assert text.startswith("# Results\n\nkept\n") and "<!-- transfer:start -->" in text
    assert "Incomplete" not in text and f"Budget: {transfer.QUICK.tokens:,} tokens per run" in text
    assert "grows as D^" in text and "](forecast.png)" in text
    for goal in outcome["goals"]:
        assert f"- {goal['goal']}: {'met' if goal['met'] else 'MISSED'}" in text


def test_report_only_rebuilds_from_finished_runs(result, tmp_path):
    out, outcome = result
    again = transfer.main(
        ["--report-only", "--quick", "--out", str(out / "runs"), "--plot", str(tmp_path / "again.png")]
    )
    assert again["rows"] == outcome["rows"] and again["points"] == outcome["points"]


def test_report_only_keeps_the_readings_of_a_curve_cut_short(result, tmp_path):
    out, outcome = result
    shutil.copytree(out / "runs", tmp_path / "runs")
    seed = transfer.QUICK.seeds[-1]
    (tmp_path / "runs" / "tiny4x_curve_seed1" / "summary.json").unlink()  # as while it still trains
    shutil.rmtree(tmp_path / "runs" / f"tiny4x_from_tiny_seed{seed}")
    markdown = tmp_path / "RESULTS.md"
    cut = transfer.main(["--report-only", "--quick", "--out", str(tmp_path / "runs"), "--markdown", str(markdown)])
    assert cut["points"] == outcome["points"] and f"tiny4x_from_tiny_seed{seed}" not in cut["rows"]
    text = markdown.read_text()
    assert f"Incomplete: not run (yet): tiny4x, schedule forecast from tiny's curve, seed {seed}." in text
    assert "Unfinished when reported (its readings so far are shown): tiny4x CBS curve, seed 1." in text
