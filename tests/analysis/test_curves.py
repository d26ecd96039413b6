"""lit_cbs.analysis.curves: metrics.csv files read into loss curves over tokens, smoothed, and the steps and
tokens each run needs to reach a target loss, on synthetic sweeps (tests/sweeps.py); bad input named."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
from sweeps import (
    LOSS_GRID,
    SEQ_LEN,
    WSD_BATCHES,
    WSD_TARGETS,
    mccandlish_crossing_steps,
    recorded,
    write_run,
    write_sweep,
    wsd_crossing_steps,
)

from lit_cbs.analysis.curves import default_targets, find_crossings, read_run, read_sweep, rolling_mean
from lit_cbs.analysis.fits import fit_targets


def test_smoothing():
    ramp = np.arange(20.0)
    np.testing.assert_allclose(rolling_mean(ramp, 5)[2:-2], ramp[2:-2])  # centered: no lag on a line
    assert rolling_mean(ramp, 5)[0] == pytest.approx(1.0)  # (0 + 1 + 2) / 3 at the edge
    with pytest.raises(ValueError, match="odd"):
        rolling_mean(ramp, 4)


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
    crossings, messages = recorded(find_crossings, runs, WSD_TARGETS, window=None)
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
    crossings = find_crossings(read_sweep(folder), [3.0], window=21)
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
        assert fit_targets(crossings, SEQ_LEN) == []


def test_sweep_folder_without_runs_is_refused(tmp_path):
    with pytest.raises(ValueError, match="has no subfolders holding a metrics.csv"):
        read_sweep(tmp_path)
    (tmp_path / "r" / "version_0").mkdir(parents=True)
    (tmp_path / "r" / "version_1").mkdir(parents=True)
    for version in ("version_0", "version_1"):
        write_csv(tmp_path / "r" / version / "metrics.csv", HEADER, [[0, 4.0, 100, 1], [1, 3.9, 200, 1]])
    with pytest.raises(ValueError, match="holds 2 metrics.csv files"):
        read_run(tmp_path / "r")
