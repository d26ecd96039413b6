"""lit_cbs.analysis and recipes/fit_es.py on synthetic sweeps whose E(S) is known exactly.

A synthetic sweep is a Hydra-multirun-like folder of constant-batch runs, each with a
CSVLogger-style metrics.csv. Its loss curves are built backwards from a known E(S) per target
loss: the run with a batch of b tokens per step reaches loss l at the step S where E_l(S) / S = b
(E_l(S) / S, the batch size along the curve, falls monotonically from infinity at S_min to B_min).
The WSD family scales one base curve of Zhou et al.'s shape (Zhou et al. 2026):
E_l(S) = kappa(l) E_base(S / sigma(l)), so S_min, S_opt scale with sigma, E_min with kappa and
B_min, B_opt with kappa / sigma. The McCandlish family has S = S_min(l) + E_min(l) / b
(McCandlish et al. 2018's (S / S_min - 1)(E / E_min - 1) = 1 solved for S at E = b S).
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import json
import math
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import yaml

from lit_cbs.analysis import (
    default_targets,
    ema,
    find_crossings,
    fit_mccandlish,
    fit_targets,
    fit_wsd,
    plot_batch_sizes,
    plot_es,
    propose_schedule,
    read_probe,
    read_run,
    read_sweep,
    rolling_mean,
    schedule_yaml,
    side_by_side,
    side_by_side_markdown,
    smooth,
    write_schedule_yaml,
)
from lit_cbs.analysis.fits import WSDFit
from lit_cbs.rules.batch_schedules import PiecewiseBatch

REPO = Path(__file__).resolve().parents[2]
SEQ_LEN = 100  # tokens per sample
MAX_STEPS = 10_000
LOSS_GRID = np.linspace(3.6, 2.4, 1201)  # the losses each synthetic curve passes through, 0.001 apart

# Base E(S) of Zhou et al.'s shape, continuous at S_1 and S_2: B_opt = E_min / S_opt = 1e5 and
# B_min = A_1 = 4e4 tokens per step (1000 and 400 samples of SEQ_LEN tokens).
BASE = WSDFit(
    s_min=100.0,
    b_minus1=3e8,
    b_0=4e7,
    s_1=200.0,
    c=75.0,
    s_opt=400.0,
    e_min=4e7,
    s_2=800.0,
    a_1=4e4,
    a_0=2e7,
    points_per_segment=(0, 0, 0),
    rms_log_residual=0.0,
)
LOSS_REF, KAPPA, SIGMA = 3.0, 1.5, 0.5  # kappa(l) = exp(KAPPA (LOSS_REF - l)), sigma(l) = exp(SIGMA (LOSS_REF - l))
WSD_BATCHES = [450, 520, 600, 700, 800, 900, 1000, 1200, 1500, 2000, 3000, 5000, 10000]  # samples
WSD_TARGETS = [3.0, 2.9, 2.8]


def wsd_truth(loss: float) -> WSDFit:
    """The WSD parameters of the target ``loss`` in the synthetic family."""
    kappa, sigma = math.exp(KAPPA * (LOSS_REF - loss)), math.exp(SIGMA * (LOSS_REF - loss))
    return WSDFit(
        s_min=BASE.s_min * sigma,
        b_minus1=BASE.b_minus1 * kappa * sigma,
        b_0=BASE.b_0 * kappa,
        s_1=BASE.s_1 * sigma,
        c=BASE.c * kappa / sigma**2,
        s_opt=BASE.s_opt * sigma,
        e_min=BASE.e_min * kappa,
        s_2=BASE.s_2 * sigma,
        a_1=BASE.a_1 * kappa / sigma,
        a_0=BASE.a_0 * kappa,
        points_per_segment=(0, 0, 0),
        rms_log_residual=0.0,
    )


_BASE_STEPS = np.geomspace(BASE.s_min * (1 + 1e-9), 1e8, 200_000)
_BASE_BATCH = BASE.tokens(_BASE_STEPS) / _BASE_STEPS  # decreasing from ~inf to B_min


def wsd_crossing_steps(tokens_per_step: float, losses: np.ndarray) -> np.ndarray:
    """Steps at which the run with this batch (tokens per step) reaches each loss; inf where it never does."""
    kappa, sigma = np.exp(KAPPA * (LOSS_REF - losses)), np.exp(SIGMA * (LOSS_REF - losses))
    base_batch = tokens_per_step * sigma / kappa
    base_steps = np.interp(base_batch, _BASE_BATCH[::-1], _BASE_STEPS[::-1], left=np.inf, right=np.nan)
    return np.where(base_batch > BASE.a_1, sigma * base_steps, np.inf)


def mccandlish_truth(loss: float) -> tuple[float, float]:
    """(S_min steps, E_min tokens) of the McCandlish family at ``loss``: B_crit = 4e5 tokens at loss 3, growing."""
    u = LOSS_REF - loss
    return 50.0 * math.exp(0.5 * u), 2e7 * math.exp(1.5 * u)


def mccandlish_crossing_steps(tokens_per_step: float, losses: np.ndarray) -> np.ndarray:
    s_min, e_min = np.vectorize(mccandlish_truth)(losses)
    return s_min + e_min / tokens_per_step


def write_run(folder: Path, batch_size: int, crossing_steps, *, seq_len=SEQ_LEN, gns=None, lowest_target=2.8, val_every=50):
    """A CSVLogger-style metrics.csv: Lightning logs row ``step`` = s - 1 with the tokens seen after s steps."""
    tokens_per_step = batch_size * seq_len
    reach = crossing_steps(tokens_per_step, LOSS_GRID)
    finite = np.isfinite(reach)
    end = reach[np.searchsorted(-LOSS_GRID, -lowest_target)]
    last_step = MAX_STEPS if not np.isfinite(end) else min(MAX_STEPS, int(end * 1.3) + 20)
    steps = np.arange(1, last_step + 1)
    loss = np.interp(steps, reach[finite], LOSS_GRID[finite], left=LOSS_GRID[0], right=LOSS_GRID[finite][-1])
    folder.mkdir(parents=True)
    (folder / ".hydra").mkdir()
    (folder / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"batch.schedule.batch_size={batch_size}"]))
    with open(folder / "metrics.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["epoch", "step", "train/loss", "tokens_seen", "batch/global_size", "gns/b_simple", "val/loss"])
        for s, value in zip(steps, loss):
            gns_cell = (gns(value) if callable(gns) else gns) if gns is not None and s % 10 == 0 else ""
            writer.writerow([0, s - 1, value, tokens_per_step * s, batch_size, gns_cell, ""])
            if s % val_every == 0:
                writer.writerow([0, s - 1, "", "", "", "", value])
    return folder


def write_sweep(root: Path, batches=WSD_BATCHES, crossing_steps=wsd_crossing_steps, **kwargs) -> Path:
    for i, batch in enumerate(batches):
        write_run(root / f"{i}_es_b{batch}", batch, crossing_steps, **kwargs)
    return root


@pytest.fixture(scope="module")
def wsd_sweep(tmp_path_factory) -> Path:
    return write_sweep(tmp_path_factory.mktemp("wsd_sweep"), gns=250.0)


def recorded(call, *args, **kwargs):
    """``call``'s result and the messages of every warning it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call(*args, **kwargs)
    return result, [str(w.message) for w in caught]


