"""benchmarks/forecast_coverage.py with 2 simulated runs per row on run folders written here: each run's later
readings counted once, its prior fitted on the other corpus's runs, every scenario reported, section and figure."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import forecast_coverage


def write_run(folder, corpus, readings):
    """A run folder as benchmarks.cbs_law leaves one: probe/cbs_probe.jsonl and the configuration's data.corpus."""
    (folder / "probe").mkdir(parents=True)
    (folder / "resolved_config.yaml").write_text(f"data:\n  corpus: {corpus}\n")
    lines = [json.dumps({"tokens": t, "cbs_lower": lo, "cbs_upper": hi, "seq_len": 128}) for t, lo, hi in readings]
    (folder / "probe" / "cbs_probe.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_forecast_coverage_counts_each_later_reading_once_with_a_prior_fitted_outside_the_run(tmp_path):
    doubling = [32768 * 2**i for i in range(6)]
    runs = [
        write_run(tmp_path / "a_s1", "a", [(t, 2 ** (i // 2 + 1), 2 ** (i // 2 + 2)) for i, t in enumerate(doubling)]),
        write_run(tmp_path / "a_s2", "a", [(t, 2 ** (i // 2 + 1), 2 ** (i // 2 + 2)) for i, t in enumerate(doubling)]),
        write_run(tmp_path / "b_s1", "b", [(t, 2 ** (i + 1), 2 ** (i + 2)) for i, t in enumerate(doubling)]),
    ]
    markdown, plot = tmp_path / "RESULTS.md", tmp_path / "forecast_coverage.png"
    argv = ["--runs", *map(str, runs), "--seeds", "2", "--markdown", str(markdown), "--plot", str(plot)]
    result = forecast_coverage.main(argv)
    real = {row["run"]: row for row in result["real"]}
    # Fitted on the first half; each of the other 3 readings checked once.
    assert {name: (row["fitted"], [p["tokens"] for p in row["later"]]) for name, row in real.items()} == {
        name: (3, doubling[3:]) for name in ("a_s1", "a_s2", "b_s1")
    }
    # The prior of a run on corpus a is b's whole curve's spread, and the other way round (the median of a's two).
    spread_of = {
        run.name: math.exp(forecast_coverage.fitted(forecast_coverage.run_brackets(run))[0].params[2]) for run in runs
    }
    assert real["a_s1"]["prior"] == real["a_s2"]["prior"] == spread_of["b_s1"]
    assert real["b_s1"]["prior"] == (spread_of["a_s1"] + spread_of["a_s2"]) / 2
    for scenario in forecast_coverage.SCENARIOS:
        by_n = result["simulated"][scenario.name]
        assert [by_n[n]["points"] for n in forecast_coverage.FIT_SIZES] == [
            2 * (6 - n) for n in forecast_coverage.FIT_SIZES
        ]
    text = markdown.read_text()
    assert "<!-- forecast_coverage:start -->" in text and "Covered: " in text and "of 9 later readings" in text
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_a_run_whose_probe_failed_is_refused_before_anything_is_written(tmp_path):
    run = write_run(tmp_path / "a_s1", "a", [(32768 * 2**i, 2**i, 2 ** (i + 1)) for i in range(4)])
    (run / "summary.json").write_text("{}")
    (run / "train.log").write_text("CBS probe at 65,536 tokens failed: the side job ran out of memory\n")
    markdown = tmp_path / "RESULTS.md"
    with pytest.raises(
        SystemExit, match=r"(?s)forecast_coverage: no table written: .*CBS probe at 65,536 tokens failed"
    ):
        forecast_coverage.main(["--runs", str(run), "--seeds", "1", "--markdown", str(markdown)])
    assert not markdown.exists()
