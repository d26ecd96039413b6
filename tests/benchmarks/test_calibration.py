"""The recipe benchmarks' --quick modes end to end, so that a documented command cannot break unseen:
benchmarks.guard, benchmarks.probe_repeat, benchmarks.calibration and benchmarks.hparam_rules train their
runs (short runs, two at a time) and report from them. (benchmarks.table1, time_to_loss, transfer, overhead and gpu_check have
their own tests.)"""

from __future__ import annotations

import json

import pytest

from benchmarks import calibration, guard, hparam_rules, probe_repeat
from lit_cbs.analysis import brackets_from_records, forecast_cbs
from lit_cbs.probe import BranchScore, difference

pytestmark = pytest.mark.slow


def test_guard_quick_trains_each_configuration_once_and_reports(tmp_path):
    result = guard.main(["--quick", "--out", str(tmp_path)])
    runs = result["runs"]
    assert sorted(runs) == ["control_seed1", "default_job_guarded", "guarded_seed1", "premature_seed1"]
    assert (
        runs["control_seed1"]["tokens"] == guard.QUICK.tokens
        and runs["default_job_guarded"]["tokens"] == guard.QUICK.default_job_tokens
    )
    # The premature schedule jumps 16 -> 128 at 4,096 tokens, so it takes fewer steps than the control.
    assert runs["premature_seed1"]["optimizer_steps"] < runs["control_seed1"]["optimizer_steps"]
    assert list(result["rows"]) == ["premature", "guarded", "control"] and len(result["goals"]) == 3
    assert json.loads((tmp_path / "guard.json").read_text())["rows"].keys() == result["rows"].keys()
    assert (tmp_path / "guard.png").read_bytes()[:4] == b"\x89PNG"


def test_probe_repeat_quick_compares_two_runs_at_every_probe_point(tmp_path):
    result = probe_repeat.main(["--quick", "--out", str(tmp_path)])
    runs = result["runs"]["default"]
    assert [run["key"] for run in runs] == ["default_s1_t1", "default_s2_t1"]
    # Points 8,192, 16,384, 32,768; the second falls inside the first window (8,192 tokens of batch 16, then
    # 32 after the default job's change), so it is probed when that window ends.
    assert all([reading["tokens"] for reading in run["readings"]] == [8192, 18432, 32768] for run in runs)
    rows = result["repeatability"]["default"]["rows"]
    assert [row["point"] for row in rows] == [8192, 18432, 32768]
    assert all(row["measured"] == 2 for row in rows)  # both runs read every point
    assert (tmp_path / "probe_repeat.json").exists() and not result["runs"]["curve"]


def test_hparam_rules_quick_trains_the_rules_and_seesaw_through_the_recipes(tmp_path):
    result = hparam_rules.main(["--quick", "--configs", "both,seesaw", "--out", str(tmp_path)])
    (both,), (seesaw,) = result["runs"]["both"], result["runs"]["seesaw"]
    assert "batch.weight_decay_rule=timescale" in both["overrides"] and "batch.beta2_rule=half_life" in both["overrides"]
    # Seesaw doubles where the cosine halves the LR: 16 -> 32 -> 64 in the run's own record.
    assert [change["new"] for change in seesaw["batch_changes"]] == [32, 64] and both["tokens"] == seesaw["tokens"]
    assert result["comparisons"] == {} and result["goals"] == []  # no reference trained: nothing compared
    assert (tmp_path / "hparam_rules.png").read_bytes()[:4] == b"\x89PNG"


