"""benchmarks/time_to_loss.py at the smallest budget: the time to the target is read off each run's
metrics.csv (held-out loss against fit_seconds), and the table, JSON, plot and markdown say it."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from benchmarks import time_to_loss

BUDGET = 65_536  # 32 evaluations, one every step at batch 16: without the adaptive run's probe, the least it takes


def time_to_loss_from_csv(run_dir: Path, target: float) -> float | None:
    """The wall seconds where the run's held-out loss, each the mean of it and the one before, first reaches
    ``target``, read from its metrics.csv."""
    seconds, losses = {}, {}
    with open(run_dir / "metrics.csv", newline="") as f:
        for row in csv.DictReader(f):
            if row.get("fit_seconds"):
                seconds[int(row["step"])] = float(row["fit_seconds"])
            if row.get("val/loss"):
                losses[int(row["step"])] = float(row["val/loss"])
    raw = [(seconds[step], loss) for step, loss in sorted(losses.items())]
    points = [(t, (before + loss) / 2) for (_, before), (t, loss) in zip(raw, raw[1:])]
    for (t0, l0), (t1, l1) in zip([(None, None), *points], points):
        if l1 <= target:
            return t1 if t0 is None else t0 + (l0 - target) / (l0 - l1) * (t1 - t0)
    return None


def test_time_to_a_loss_is_interpolated_between_evaluations():
    curve = [{"seconds": 10.0, "val_loss": 2.0}, {"seconds": 20.0, "val_loss": 1.0}, {"seconds": 30.0, "val_loss": 0.5}]
    assert time_to_loss.time_to(curve, 1.5) == pytest.approx(15.0)
    assert time_to_loss.time_to(curve, 0.75) == pytest.approx(25.0)
    assert time_to_loss.time_to(curve, 2.5) == 10.0  # the first evaluation is already below
    assert time_to_loss.time_to(curve, 0.4) is None


def test_bad_arguments_and_a_gpu_run_without_a_gpu_are_refused_before_any_run(tmp_path, capsys):
    with pytest.raises(SystemExit):
        time_to_loss.main(["--configs", "warmup,adaptive", "--out", str(tmp_path / "a")])
    assert "with small (the control)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        time_to_loss.main(["--tokens", "131072", "--configs", "small,adaptive", "--out", str(tmp_path / "a")])
    assert "--tokens must be >= 262144 (with adaptive" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            time_to_loss.main(["--gpu", "--out", str(tmp_path / "b")])
        assert "--gpu: no CUDA GPU is visible here" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_the_table_reads_each_runs_time_to_the_small_batchs_final_loss(tmp_path):
    markdown = tmp_path / "RESULTS.md"
    markdown.write_text("# Results\n\nkept\n")
    outcome = time_to_loss.main(
        [
            "--quick",
            "--tokens",
            str(BUDGET),
            "--configs",
            "small,warmup",
            "--out",
            str(tmp_path / "runs"),
            "--markdown",
            str(markdown),
            "--plot",
            str(tmp_path / "time_to_loss.png"),
        ]
    )
    rows, runs = outcome["result"]["rows"], outcome["runs"]
    small_dir = Path(runs["small"][0]["run_dir"])
    with open(small_dir / "metrics.csv", newline="") as f:
        small_losses = [float(row["val/loss"]) for row in csv.DictReader(f) if row.get("val/loss")]
    assert len(small_losses) == time_to_loss.EVALUATIONS
    target = (small_losses[-2] + small_losses[-1]) / 2 + time_to_loss.TARGET_MARGIN
    assert outcome["result"]["targets"] == {1: pytest.approx(target)}
    for key in ("small", "warmup"):
        (run,) = runs[key]
        assert run["tokens"] == BUDGET
        expected = time_to_loss_from_csv(Path(run["run_dir"]), target)  # at this budget the warmup may not reach it
        assert rows[key]["time_to_target"] == [expected if expected is None else pytest.approx(expected)]
    assert rows["small"]["ratio"] == 1.0 and 0 < rows["small"]["time_to_target"][0] <= rows["small"]["fit_seconds"]
    # The warmup grows the micro-batch with the batch: 16 -> 32 -> 64 samples, one micro-batch per step.
    assert sorted(rows["warmup"]["tokens_per_s"]) == [16, 32, 64]
    assert [(c["new"], c["micro_batch_size"], c["accumulate"]) for c in runs["warmup"][0]["batch_changes"]] == [
        (32, 32, 1),
        (64, 64, 1),
    ]
    assert json.loads((tmp_path / "runs" / "time_to_loss.json").read_text())["result"]["rows"]["warmup"][
        "ratio"
    ] == pytest.approx(rows["warmup"]["ratio"])
    assert (tmp_path / "time_to_loss.png").read_bytes()[:4] == b"\x89PNG"
    text = markdown.read_text()
    assert text.startswith("# Results\n\nkept\n")
    section = text.split("<!-- time_to_loss:start -->")[1].split("<!-- time_to_loss:end -->")[0]
    assert f"| small batch (16) | {rows['small']['time_to_target'][0]:.0f} | 1.00 |" in section
    assert "![held-out loss against wall-clock seconds](time_to_loss.png)" in section
