"""recipes/fit_es.py on a synthetic sweep (tests/sweeps.py): the table, plots, fits and schedule it writes,
and bad input in one line."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest
import yaml
from launch import run_forked
from sweeps import SEQ_LEN, WSD_TARGETS, mccandlish_crossing_steps, write_run, wsd_truth
from toys import probe_reading

REPO = Path(__file__).resolve().parents[2]


def run_fit_es(*args) -> subprocess.CompletedProcess:
    """recipes/fit_es.py as a forked copy of this process (tests/launch.py)."""
    return run_forked(REPO / "recipes" / "fit_es.py", *map(str, args), capture_output=True, timeout=300)


@pytest.mark.slow
def test_fit_es_cli_prints_the_table_and_writes_plots_and_schedule(wsd_sweep, tmp_path):
    probe = tmp_path / "cbs_probe.jsonl"
    probe.write_text(json.dumps(dataclasses.asdict(probe_reading(1e6, 256, 512))) + "\n")
    out = tmp_path / "out"
    result = run_fit_es(
        wsd_sweep, "--targets", *WSD_TARGETS, "--smoothing", "none", "--out", out, "--probe", probe, "--multiple-of", 8
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.strip().startswith("target loss"))
    assert (
        "B_crit" in lines[header]
        and "B_min" in lines[header]
        and "B_opt" in lines[header]
        and "samples" in lines[header]
    )
    for row, target in zip(lines[header + 1 : header + 4], WSD_TARGETS):
        fields = row.split()
        truth = wsd_truth(target)
        assert float(fields[0]) == target
        assert float(fields[2]) == pytest.approx(truth.b_min / SEQ_LEN, rel=0.05)
        assert float(fields[3]) == pytest.approx(truth.b_opt / SEQ_LEN, rel=0.05)
        assert int(fields[4]) == (13 if target == 3.0 else 12)
    assert "left out runs that never reach it: 0_es_b450" in result.stderr
    for name in ("es_fits.png", "batch_sizes.png"):
        assert (out / name).read_bytes().startswith(b"\x89PNG")
    fits = json.loads((out / "fits.json").read_text())
    assert [f["target"] for f in fits] == WSD_TARGETS and fits[0]["wsd"]["points_per_segment"] == [3, 7, 3]
    assert [f["b_simple"] for f in fits] == [250.0] * 3  # the fixture logs a constant noise scale
    assert "side by side (samples):" in result.stdout and (out / "side_by_side.md").read_text().count("| 250 (") == 3
    schedule = yaml.safe_load((out / "schedule.yaml").read_text())["batch"]["schedule"]
    assert schedule["_target_"] == "lit_cbs.rules.batch_schedules.PiecewiseBatch" and schedule["unit"] == "tokens"
    assert schedule["batch_sizes"] == sorted(schedule["batch_sizes"]) and schedule["thresholds"][0] == 0


def test_fit_es_reports_bad_input_in_one_line(tmp_path, capsys, recipe_script):
    # In-process (the subprocess test above covers the entry point): main() returns the exit status.
    fit_es = recipe_script("fit_es")
    assert fit_es.main([str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err == f"fit_es.py: sweep folder {tmp_path / 'missing'} does not exist\n"
    write_run(tmp_path / "sweep" / "0_a", 1000, mccandlish_crossing_steps, lowest_target=3.0)
    write_run(tmp_path / "sweep" / "1_b", 2000, mccandlish_crossing_steps, lowest_target=3.0)
    with pytest.warns(UserWarning, match="only 2 runs reach it"):
        assert fit_es.main([str(tmp_path / "sweep"), "--targets", "3.0"]) == 2
    assert "no target loss in ['3'] is reached by at least 3 runs" in capsys.readouterr().err
