"""benchmarks/forecast_coverage.py with 2 simulated runs per row, so that its documented command cannot break
unseen: every real run cut short and every scenario reported, its section and figure written."""

from __future__ import annotations

from benchmarks import forecast_coverage


def test_forecast_coverage_reports_every_real_run_cut_short_and_every_scenario(tmp_path):
    markdown, plot = tmp_path / "RESULTS.md", tmp_path / "forecast_coverage.png"
    result = forecast_coverage.main(["--seeds", "2", "--markdown", str(markdown), "--plot", str(plot)])
    real = result["real"]
    # Each run fitted on its first n readings for every n that leaves a later one.
    assert [(row["run"], row["fitted"]) for row in real] == [
        (name, n) for name, (_, readings) in forecast_coverage.REAL_RUNS.items() for n in range(2, len(readings))
    ]
    assert all(row["warned"] == (row["fitted"] == 2) for row in real)  # two readings: too few to test the shape
    # Every later reading the band misses comes from a fit that warned.
    assert all(row["warned"] for row in real if not all(point["covered"] for point in row["later"]))
    for scenario in forecast_coverage.SCENARIOS:
        by_n = result["simulated"][scenario.name]
        assert [by_n[n]["points"] for n in forecast_coverage.FIT_SIZES] == [
            2 * (6 - n) for n in forecast_coverage.FIT_SIZES
        ]
    text = markdown.read_text()
    assert "<!-- forecast_coverage:start -->" in text and "### Real readings cut short" in text
    assert plot.read_bytes()[:4] == b"\x89PNG"
