"""lit_cbs.analysis.plots: E(S) and batch-size figures of a synthetic sweep's fits (tests/sweeps.py) written as PNG."""

from __future__ import annotations

import json

import pytest
from sweeps import WSD_TARGETS, recorded

from lit_cbs.analysis import find_crossings, fit_targets, plot_batch_sizes, plot_es, read_probe, read_sweep, side_by_side


def test_plots_are_written_as_png(wsd_sweep, wsd_fits, tmp_path):
    runs = read_sweep(wsd_sweep)
    fits, _ = wsd_fits
    probe_path = tmp_path / "cbs_probe.jsonl"
    records = [
        {"tokens": 1e6, "cbs_lower": 256, "cbs_upper": 512, "cbs_estimate": 362.0},
        {"tokens": 4e7, "cbs_lower": 1024, "cbs_upper": None, "cbs_estimate": 1024.0},
    ]
    probe_path.write_text("".join(json.dumps(r) + "\n" for r in records))
    probe = read_probe(probe_path)
    assert probe[1].upper is None
    compared = side_by_side(fits, runs)
    plots = (
        plot_es(fits, tmp_path / "es.png"),
        plot_batch_sizes(fits, tmp_path / "b.png", probe=probe, gns_runs=runs),
        plot_batch_sizes(fits, tmp_path / "compared.png", probe=probe, gns_runs=runs, compared=compared),
    )
    assert plots[2].read_bytes() != plots[1].read_bytes()  # the noise scale per target is drawn too
    for path in plots:
        data = path.read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 10_000


def test_plot_refuses_samples_overlay_on_token_units(wsd_sweep, tmp_path):
    runs = read_sweep(wsd_sweep)
    fits, _ = recorded(lambda: fit_targets(find_crossings(runs, WSD_TARGETS, smoothing=None), tokens_per_sample=None))
    assert fits[0].unit == "tokens per step"
    with pytest.raises(ValueError, match="mismatched units: the probe's CBS and the noise scale are in samples"):
        plot_batch_sizes(fits, tmp_path / "b.png", gns_runs=runs)