def relative_errors(fitted, truth, names) -> dict[str, float]:
    return {name: getattr(fitted, name) / getattr(truth, name) - 1 for name in names}


# ---------------------------------------------------------------------- fits on (S, E) points
def test_fit_mccandlish_recovers_parameters_from_noisy_points():
    rng = np.random.default_rng(0)
    s_min, e_min = 2000.0, 1e8
    steps = np.geomspace(2100, 1e5, 16)
    tokens = e_min * steps / (steps - s_min) * np.exp(0.01 * rng.standard_normal(16))  # 1% noise
    fit = fit_mccandlish(steps, tokens)
    print(f"McCandlish (1% noise): S_min {fit.s_min:.1f} (2000), E_min {fit.e_min:.4g} (1e8), B_crit {fit.b_crit:.4g} (5e4)")
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


# ---------------------------------------------------------------------- curves
def test_smoothing():
    ramp = np.arange(20.0)
    np.testing.assert_allclose(rolling_mean(ramp, 5)[2:-2], ramp[2:-2])  # centered: no lag on a line
    assert rolling_mean(ramp, 5)[0] == pytest.approx(1.0)  # (0 + 1 + 2) / 3 at the edge
    np.testing.assert_allclose(ema(np.full(5, 2.0), 0.9), 2.0)
    assert ema(np.array([0.0, 1.0]), 0.75)[1] == pytest.approx(0.25)
    np.testing.assert_array_equal(smooth(ramp, None), ramp)
    with pytest.raises(ValueError, match="odd"):
        rolling_mean(ramp, 4)
    with pytest.raises(ValueError, match="smoothing method='median'"):
        smooth(ramp, "median")


