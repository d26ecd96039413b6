"""lit_cbs.analysis.fits.side_by_side: each target loss's B_crit, B_min and B_opt beside the runs' noise scale and the
CBS probe's reading, on synthetic sweeps (tests/sweeps.py)."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from sweeps import SEQ_LEN, WSD_TARGETS, recorded, write_sweep, wsd_crossing_steps
from toys import probe_reading

from lit_cbs.analysis import read_readings
from lit_cbs.analysis.curves import find_crossings, read_sweep
from lit_cbs.analysis.fits import fit_targets, side_by_side, side_by_side_markdown


def noise_scale_of_loss(loss: float) -> float:
    """A noise scale that grows as the loss falls, as B_simple does in training (samples)."""
    return 100.0 * math.exp(2.0 * (3.6 - loss))


@pytest.mark.slow
def test_side_by_side_lines_up_noise_scale_and_probe_by_the_target_loss(tmp_path):
    sweep = write_sweep(tmp_path / "sweep", gns=noise_scale_of_loss)
    runs = read_sweep(sweep)
    fits, _ = recorded(lambda: fit_targets(find_crossings(runs, WSD_TARGETS, window=None), tokens_per_sample=SEQ_LEN))
    # The run at batch 1000 reaches each target at these tokens; readings at 0.5x, 1.1x and 3x of the
    # first, and one at another batch size.
    reach = {t: float(wsd_crossing_steps(1000 * SEQ_LEN, np.array([t]))[0]) * 1000 * SEQ_LEN for t in WSD_TARGETS}
    readings = [
        probe_reading(reach[3.0] * 0.5, 1000, 2000, batch_size=1000),
        probe_reading(reach[3.0] * 1.1, 2000, 4000, batch_size=1000),
        probe_reading(reach[3.0] * 3.0, 4000, None, batch_size=1000),
        probe_reading(reach[3.0], 777, 1554, batch_size=777),
    ]
    (tmp_path / "cbs_probe.jsonl").write_text("".join(json.dumps(dataclasses.asdict(r)) + "\n" for r in readings))
    probe = read_readings(tmp_path / "cbs_probe.jsonl")
    assert probe == readings
    rows = side_by_side(fits, runs, probe)
    assert [row.target for row in rows] == WSD_TARGETS
    for row, fit in zip(rows, fits):
        assert (row.b_crit, row.b_min, row.b_opt) == (fit.b_crit, fit.b_min, fit.b_opt)
        assert row.b_simple == pytest.approx(noise_scale_of_loss(row.target), rel=0.01)
        assert row.b_simple_runs == len(fit.crossings)
        assert row.probe_run_tokens == pytest.approx(reach[row.target], rel=1e-3)
    assert rows[0].probe == probe[1]  # nearest in log-tokens to where the batch-1000 run reached 3.0
    table = side_by_side_markdown(rows)
    assert "| 3 |" in table and "[2000, 4000] (at " in table and f"{rows[0].b_simple:.3g} (13)" in table
    # A WSD-shaped E(S): the WSD fit is exact, McCandlish's hyperbola is not, and the table says so.
    assert all(row.b_crit_poor and not row.wsd_poor for row in rows)
    assert f"| {rows[0].b_crit:.3g}* | {rows[0].b_min:.3g} | {rows[0].b_opt:.3g} |" in table
    assert "misses the runs by more than 5%" in table
    good = dataclasses.replace(rows[0], b_crit_poor=False)
    assert "*" not in side_by_side_markdown([good]) and "misses" not in side_by_side_markdown([good])

    no_noise_scale = read_sweep(write_sweep(tmp_path / "plain"))
    plain_fits, _ = recorded(
        lambda: fit_targets(find_crossings(no_noise_scale, WSD_TARGETS, window=None), tokens_per_sample=SEQ_LEN)
    )
    (row, *_) = side_by_side(plain_fits, no_noise_scale)
    assert math.isnan(row.b_simple) and row.b_simple_runs == 0 and row.probe is None
