"""The closed loop off the critical path: side-job readings grow a CBSAdaptive run's batch, through the API (a user's
own build) with the guard and the gradient noise scale beside it, and through the recipe (``+recipe=tiny_adaptive
side_jobs=local``); the first reading equals the in-process run's, branch loss for branch loss, with held-out scores
over 2 data windows and with train-EMA scores; and a run resumed from an adaptive run's checkpoint without its probe
is recognised as resumed."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import side_job_toys
from launch import run_forked
from recipe_runs import TRAIN_SCRIPT
from toys import fit_quietly, trainer_kwargs

from lit_cbs import CBSProbeCallback, FinalStateCheckpoint, GradientNoiseScale
from lit_cbs.errors import LitCBSConfigError
from lit_cbs.probe import LocalLauncher, SideJobs

TESTS = Path(__file__).resolve().parents[1]
# Probes from step 10 (160 tokens), k = 1 and 2 over windows of 4 steps; tolerant enough that k = 2 recovers the
# toy's loss and the reading is determined: the loop must act, and the test is whether it does.
ADAPTIVE = dict(every_tokens=160, multipliers=(1, 2), window_tokens=64, epsilon=0.45, confidence=0.5)
SCORINGS = {
    "heldout, bisect, 2 data windows": dict(evaluate="heldout", search="bisect", replicates=2),
    "train EMA, grid": dict(evaluate="train_ema", search="grid"),
}


@pytest.fixture(autouse=True)
def job_path(monkeypatch):
    """The jobs import side_job_toys (and toys) as the test does."""
    monkeypatch.setenv("PYTHONPATH", f"{TESTS}:{TESTS.parent}")


def fit(probe: CBSProbeCallback | None, *callbacks: pl.Callback, folder: Path | None = None, ckpt_path=None):
    """The CBSAdaptive toy run over 2 epochs (batch 4, up to 8), its GradientNoiseScale beside the probe."""
    pl.seed_everything(0, verbose=False)
    warmup = side_job_toys.adaptive_warmup()
    extra = [FinalStateCheckpoint(dirpath=folder, save_last=True)] if folder is not None else []
    kwargs = trainer_kwargs(max_epochs=2, limit_val_batches=0, enable_checkpointing=folder is not None)
    probes = [probe] if probe is not None else []
    trainer = pl.Trainer(callbacks=[warmup, *probes, GradientNoiseScale(), *callbacks, *extra], **kwargs)
    fit_quietly(trainer, side_job_toys.module(), datamodule=side_job_toys.Data(n=96, batch_size=2), ckpt_path=ckpt_path)
    return warmup


@pytest.mark.slow
@pytest.mark.parametrize("scoring", SCORINGS.values(), ids=SCORINGS.keys())
def test_side_job_readings_grow_the_batch_and_read_as_in_process(scoring, tmp_path):
    jobs = SideJobs(LocalLauncher(threads=1), build="side_job_toys:adaptive_parts", look_seconds=0)
    side = CBSProbeCallback(**ADAPTIVE, **scoring, side_jobs=jobs, output_dir=tmp_path / "side")
    # The main run waits after its first window until the job has ended, so the reading arrives inside the run.
    window_end = 10 + 4
    side_warmup = fit(side, side_job_toys.WaitForSideJobs(window_end))
    in_process = CBSProbeCallback(**ADAPTIVE, **scoring)
    in_process_warmup = fit(in_process)

    assert not side.failures and side.status()["pending"] == []
    first, expected = side.history[0], in_process.history[0]
    assert (first.mode, expected.mode) == ("side_jobs", "in_process")
    for field in ("tokens", "step", "losses", "batch_losses", "replicate_batch_losses", "loss_se", "bracket",
                  "tokens_spent", "overhead", "main_loss", "determined"):  # fmt: skip
        assert getattr(first, field) == getattr(expected, field), field
    # The same branches; a bisecting job trains its midpoint while it waits for the main run's window.
    assert sorted(first.branches_trained) == sorted(expected.branches_trained)
    assert first.determined and first.adaptive_batch == 8
    assert first.arrived_at_tokens == 16 * (window_end + 1)  # at the step after the job ended
    for warmup in (side_warmup, in_process_warmup):
        change = warmup.history[0]
        assert (change.old_global_batch, change.new_global_batch, change.cause) == (4, 8, "schedule")
    # The side-job run grows the batch where its reading arrived, after its window; in process, at the window's end.
    assert side_warmup.history[0].tokens_seen >= first.arrived_at_tokens
    assert side.status()["adaptive"] == {"decisions": [[first.arrived_at_tokens, 8]], "why_not": None}


@pytest.mark.slow
def test_a_run_resumed_from_an_adaptive_runs_checkpoint_without_its_probe_is_resumed(tmp_path):
    # Lightning runs every callback's setup before it restores the checkpoint: the check for a CBSAdaptive schedule
    # without a probe waits for the restore, and a restored one goes on with the decisions it carries.
    probe = CBSProbeCallback(**ADAPTIVE, evaluate="heldout", search="bisect", max_overhead=None)
    full = fit(probe, folder=tmp_path / "full")
    assert full.history and full.history[0].new_global_batch == 8
    resumed = fit(None, folder=tmp_path / "resumed", ckpt_path=tmp_path / "full" / "last.ckpt")
    assert resumed.global_batch == 8 and resumed.schedule.decisions == full.schedule.decisions
    with pytest.raises(LitCBSConfigError, match=r"CBSAdaptive\(start=4, final=8\), which grows the batch only on CBS"):
        fit(None)  # a fresh run without a probe is still refused, before its first step


# The adaptive recipe at a small budget: a probe every 16,384 tokens (8 steps of 16 x 128), k = 1 and 2 over 2 data
# windows of 8,192 tokens (4 steps) scored on 2 held-out batches, tolerant enough that the loop acts.
RECIPE = [
    "+recipe=tiny_adaptive",
    "max_tokens=65536",
    "lr_schedule.warmup_tokens=8192",
    "val_check_tokens=32768",
    "callbacks.cbs_probe.every_tokens=16384",
    "callbacks.cbs_probe.window_tokens=8192",
    "callbacks.cbs_probe.heldout_batches=2",
    "callbacks.cbs_probe.replicates=2",
    "callbacks.cbs_probe.epsilon=0.45",
    "callbacks.cbs_probe.confidence=0.5",
    "callbacks.checkpoint=null",
    "callbacks.progress_bar=null",
    "trainer.enable_progress_bar=false",
    "plots=false",
]


def recipe_run(run_dir: Path, prepared: Path, *overrides: str):
    env = {"PYTHONPATH": f"{TESTS}:{TESTS.parent}", "HYDRA_FULL_ERROR": "1"}
    arguments = [*RECIPE, f"data.path={prepared}", *overrides, f"hydra.run.dir={run_dir}"]
    result = run_forked(TRAIN_SCRIPT, *arguments, cwd=run_dir.parent, env=env, capture_output=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    probes = run_dir / "cbs_probe.jsonl"
    readings = [json.loads(line) for line in probes.read_text().splitlines()] if probes.exists() else []
    return readings, json.loads((run_dir / "summary.json").read_text()), result.stdout


@pytest.mark.slow
def test_the_adaptive_recipe_grows_its_batch_on_side_job_readings(prepared, tmp_path):
    # The main run waits after the first window (step 12) until the job has ended: its reading arrives inside the run.
    wait = "+callbacks.wait={_target_: side_job_toys.WaitForSideJobs, step: 12}"
    side, summary, stdout = recipe_run(
        tmp_path / "side", prepared, "side_jobs=local", "side_jobs.launcher.threads=1", "side_jobs.look_seconds=0", wait
    )
    in_process, _, _ = recipe_run(tmp_path / "in_process", prepared)
    first, expected = side[0], in_process[0]
    assert (first["mode"], first["tokens"], first["replicates"]) == ("side_jobs", 16384, 2)
    for field in ("losses", "batch_losses", "replicate_batch_losses", "bracket", "loss_se", "overhead"):
        assert first.get(field) == expected.get(field), field
    assert first["adaptive_batch"] == 32 and first["arrived_at_tokens"] == 13 * 2048
    assert summary["batch_changes"][0]["old"] == 16 and summary["batch_changes"][0]["new"] == 32
    points = summary["probe"]["points"]
    assert points["failed"] == [] and points["pending"] == [] and points["read"] == len(side) >= 2
    assert "probe points     " in stdout and "0 failed, 0 pending" in stdout and "NEVER" not in stdout


@pytest.mark.slow
def test_a_run_whose_probes_failed_says_so_in_the_first_lines_of_its_summary(prepared, tmp_path):
    # Every job runs past its time limit (0.6 s): each probe point fails, and the adaptive schedule never acts. The
    # run pauses 1 s inside each window (steps 12 and 20), so a job's failure is in before the next point, which a
    # reading still out at the same batch would skip (on an idle machine 8 steps take less than 0.6 s).
    _, summary, stdout = recipe_run(
        tmp_path / "run",
        prepared,
        "side_jobs=local",
        "side_jobs.launcher.timeout_min=0.01",
        "side_jobs.retries=0",
        "side_jobs.look_seconds=0",
        "+callbacks.pause={_target_: side_job_toys.PauseAfter, steps: [12, 20], seconds: 1.0}",
    )
    points = summary["probe"]["points"]
    assert points["read"] == 0 and len(points["failed"]) == 3 and points["pending"] == []  # at 16k, 32k and 49k tokens
    assert all(failure["reason"] == "side job failed: ran past timeout_min=0.01" for failure in points["failed"])
    assert summary["batch_changes"] == [] and summary["probe"]["adaptive"]["decisions"] == []
    lines = stdout[stdout.index("lit_cbs: tiny_adaptive done") :].splitlines()
    assert lines[1].startswith(
        "CBSAdaptive      NEVER GREW THE BATCH: 0 reading(s), 0 determined; 3 probe point(s) failed"
    )
    assert lines[2].startswith("probe points     0 read (0 determined), ") and "FAILED at 16,384, " in lines[2]
    assert "ran past timeout_min=0.01" in lines[2]