def test_hparam_rules_pairs_each_run_with_its_reference_seed_by_seed():
    def run(key, seed, loss, steps):
        return {"key": key, "seed": seed, "val_curve": [{"val_loss": loss}], "optimizer_steps": steps, "fit_seconds": 1.0}

    runs = {
        "lr_only": [run("lr_only", s, 1.30 + 0.01 * s, 100) for s in (1, 2, 3)],
        "both": [run("both", s, 1.33 + 0.01 * s + 0.001 * s * s, 100) for s in (1, 2, 3)],
        "cosine": [run("cosine", s, 1.20, 200) for s in (1, 2, 3)],
        "seesaw": [run("seesaw", s, 1.205, 130) for s in (1, 2, 3)],
    }
    result = hparam_rules.aggregate(runs)
    both = result["comparisons"]["both"]
    assert both["differences"] == pytest.approx([0.031, 0.034, 0.039]) and both["beyond_spread"]
    low, high = both["interval"]
    assert low == pytest.approx(0.0346667 - 4.302653 * 0.0023333, abs=1e-5) and high > 0.04  # t(2) x SE of 3
    assert result["comparisons"]["seesaw"]["steps_saved"] == pytest.approx(0.35)
    ((text, met),) = hparam_rules.goals(result)
    assert met and text.startswith("seesaw: final held-out loss +0.0050 nats") and "35% fewer" in text


def test_calibration_quick_judges_every_reading_both_ways_and_reports(tmp_path):
    markdown = tmp_path / "RESULTS.md"
    result = calibration.main(["--quick", "--out", str(tmp_path / "runs"), "--markdown", str(markdown)])
    runs = result["runs"]
    assert [run["key"] for run in runs] == ["default_s1", "default_s2", "default_s3"]
    for run in runs:
        summary = json.loads((tmp_path / "runs" / run["key"] / "summary.json").read_text())
        assert result["costs"][run["key"]]["tokens"] == summary["probe"]["tokens"]
        for reading in run["readings"]:
            assert reading["replicates"] == 2 and set(reading["replicate_batch_losses"]) == set(reading["losses"])
            alone = calibration.first_window(reading, run["multipliers"])
            # The first window alone: each k's loss is its first window's mean held-out loss, judged without the second.
            for k, windows in reading["replicate_batch_losses"].items():
                assert alone["losses"][k] == pytest.approx(sum(windows[0]) / len(windows[0]))
            base = reading["replicate_batch_losses"]["1"][0]
            for k, se in alone["loss_se"].items():  # the paired held-out SE of the first window alone
                if k != "1":
                    first = difference(BranchScore.heldout(reading["replicate_batch_losses"][k][0]), BranchScore.heldout(base))
                    assert se == pytest.approx(first.se)
            assert alone["replicate_se"] == {}
    rows = result["rows"]
    assert len(rows) == sum(len(run["readings"]) for run in runs)
    for row in rows:  # the two-window judgement is the probe's own
        reading = next(r for run in runs if run["seed"] == row["seed"] for r in run["readings"] if r["tokens"] == row["tokens"])
        assert (row["two"]["lower"], row["two"]["determined"]) == (reading["cbs_lower"], reading["determined"])
        assert row["two"]["interval"][0] <= reading["cbs_lower"] or not reading["determined"]
    # A forecast checked on readings: every held-out bracket counted once, covered as the band says.
    group = [{"key": run["key"], "readings": run["readings"]} for run in runs]
    check = calibration.check_forecast("quick", group[:2], group[2:], "seeds 1, 2 -> seed 3")
    held_out = brackets_from_records(runs[2]["readings"], run=runs[2]["key"])
    forecast = forecast_cbs([b for run in group[:2] for b in brackets_from_records(run["readings"], run=run["key"])])
    assert check["checked"] == len(held_out) and check["covered"] == sum(forecast.covers(b) for b in held_out)
    assert len(check["misses"]) == check["checked"] - check["covered"] and check["description"] == forecast.describe()
    assert json.loads((tmp_path / "runs" / "calibration.json").read_text())["goals"] == result["goals"]
    text = markdown.read_text()
    assert "<!-- calibration:start -->" in text and (tmp_path / "calibration.png").read_bytes()[:4] == b"\x89PNG"
    for goal in result["goals"]:
        assert f"- {goal['goal']}: {'met' if goal['met'] else 'MISSED'}" in text
