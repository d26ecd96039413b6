"""benchmarks/cbs_law.py --quick end to end: the same code as the whole study on a small budget. It trains and probes
every run, writes law.json with what the issue asks of it, counts the held-out size's readings, and refuses a run
whose readings are not all there."""

from __future__ import annotations

import json

import pytest

from benchmarks import cbs_law
from lit_cbs.analysis import fit_law, law_points, read_readings

pytestmark = pytest.mark.slow


def test_the_quick_study_fits_the_law_counts_the_held_out_size_and_refuses_a_short_run(tmp_path, capsys):
    out = tmp_path / "law"
    summary = cbs_law.main(["--quick", "--out", str(out)])
    written = json.loads((out / "law.json").read_text())
    assert written == json.loads(json.dumps(summary))
    assert written["corpora"] == ["stdlib", "kjv"] and len(written["sizes"]) == 2
    assert written["collapse"] in ("tokens", "loss")
    low, high = written["exponent"]["interval"]
    assert low <= written["exponent"]["value"] <= high
    study = cbs_law.QUICK
    runs = {run.name: run for run in cbs_law.runs_of(study)}
    readings = {name: read_readings(out / "runs" / name / "probe" / "cbs_probe.jsonl") for name in runs}
    assert all([r.tokens for r in found] == study.point_tokens for found in readings.values())
    # The held-out count, again from the run files: the law of the collapse fitted on the other runs, its 90% band.
    heldout = [name for name, run in runs.items() if run.heldout]
    params = {name: cbs_law.parameters(out / "runs" / name) for name in runs}
    assert written["heldout"]["size"] == params[heldout[0]] > max(written["sizes"])
    points = {name: law_points(readings[name], params[name], runs[name].corpus, name) for name in runs}
    law = fit_law([p for name in runs if name not in heldout for p in points[name]], written["collapse"])
    determined = [p for name in heldout for p in points[name] if p.determined and not p.floor]
    inside = 0
    for p in determined:
        low, high = law.band([p.tokens if law.covariate == "tokens" else p.loss], p.params, 0.9, p.corpus)
        inside += bool(low[0] <= p.upper and high[0] >= p.lower)
    assert (written["heldout"]["inside"], written["heldout"]["determined"]) == (inside, len(determined))
    assert (out / "cbs_law.png").read_bytes()[:4] == b"\x89PNG" and (out / "fitted_law.json").is_file()
    text = capsys.readouterr().out
    assert f"**Held out: {inside} of {len(determined)} determined readings (above the floor) inside the 90%" in text
    # A run that lost a reading is refused before anything is written.
    probe_file = out / "runs" / "kjv_d16_s1" / "probe" / "cbs_probe.jsonl"
    probe_file.write_text("".join(probe_file.read_text().splitlines(keepends=True)[:-1]))
    (out / "law.json").unlink()
    with pytest.raises(
        SystemExit, match=r"(?s)cbs_law: no table written: .*kjv_d16_s1: readings at \[4096, 8192, 16384\]"
    ):
        cbs_law.main(["--quick", "--out", str(out), "--report-only"])
    assert not (out / "law.json").exists()