def test_read_sweep_finds_runs_in_order_with_labels_and_units(wsd_sweep):
    runs = read_sweep(wsd_sweep)
    assert [run.batch_size for run in runs] == WSD_BATCHES
    assert runs[0].name == "0_es_b450 (batch.schedule.batch_size=450)"
    for run, batch in zip(runs, WSD_BATCHES):
        assert run.tokens_per_step == batch * SEQ_LEN and run.tokens_per_sample == SEQ_LEN
        np.testing.assert_allclose(run.tokens / run.steps, batch * SEQ_LEN)
        assert run.gns.size and np.all(run.gns == 250.0)


def test_val_loss_rows_get_tokens_from_their_step(wsd_sweep):
    run_folder = wsd_sweep / "6_es_b1000"
    train = read_run(run_folder)
    val = read_run(run_folder / "metrics.csv", loss_column="val/loss")
    assert len(val.loss) == len(train.loss) // 50
    # The val row logged with step s - 1 belongs to the train row with tokens_seen = b * s.
    index = np.searchsorted(train.tokens, val.tokens)
    np.testing.assert_allclose(train.tokens[index], val.tokens)
    np.testing.assert_allclose(train.loss[index], val.loss)


def test_crossings_match_the_generating_curves_and_name_runs_that_never_reach(wsd_sweep):
    runs = read_sweep(wsd_sweep)
    crossings, messages = recorded(find_crossings, runs, WSD_TARGETS, smoothing=None)
    assert [m.split(" (batch")[0] for m in messages] == [
        "target loss 2.9: left out runs that never reach it: 0_es_b450",
        "target loss 2.8: left out runs that never reach it: 0_es_b450",
    ]
    assert len(crossings[3.0]) == 13 and len(crossings[2.9]) == 12 and len(crossings[2.8]) == 12
    for target, points in crossings.items():
        for point in points:
            expected = wsd_crossing_steps(point.tokens_per_step, np.array([target]))[0]
            assert point.steps == pytest.approx(expected, rel=0.01, abs=1.0)
            assert point.tokens == pytest.approx(point.steps * point.batch_size * SEQ_LEN)


def test_sweep_pipeline_recovers_b_min_and_b_opt_per_target(wsd_sweep):
    runs = read_sweep(wsd_sweep)
    crossings, _ = recorded(find_crossings, runs, WSD_TARGETS, smoothing=None)
    fits, messages = recorded(fit_targets, crossings, tokens_per_sample=SEQ_LEN)
    # Loss curves that cross make E(S) non-monotone, which McCandlish's hyperbola cannot follow.
    assert len(messages) == 3 and all("McCandlish's E(S) misses the runs" in m for m in messages)
    assert [fit.target for fit in fits] == WSD_TARGETS and fits[0].unit == "samples"
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
    fits, messages = recorded(fit_targets, find_crossings(runs, [3.0, 2.8], smoothing=None), tokens_per_sample=SEQ_LEN)
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


def test_smoothed_noisy_curves_still_give_the_crossings(tmp_path):
    batches = [500, 1000, 2000, 4000]
    folder = write_sweep(tmp_path, batches, mccandlish_crossing_steps)
    rng = np.random.default_rng(0)
    for run_folder in folder.iterdir():
        path = run_folder / "metrics.csv"
        rows = list(csv.DictReader(path.read_text().splitlines()))
        for row in rows:
            if row["train/loss"]:
                row["train/loss"] = str(float(row["train/loss"]) + 0.003 * rng.standard_normal())
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    crossings = find_crossings(read_sweep(folder), [3.0], smoothing="rolling", window=21)
    for point in crossings[3.0]:
        expected = mccandlish_crossing_steps(point.tokens_per_step, np.array([3.0]))[0]
        assert point.steps == pytest.approx(expected, rel=0.03)


