"""lit_cbs.analysis.fits: McCandlish's and the WSD E(S) fitted to (S, E) points and to synthetic sweeps
(tests/sweeps.py), and the batch schedule proposed from the fits."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import yaml
from sweeps import (
    LOSS_REF,
    SEQ_LEN,
    WSD_TARGETS,
    mccandlish_crossing_steps,
    mccandlish_truth,
    recorded,
    write_sweep,
    wsd_truth,
)

from lit_cbs.analysis.curves import find_crossings, read_sweep
from lit_cbs.analysis.fits import (
    fit_mccandlish,
    fit_targets,
    fit_wsd,
    propose_schedule,
    write_schedule_yaml,
)
from lit_cbs.rules.batch_schedules import PiecewiseBatch


def relative_errors(fitted, truth, names) -> dict[str, float]:
    return {name: getattr(fitted, name) / getattr(truth, name) - 1 for name in names}


# ---------------------------------------------------------------------- fits on (S, E) points
def test_fit_mccandlish_recovers_parameters_from_noisy_points():
    rng = np.random.default_rng(0)
    s_min, e_min = 2000.0, 1e8
    steps = np.geomspace(2100, 1e5, 16)
    tokens = e_min * steps / (steps - s_min) * np.exp(0.01 * rng.standard_normal(16))  # 1% noise
    fit = fit_mccandlish(steps, tokens)
    print(
        f"McCandlish (1% noise): S_min {fit.s_min:.1f} (2000), E_min {fit.e_min:.4g} (1e8), "
        f"B_crit {fit.b_crit:.4g} (5e4)"
    )
    assert fit.s_min == pytest.approx(s_min, rel=0.05)
    assert fit.e_min == pytest.approx(e_min, rel=0.05)
    assert fit.b_crit == pytest.approx(e_min / s_min, rel=0.05)


WSD_IDENTIFIED = ["s_min", "s_opt", "e_min", "a_1", "a_0", "b_opt"]


def test_fit_wsd_recovers_parameters_from_noisy_points():
    # 0.5% noise. S_min, S_opt, E_min, A_1 (B_min), A_0 and B_opt come back within 5%; the breakpoints
    # S_1, S_2 and the amplitudes B_-1, C are weakly determined by noisy data near a smooth junction.
    rng = np.random.default_rng(0)
    truth = wsd_truth(LOSS_REF)
    steps = np.geomspace(105, 3000, 24)
    tokens = truth.tokens(steps) * np.exp(0.005 * rng.standard_normal(24))
    fit = fit_wsd(steps, tokens)
    errors = relative_errors(fit, truth, WSD_IDENTIFIED)
    print("WSD (0.5% noise) relative errors: " + ", ".join(f"{k} {v:+.4f}" for k, v in errors.items()))
    assert all(abs(e) < 0.05 for e in errors.values()), errors
    assert sum(fit.points_per_segment) == 24 and min(fit.points_per_segment) >= 2


def test_fit_wsd_recovers_every_parameter_without_noise():
    truth = wsd_truth(2.9)
    steps = np.geomspace(truth.s_min * 1.05, truth.s_2 * 4, 20)
    fit = fit_wsd(steps, truth.tokens(steps))
    names = ["s_min", "b_minus1", "b_0", "s_1", "c", "s_opt", "e_min", "s_2", "a_1", "a_0"]
    errors = relative_errors(fit, truth, names)
    assert all(abs(e) < 1e-3 for e in errors.values()), errors
    assert fit.rms_log_residual < 1e-6


def test_fit_wsd_survives_the_pole_reaching_the_first_run():
    # Crossings of a real 131k-token tiny sweep (target 4.95): the best S_min approaches the smallest
    # S, where the hyperbola's pole would divide by zero. The fit must stay finite (and be poor).
    steps = [7.0663, 6.007, 5.1997, 3.9858, 3.2094, 2.4869, 2.0259, 3.6863]
    tokens = [7235.9, 9226.7, 10649.0, 12244.3, 13145.7, 15279.5, 16596.3, 45297.3]
    fit = fit_wsd(steps, tokens)
    assert 0 < fit.s_min < min(steps) and np.isfinite(fit.e_min) and np.isfinite(fit.b_opt)
    assert fit.rms_log_residual > 0.05


def test_fits_refuse_too_few_or_bad_points():
    with pytest.raises(ValueError, match="fit_mccandlish needs at least 3 runs reaching the target loss, got 2"):
        fit_mccandlish([100, 200], [1e6, 8e5])
    with pytest.raises(ValueError, match="fit_wsd needs at least 8 runs reaching the target loss, got 7"):
        fit_wsd(np.arange(1, 8) * 100.0, np.full(7, 1e6))
    with pytest.raises(ValueError, match="finite and > 0"):
        fit_mccandlish([100, 200, np.nan], [1e6, 8e5, 7e5])
    with pytest.raises(ValueError, match="equal length"):
        fit_mccandlish([100, 200, 300], [1e6, 8e5])


# ---------------------------------------------------------------------- fits per target loss of a sweep
def test_sweep_pipeline_recovers_b_min_and_b_opt_per_target(wsd_fits):
    fits, messages = wsd_fits  # find_crossings on the unsmoothed sweep, then fit_targets in samples
    # Loss curves that cross make E(S) non-monotone, which McCandlish's hyperbola cannot follow.
    assert len(messages) == 3 and all("McCandlish's E(S) misses the runs" in m for m in messages)
    assert [fit.target for fit in fits] == WSD_TARGETS
    for fit in fits:
        truth = wsd_truth(fit.target)
        errors = relative_errors(fit.wsd, truth, WSD_IDENTIFIED)
        print(
            f"target {fit.target}: B_min {fit.b_min:.1f} (true {truth.b_min / SEQ_LEN:.1f}), B_opt {fit.b_opt:.1f} "
            f"(true {truth.b_opt / SEQ_LEN:.1f}) samples; B_crit {fit.b_crit:.1f}; parts {fit.wsd.points_per_segment}"
        )
        assert all(abs(e) < 0.05 for e in errors.values()), (fit.target, errors)
    assert fits[0].b_opt < fits[1].b_opt < fits[2].b_opt  # B_opt grows as the target loss falls
    assert fits[0].b_min < fits[1].b_min < fits[2].b_min


def test_mccandlish_sweep_pipeline_recovers_b_crit(tmp_path):
    batches = [500, 700, 1000, 1500, 2000, 4000, 8000, 16000]
    runs = read_sweep(write_sweep(tmp_path, batches, mccandlish_crossing_steps))
    fits, messages = recorded(fit_targets, find_crossings(runs, [3.0, 2.8], window=None), tokens_per_sample=SEQ_LEN)
    # A monotone hyperbola has no quadratic or linear part: the WSD fit says B_min and B_opt are poorly determined.
    assert len(messages) == 2 and all(
        "the WSD fit has fewer than 2 runs in its quadratic and linear part(s)" in m for m in messages
    )
    for fit in fits:
        s_min, e_min = mccandlish_truth(fit.target)
        print(f"target {fit.target}: B_crit {fit.b_crit:.1f} samples (true {e_min / s_min / SEQ_LEN:.1f})")
        assert fit.mccandlish.s_min == pytest.approx(s_min, rel=0.05)
        assert fit.mccandlish.e_min == pytest.approx(e_min, rel=0.05)
        assert fit.b_crit == pytest.approx(e_min / s_min / SEQ_LEN, rel=0.05)


def test_fewer_than_three_runs_is_named_and_left_out(wsd_sweep):
    runs = read_sweep(wsd_sweep)[-2:]
    crossings = find_crossings(runs, [3.0], window=None)
    with pytest.warns(UserWarning, match=r"target loss 3: only 2 runs reach it \(11_es_b5000 .*, 12_es_b10000 .*\)"):
        assert fit_targets(crossings, SEQ_LEN) == []


def test_too_few_runs_for_the_wsd_fit_keep_mccandlish(wsd_sweep):
    runs = read_sweep(wsd_sweep)[-5:]
    (fit,), messages = recorded(fit_targets, find_crossings(runs, [3.0], window=None), tokens_per_sample=SEQ_LEN)
    assert any(re.match("target loss 3: 5 runs reach it .* needs at least 8 runs", m) for m in messages)
    assert fit.wsd is None and math.isnan(fit.b_opt) and fit.b_crit > 0
    with pytest.raises(ValueError, match="no target loss has a WSD fit"):
        propose_schedule([fit])


# ---------------------------------------------------------------------- schedule and YAML
def test_proposed_schedule_follows_b_opt_and_instantiates_from_yaml(wsd_fits, tmp_path):
    fits, _ = wsd_fits
    schedule = propose_schedule(fits, multiple_of=8)
    assert schedule.unit == "tokens"
    assert schedule.batch_sizes == [int(round(f.b_opt / 8)) * 8 for f in fits]
    assert schedule.thresholds == [0] + [int(round(f.wsd.e_min)) for f in fits[:-1]]
    path = write_schedule_yaml(schedule, tmp_path / "schedule.yaml", comment="from a test")
    text = path.read_text()
    assert text.startswith("# @package _global_\n# from a test\n")
    config = yaml.safe_load(text)
    from hydra.utils import instantiate

    rebuilt = instantiate(config["batch"]["schedule"])
    assert isinstance(rebuilt, PiecewiseBatch)
    assert (rebuilt.batch_sizes, rebuilt.thresholds, rebuilt.unit) == (
        schedule.batch_sizes,
        schedule.thresholds,
        "tokens",
    )
    assert write_schedule_yaml(schedule, tmp_path / "plain.yaml").read_text() == text.replace("# from a test\n", "")


def test_schedule_never_shrinks_and_merges_equal_sizes(wsd_fits):
    fits, _ = wsd_fits
    schedule = propose_schedule(fits, multiple_of=4096)  # every B_opt rounds to 4096 (min: one multiple)
    assert schedule.batch_sizes == [4096] and schedule.thresholds == [0]
