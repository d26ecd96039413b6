"""lit_cbs.analysis.plots: E(S) and batch-size figures of a synthetic sweep's fits (tests/sweeps.py) written as PNG."""

from __future__ import annotations

from toys import probe_reading

from lit_cbs.analysis.curves import read_sweep
from lit_cbs.analysis.fits import side_by_side
from lit_cbs.analysis.plots import plot_batch_sizes, plot_es


def test_plots_are_written_as_png(wsd_sweep, wsd_fits, tmp_path):
    runs = read_sweep(wsd_sweep)
    fits, _ = wsd_fits
    probe = [probe_reading(1e6, 256, 512), probe_reading(4e7, 1024, None)]  # the second beyond the grid
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