def test_default_targets_lie_between_start_and_what_most_runs_reach(wsd_sweep):
    runs = read_sweep(wsd_sweep)
    targets = default_targets(runs, count=4, min_runs=8)
    assert len(targets) == 4 and targets == sorted(targets, reverse=True)
    assert targets[0] < LOSS_GRID[0] and sum(run.loss.min() <= targets[-1] for run in runs) >= 8


# ---------------------------------------------------------------------- bad input
def write_csv(path: Path, header: list[str], rows: list[list]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return path


HEADER = ["step", "train/loss", "tokens_seen", "batch/global_size"]


def test_metrics_csv_reader_pairs_each_value_with_its_own_row_step(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    from lit_cbs.analysis.curves import read_metrics_csv

    logger = CSVLogger(tmp_path, name="run")
    for step in range(3):  # two logging calls per step, as BatchWarmup and the LightningModule make
        logger.log_metrics({"train/loss": 4.0 - step}, step=step)
        logger.log_metrics({"tokens_seen": 100 * (step + 1), "batch/global_size": 1}, step=step)
    logger.log_metrics({"val/loss": 3.5, "epoch": 0}, step=2)
    logger.save()
    series = read_metrics_csv(Path(logger.log_dir) / "metrics.csv")
    assert set(series) == {"train/loss", "tokens_seen", "batch/global_size", "val/loss"}  # no epoch
    assert [a.tolist() for a in series["tokens_seen"]] == [[0, 1, 2], [100, 200, 300]]
    assert [a.tolist() for a in series["val/loss"]] == [[2], [3.5]]
    not_a_log = write_csv(tmp_path / "other.csv", ["iteration", "loss"], [[0, 1.0]])
    with pytest.raises(ValueError, match="has no 'step' column"):
        read_metrics_csv(not_a_log)


def test_nan_token_count_is_refused_naming_the_run(tmp_path):
    path = write_csv(tmp_path / "b16" / "metrics.csv", HEADER, [[0, 4.0, 100, 1], [1, 3.9, "nan", 1], [2, 3.8, 300, 1]])
    with pytest.raises(ValueError, match="run b16: tokens_seen=nan at step=1"):
        read_run(path.parent)


def test_decreasing_token_count_is_refused_naming_the_run(tmp_path):
    path = write_csv(tmp_path / "b16" / "metrics.csv", HEADER, [[0, 4.0, 100, 1], [1, 3.9, 200, 1], [0, 4.0, 100, 1]])
    with pytest.raises(ValueError, match="run b16: tokens_seen decreases from 200 to 100 at step 0"):
        read_run(path.parent)


def test_changing_batch_is_refused(tmp_path):
    path = write_csv(tmp_path / "warm" / "metrics.csv", HEADER, [[0, 4.0, 100, 1], [1, 3.9, 200, 1], [2, 3.8, 400, 2]])
    with pytest.raises(ValueError, match="run warm is not a constant-batch run: tokens per step range from 100 to 200"):
        read_run(path.parent)


def test_missing_column_names_the_column_and_the_argument(tmp_path):
    path = write_csv(tmp_path / "r" / "metrics.csv", ["step", "loss", "tokens_seen"], [[0, 4.0, 100], [1, 3.9, 200]])
    with pytest.raises(ValueError, match="run r: .* has no 'train/loss' column .* pass loss_column=..."):
        read_run(path.parent)


def test_nan_loss_ends_the_curve_with_a_warning(tmp_path):
    rows = [[0, 4.0, 100, 1], [1, 3.9, 200, 1], [2, "nan", 300, 1], [3, 3.7, 400, 1]]
    path = write_csv(tmp_path / "div" / "metrics.csv", HEADER, rows)
    with pytest.warns(UserWarning, match="run div: train/loss is nan from step 2 on"):
        run = read_run(path.parent)
    np.testing.assert_array_equal(run.loss, [4.0, 3.9])


def test_mismatched_units_between_runs_are_refused(tmp_path):
    write_run(tmp_path / "0_a", 1000, mccandlish_crossing_steps, lowest_target=3.0)
    write_run(tmp_path / "1_b", 1000, mccandlish_crossing_steps, seq_len=1, lowest_target=3.0)
    with pytest.raises(ValueError, match=r"mismatched units: tokens per sample .* \(0_a: 100, 1_b: 1\)"):
        read_sweep(tmp_path)


def test_target_no_run_reaches_is_named(wsd_sweep):
    runs = read_sweep(wsd_sweep)[:3]
    with pytest.warns(UserWarning, match=r"target loss 1.5: no run reaches it: 0_es_b450 .*lowest smoothed loss"):
        crossings = find_crossings(runs, [1.5])
    with pytest.warns(UserWarning, match=r"target loss 1.5: only 0 runs reach it \(none\)"):
        assert fit_targets(crossings) == []


def test_fewer_than_three_runs_is_named_and_left_out(wsd_sweep):
    runs = read_sweep(wsd_sweep)[-2:]
    crossings = find_crossings(runs, [3.0], smoothing=None)
    with pytest.warns(UserWarning, match=r"target loss 3: only 2 runs reach it \(11_es_b5000 .*, 12_es_b10000 .*\)"):
        assert fit_targets(crossings) == []


def test_too_few_runs_for_the_wsd_fit_keep_mccandlish(wsd_sweep):
    runs = read_sweep(wsd_sweep)[-5:]
    (fit,), messages = recorded(fit_targets, find_crossings(runs, [3.0], smoothing=None), tokens_per_sample=SEQ_LEN)
    assert any(re.match("target loss 3: 5 runs reach it .* needs at least 8 runs", m) for m in messages)
    assert fit.wsd is None and math.isnan(fit.b_opt) and fit.b_crit > 0
    with pytest.raises(ValueError, match="no target loss has a WSD fit"):
        propose_schedule([fit])


def test_bad_probe_line_is_named(tmp_path):
    path = tmp_path / "cbs_probe.jsonl"
    path.write_text(json.dumps({"tokens": 10, "cbs_lower": 4, "cbs_upper": 8, "cbs_estimate": 5.7}) + '\n{"tokens": 5}\n')
    with pytest.raises(ValueError, match=r"cbs_probe.jsonl: record 2 is not a CBS probe record"):
        read_probe(path)


def test_sweep_folder_without_runs_is_refused(tmp_path):
    with pytest.raises(ValueError, match="has no subfolders holding a metrics.csv"):
        read_sweep(tmp_path)
    (tmp_path / "r" / "version_0").mkdir(parents=True)
    (tmp_path / "r" / "version_1").mkdir(parents=True)
    for version in ("version_0", "version_1"):
        write_csv(tmp_path / "r" / version / "metrics.csv", HEADER, [[0, 4.0, 100, 1], [1, 3.9, 200, 1]])
    with pytest.raises(ValueError, match="holds 2 metrics.csv files"):
        read_run(tmp_path / "r")


# ---------------------------------------------------------------------- schedule, YAML, plots
def test_proposed_schedule_follows_b_opt_and_instantiates_from_yaml(wsd_sweep, tmp_path):
    runs = read_sweep(wsd_sweep)
    fits, _ = recorded(lambda: fit_targets(find_crossings(runs, WSD_TARGETS, smoothing=None), tokens_per_sample=SEQ_LEN))
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
    assert (rebuilt.batch_sizes, rebuilt.thresholds, rebuilt.unit) == (schedule.batch_sizes, schedule.thresholds, "tokens")
    assert schedule_yaml(schedule) == text.replace("# from a test\n", "")


def test_schedule_never_shrinks_and_merges_equal_sizes(wsd_sweep):
    runs = read_sweep(wsd_sweep)
    fits, _ = recorded(lambda: fit_targets(find_crossings(runs, WSD_TARGETS, smoothing=None), tokens_per_sample=SEQ_LEN))
    schedule = propose_schedule(fits, multiple_of=4096)  # every B_opt rounds to 4096 (min: one multiple)
    assert schedule.batch_sizes == [4096] and schedule.thresholds == [0]


def test_plots_are_written_as_png(wsd_sweep, tmp_path):
    runs = read_sweep(wsd_sweep)
    fits, _ = recorded(lambda: fit_targets(find_crossings(runs, WSD_TARGETS, smoothing=None), tokens_per_sample=SEQ_LEN))
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


def noise_scale_of_loss(loss: float) -> float:
    """A noise scale that grows as the loss falls, as B_simple does in training (samples)."""
    return 100.0 * math.exp(2.0 * (3.6 - loss))


def test_side_by_side_lines_up_noise_scale_and_probe_by_the_target_loss(tmp_path):
    sweep = write_sweep(tmp_path / "sweep", gns=noise_scale_of_loss)
    runs = read_sweep(sweep)
    fits, _ = recorded(lambda: fit_targets(find_crossings(runs, WSD_TARGETS, smoothing=None), tokens_per_sample=SEQ_LEN))
    # The run at batch 1000 reaches each target at these tokens; readings at 0.5x, 1.1x and 3x of the
    # first, one at another batch size and one without a batch size.
    reach = {t: float(wsd_crossing_steps(1000 * SEQ_LEN, np.array([t]))[0]) * 1000 * SEQ_LEN for t in WSD_TARGETS}
    records = [
        {"tokens": reach[3.0] * 0.5, "batch_size": 1000, "cbs_lower": 1000, "cbs_upper": 2000, "cbs_estimate": 1414.0},
        {"tokens": reach[3.0] * 1.1, "batch_size": 1000, "cbs_lower": 2000, "cbs_upper": 4000, "cbs_estimate": 2828.0},
        {"tokens": reach[3.0] * 3.0, "batch_size": 1000, "cbs_lower": 4000, "cbs_upper": None, "cbs_estimate": 4000.0},
        {"tokens": reach[3.0], "batch_size": 777, "cbs_lower": 1, "cbs_upper": 2, "cbs_estimate": 1.4},
        {"tokens": reach[3.0], "cbs_lower": 1, "cbs_upper": 2, "cbs_estimate": 1.4},
    ]
    (tmp_path / "cbs_probe.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    probe = read_probe(tmp_path / "cbs_probe.jsonl")
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

    token_fits, _ = recorded(lambda: fit_targets(find_crossings(runs, WSD_TARGETS, smoothing=None), tokens_per_sample=None))
    with pytest.raises(ValueError, match="mismatched units"):
        side_by_side(token_fits, runs, probe)
    no_noise_scale = read_sweep(write_sweep(tmp_path / "plain"))
    plain_fits, _ = recorded(
        lambda: fit_targets(find_crossings(no_noise_scale, WSD_TARGETS, smoothing=None), tokens_per_sample=SEQ_LEN)
    )
    (row, *_) = side_by_side(plain_fits, no_noise_scale)
    assert math.isnan(row.b_simple) and row.b_simple_runs == 0 and row.probe is None


# ---------------------------------------------------------------------- recipes/fit_es.py
def run_fit_es(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "recipes" / "fit_es.py"), *map(str, args)], capture_output=True, text=True, timeout=300
    )


def test_fit_es_cli_prints_the_table_and_writes_plots_and_schedule(wsd_sweep, tmp_path):
    probe = tmp_path / "cbs_probe.jsonl"
    probe.write_text(json.dumps({"tokens": 1e6, "cbs_lower": 256, "cbs_upper": 512, "cbs_estimate": 362.0}) + "\n")
    out = tmp_path / "out"
    result = run_fit_es(
        wsd_sweep, "--targets", *WSD_TARGETS, "--smoothing", "none", "--out", out, "--probe", probe, "--multiple-of", 8
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.strip().startswith("target loss"))
    assert "B_crit" in lines[header] and "B_min" in lines[header] and "B_opt" in lines[header] and "samples" in lines[header]
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


def test_fit_es_reports_bad_input_in_one_line(tmp_path, capsys):
    # In-process (the subprocess test above covers the entry point): main() returns the exit status.
    spec = importlib.util.spec_from_file_location("fit_es", REPO / "recipes" / "fit_es.py")
    fit_es = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fit_es)
    assert fit_es.main([str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err == f"fit_es.py: sweep folder {tmp_path / 'missing'} does not exist\n"
    write_run(tmp_path / "sweep" / "0_a", 1000, mccandlish_crossing_steps, lowest_target=3.0)
    write_run(tmp_path / "sweep" / "1_b", 2000, mccandlish_crossing_steps, lowest_target=3.0)
    with pytest.warns(UserWarning, match="only 2 runs reach it"):
        assert fit_es.main([str(tmp_path / "sweep"), "--targets", "3.0"]) == 2
    assert "no target loss in ['3'] is reached by at least 3 runs" in capsys.readouterr().err
