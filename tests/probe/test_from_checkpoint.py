"""The CBS of a saved checkpoint (lit_cbs/probe/from_checkpoint.py, recipes/probe.py): a reading taken from the
checkpoint at step S equals the in-process probe's reading at the probe point that starts at S, branch for branch;
a folder of checkpoints gives the curve; bad input is refused in one line before any branch trains."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from launch import run_forked
from omegaconf import OmegaConf
from recipe_runs import ROOT, compose_config
from recipe_runs import train as train_script
from torch.utils.data import DataLoader

from lit_cbs.errors import LitCBSConfigError
from lit_cbs.probe import probe_checkpoint
from lit_cbs.run import job

pytestmark = pytest.mark.slow
# A recipe run of 8 optimizer steps of 128-token samples (batch 8, then 16 from 4,096 tokens), a checkpoint at every
# step but inside a probe's window, and probes (k = 1, 2 by bisection, held-out scores) over 4,096-token windows
# from 2,048 tokens (after step 2, through steps 3-5: the batch grows inside it, so k = 1 trains as a branch) and
# from 8,192 tokens (after step 6, steps 7-8: the main run's window is k = 1's).
RUN = [
    "data.batch_size=4",
    "batch.schedule.batch_sizes=[8,16]",
    "batch.schedule.thresholds=[0,4096]",
    "max_tokens=12288",
    "lr_schedule.warmup_tokens=1024",
    "val_check_tokens=4096",
    "callbacks.checkpoint.every_n_train_steps=1",
    "trainer.enable_progress_bar=false",
    "callbacks.progress_bar=null",
    "callbacks.cbs_probe.geometric=[2048,4.0]",
    "callbacks.cbs_probe.window_tokens=4096",
    "callbacks.cbs_probe.multipliers=[1,2]",
    "callbacks.cbs_probe.heldout_batches=2",
    "data.val_fraction=0.1",
    "plots=false",
]


@pytest.fixture(scope="module")
def probed_run(tmp_path_factory, prepared) -> Path:
    """The run trained with its in-process probe; its folder holds resolved_config.yaml, checkpoints and readings."""
    run_dir = tmp_path_factory.mktemp("run")
    cfg = compose_config(*RUN, f"data.path={prepared}", output_dir=str(run_dir))
    pl.seed_everything(cfg.seed, workers=True)
    run = train_script.build_run(cfg)
    (run_dir / "resolved_config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    run.trainer.fit(run.model, datamodule=run.datamodule)
    return run_dir


def in_process_readings(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "cbs_probe.jsonl").read_text().splitlines()]


def run_config(run_dir: Path):
    return OmegaConf.load(run_dir / "resolved_config.yaml")


def test_a_checkpoints_reading_equals_the_in_process_one_at_its_step(probed_run):
    first, second = in_process_readings(probed_run)
    assert (first["step"], second["step"]) == (2, 6) and first["batch_size"] == 8 and second["batch_size"] == 16
    cfg = run_config(probed_run)
    settings = dict(multipliers=(1, 2), window_tokens=4096, epsilon=0.02, evaluate="heldout", heldout_batches=2,
                    search="bisect")  # fmt: skip
    for expected in (first, second):
        pl.seed_everything(cfg.seed, workers=True)
        checkpoint = probed_run / "checkpoints" / f"step{expected['step']:07d}.ckpt"
        reading = probe_checkpoint(checkpoint, job.probe_parts(cfg), **settings)
        assert (reading.tokens, reading.step, reading.batch_size, reading.mode) == (
            expected["tokens"], expected["step"], expected["batch_size"], "checkpoint"
        )  # fmt: skip
        # k = 1 trains as a branch here: its held-out losses are the main run's over that window, bit for bit.
        assert reading.batch_losses == expected["batch_losses"] and reading.losses == expected["losses"]
        assert reading.bracket == f"[{expected['cbs_lower']:g}, {expected['cbs_upper']:g}]" + (
            "" if expected["determined"] else " (undetermined)"
        )
        assert (reading.k_star, reading.determined, reading.loss_se) == (
            expected["k_star"], expected["determined"], expected["loss_se"]
        )  # fmt: skip
        # In process k = 1 is the main run's window unless the batch changed inside it; here it always trains.
        assert reading.branches_trained == [1.0] + [k for k in expected["branches_trained"] if k != 1.0]


def test_recipes_probe_py_reads_a_folder_of_checkpoints_and_draws_the_curve(probed_run, tmp_path):
    out = tmp_path / "probes"
    result = run_forked(
        ROOT / "recipes" / "probe.py", f"ckpt_path={probed_run / 'checkpoints'}", "probe.multipliers=[1,2]",
        "window_fraction=1.0", f"hydra.run.dir={out}", capture_output=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    readings = [json.loads(line) for line in (out / "cbs_probe.jsonl").read_text().splitlines()]
    assert [r["step"] for r in readings] == [1, 2, 5, 6, 8]  # every checkpoint (none inside a window), in order
    # Each window as many tokens as the checkpoint holds (at least the run's callbacks.cbs_probe.window_tokens), in
    # whole steps of its largest branch (k = 2).
    largest = [2 * r["batch_size"] * 128 for r in readings]
    assert [r["window_tokens"] for r in readings] == [
        max(4096, r["tokens"]) // step * step for r, step in zip(readings, largest)
    ]
    assert readings[-1]["window_tokens"] == 12288
    assert all(r["mode"] == "checkpoint" and set(r["losses"]) <= {"1", "2"} for r in readings)
    assert (out / "cbs_curve.png").is_file() and (out / "forecast.png").is_file()
    assert "[5/5] step0000008.ckpt: step 8, 12,288 tokens, batch 16" in result.stdout + result.stderr


def test_a_checkpoint_without_its_runs_configuration_is_refused(probed_run, tmp_path):
    lonely = tmp_path / "elsewhere" / "checkpoints"
    lonely.mkdir(parents=True)
    (lonely / "step0000002.ckpt").write_bytes((probed_run / "checkpoints" / "step0000002.ckpt").read_bytes())
    result = run_forked(
        ROOT / "recipes" / "probe.py", f"ckpt_path={lonely / 'step0000002.ckpt'}", capture_output=True, timeout=300,
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: ckpt_path={lonely / 'step0000002.ckpt'}: its run folder {lonely.parent} has no resolved_config.yaml "
        "(the configuration recipes/train.py writes there), so the run cannot be rebuilt: give a checkpoint of a "
        "recipe run, or use lit_cbs.probe.probe_checkpoint with your own module"
    )
    assert not (tmp_path / "outputs").exists()  # refused before anything was written


def test_a_loader_without_a_data_position_is_refused(probed_run):
    cfg = run_config(probed_run)
    parts = job.probe_parts(cfg)
    tokens = torch.zeros(64, 128, dtype=torch.long)
    parts.datamodule.train_dataloader = lambda: DataLoader(tokens, batch_size=4)  # a plain DataLoader: no data position
    with pytest.raises(LitCBSConfigError, match="only a lit_cbs.GlobalOrderLoader train loader keeps"):
        probe_checkpoint(probed_run / "checkpoints" / "step0000002.ckpt", parts, multipliers=(1, 2), window_tokens=4096)


FSDP_PROBE = Path(__file__).resolve().parents[1] / "scripts" / "fsdp_probe.py"


def test_an_fsdp2_checkpoint_of_two_processes_is_probed_on_one(tmp_path):
    result = run_forked(FSDP_PROBE, str(tmp_path), "train", capture_output=True, timeout=600)  # rank 1 a fresh process
    assert result.returncode == 0, result.stderr[-3000:]
    (expected,) = torch.load(tmp_path / "train.pt", weights_only=False)["readings"]
    checkpoint = tmp_path / "checkpoints" / f"step={expected.step}.ckpt"
    assert checkpoint.is_dir() and (checkpoint / ".metadata").is_file()  # a distributed checkpoint: shards of 2 ranks
    # One process, a copy of this one.
    result = run_forked(FSDP_PROBE, str(tmp_path), "probe", str(checkpoint), "1", capture_output=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    reading = torch.load(tmp_path / "probe.pt", weights_only=False)["reading"]
    assert (reading.step, reading.batch_size, reading.bracket) == (expected.step, expected.batch_size, expected.bracket)
    for k, loss in expected.losses.items():  # the same branches on one rank: the same losses but for rounding
        assert reading.losses[k] == pytest.approx(loss, rel=1e-9)


def test_an_fsdp2_runs_side_job_reads_what_its_in_process_probe_reads(tmp_path, monkeypatch):
    # The job rebuilds the run on one process (fsdp_probe:parts) from the 2 ranks' distributed checkpoint.
    monkeypatch.setenv("PYTHONPATH", f"{FSDP_PROBE.parent}:{FSDP_PROBE.parents[1]}")
    for what in ("train", "side"):
        result = run_forked(FSDP_PROBE, str(tmp_path / what), what, capture_output=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
    (expected,) = torch.load(tmp_path / "train" / "train.pt", weights_only=False)["readings"]
    (reading,) = torch.load(tmp_path / "side" / "side.pt", weights_only=False)["readings"]
    assert (reading.mode, reading.step, reading.bracket) == ("side_jobs", expected.step, expected.bracket)
    for k, loss in expected.losses.items():  # the same branches on one rank: the same losses but for rounding
        assert reading.losses[k] == pytest.approx(loss, rel=1e-9)
