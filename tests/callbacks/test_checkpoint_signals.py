"""A recipe run with a CBS probe, stopped and resumed: from every periodic checkpoint, after SIGTERM
before, inside and after a probe (its window and its branches), and after SLURM's requeue signal
with Lightning's auto-requeue. Every resumed run ends bitwise where the uninterrupted run ends, with
its readings. Signals are real ones, sent to this process at the step (or branch step) named."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from launch import subprocess_env
from recipe_runs import TORCHRUN_TRAIN, compose_config
from recipe_runs import train as train_script
from signals import SignalAt

from lit_cbs.callbacks.accounting import BatchAccounting
from lit_cbs.run.report import run_summary, summary_text

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]

# 8 optimizer steps of 128-token samples: batch 8 (micro 8), then 16 (micro 16) from 4,096 tokens; probes
# (k = 1, 2) over windows of 4,096 tokens from 2,048 tokens (steps 3-5, after step 2) and from 8,192 tokens
# (steps 7-8, after step 6); a checkpoint every 2 steps.
PROBED_RUN = [
    "data.batch_size=4",
    "batch.schedule.batch_sizes=[8,16]",
    "batch.schedule.thresholds=[0,4096]",
    "max_tokens=12288",
    "lr_schedule.warmup_tokens=1024",
    "val_check_tokens=4096",
    "callbacks.checkpoint.every_n_train_steps=2",
    "trainer.enable_progress_bar=false",
    "callbacks.cbs_probe.geometric=[2048,4.0]",
    "callbacks.cbs_probe.window_tokens=4096",
    "callbacks.cbs_probe.multipliers=[1,2]",
    "callbacks.cbs_probe.heldout_batches=2",
    "data.val_fraction=0.1",
    "plots=false",
]


def build(run_dir: Path, prepared: Path, *overrides: str):
    cfg = compose_config(*PROBED_RUN, f"data.path={prepared}", *overrides, output_dir=str(run_dir))
    pl.seed_everything(cfg.seed, workers=True)
    return train_script.build_run(cfg)


def fit(run, ckpt_path=None, signal_at: SignalAt | None = None, signal_in_branch_step: int | None = None):
    """Train ``run``; a signal after a main step, or at the ``signal_in_branch_step``-th branch micro-batch."""
    if signal_at is not None:
        run.trainer.callbacks.insert(1, signal_at)  # before the checkpoint, which Lightning runs last
    if signal_in_branch_step is not None:
        training_step, calls = run.model.training_step, []

        def signalling_step(batch, batch_idx):
            if BatchAccounting.attach(run.trainer).in_branch:
                calls.append(batch_idx)
                if len(calls) == signal_in_branch_step:
                    os.kill(os.getpid(), signal.SIGTERM)
            return training_step(batch, batch_idx)

        run.model.training_step = signalling_step
    run.trainer.fit(run.model, datamodule=run.datamodule, ckpt_path=ckpt_path)


def final_state(run_dir: Path) -> dict:
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    readings = [json.loads(line) for line in (run_dir / "cbs_probe.jsonl").read_text().splitlines()]
    return {
        "step": checkpoint["global_step"],
        "weights": checkpoint["state_dict"],
        "optimizer": checkpoint["optimizer_states"],
        "readings": readings,
    }


def assert_same_end(resumed: dict, uninterrupted: dict) -> None:
    assert resumed["step"] == uninterrupted["step"] == 8
    assert resumed["weights"].keys() == uninterrupted["weights"].keys()
    assert all(torch.equal(resumed["weights"][key], uninterrupted["weights"][key]) for key in uninterrupted["weights"])
    for resumed_optimizer, optimizer in zip(resumed["optimizer"], uninterrupted["optimizer"]):
        assert resumed_optimizer["param_groups"] == optimizer["param_groups"]
        for index, state in optimizer["state"].items():
            assert all(torch.equal(resumed_optimizer["state"][index][key], value) for key, value in state.items())
    assert resumed["readings"] == uninterrupted["readings"]  # the same probes, at the same points, with the same losses


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, prepared) -> tuple[Path, dict]:
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    fit(build(run_dir, prepared))
    state = final_state(run_dir)
    assert [(r["tokens"], r["step"]) for r in state["readings"]] == [(2048, 2), (8192, 6)]
    return run_dir, state


def test_resume_from_every_periodic_checkpoint(uninterrupted, prepared, tmp_path):
    run_dir, end = uninterrupted
    # Every 2 steps, but none inside a probe window (steps 3-5 and 7): last.ckpt held the window's start meanwhile.
    periodic = sorted(path.name for path in (run_dir / "checkpoints").glob("step*.ckpt"))
    assert periodic == ["step0000002.ckpt", "step0000006.ckpt", "step0000008.ckpt"]
    for name in periodic:
        resumed_dir = tmp_path / name
        fit(build(resumed_dir, prepared), ckpt_path=run_dir / "checkpoints" / name)
        assert_same_end(final_state(resumed_dir), end)


def test_a_run_stopped_by_max_steps_goes_on_from_its_last_checkpoint(uninterrupted, prepared, tmp_path):
    """How a run moves to other ranks at a phase's end: stopped by trainer.max_steps, resumed without it. The
    second probe is due after step 6, where the first run stops: it leaves the probe to the resumed run."""
    _, end = uninterrupted
    fit(build(tmp_path / "first", prepared, "trainer.max_steps=6"))
    checkpoint = torch.load(tmp_path / "first" / "checkpoints" / "last.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 6
    (accounting,) = [state for key, state in checkpoint["callbacks"].items() if key.startswith("BatchAccounting")]
    rest = build(tmp_path / "rest", prepared)
    fit(rest, ckpt_path=tmp_path / "first" / "checkpoints" / "last.ckpt")
    assert_same_end(final_state(tmp_path / "rest"), end)
    # The resumed run's clock goes on from the first run's, and its summary says what this fit trained.
    assert (
        accounting["tokens_seen"] == 8192
        and 0 < accounting["fit_seconds"] < BatchAccounting.attach(rest.trainer).fit_seconds
    )
    summary = run_summary(rest.trainer, rest.batch_warmup, "rest", fit_seconds=2.0)
    assert (summary["tokens"], summary["tokens_this_fit"]) == (12288, 4096) and summary["run_seconds"] > accounting[
        "fit_seconds"
    ]
    text = summary_text(summary)
    assert "12,288 (2,048 tokens/s over this fit, which trained 4,096 of them)" in text
    assert f"2.0 s (trainer.fit, setup included); {summary['run_seconds']:,.1f} s over the whole run" in text


def test_a_run_stopped_after_its_last_probe_resumes_once_its_batch_outgrew_the_window(prepared, tmp_path, caplog):
    """The one probe (k = 1, 2 over 2,048 tokens, after step 2) runs at batch 8. From 4,096 tokens the batch is 16,
    whose k = 2 step (4,096 tokens) that window could not hold: no probe is left to run there, so a run stopped by
    max_steps at batch 16 goes on from its last checkpoint."""
    one_probe = [
        "callbacks.cbs_probe.geometric=null",
        "callbacks.cbs_probe.at_tokens=[2048]",
        "callbacks.cbs_probe.window_tokens=2048",
    ]
    fit(build(tmp_path / "first", prepared, *one_probe, "trainer.max_steps=5"))
    rest = build(tmp_path / "rest", prepared, *one_probe)
    with caplog.at_level("INFO"):
        fit(rest, ckpt_path=tmp_path / "first" / "checkpoints" / "last.ckpt")
    assert rest.trainer.global_step == 8 and BatchAccounting.attach(rest.trainer).tokens_seen == 12288
    assert (
        "CBSProbeCallback: no probe point is left in the rest of this run (the last of at_tokens is at 2,048)"
        in caplog.text
    )
    assert [(r["tokens"], r["step"], r["batch_size"]) for r in final_state(tmp_path / "rest")["readings"]] == [
        (2048, 2, 8)
    ]


@pytest.mark.parametrize(
    "where, signal_at, branch_step, saved_step",
    [
        ("before the first probe", SignalAt(1, signal.SIGTERM), None, 1),
        ("inside the first probe's window", SignalAt(3, signal.SIGTERM), None, 2),
        ("inside a branch of the first probe", None, 3, 2),
        ("between the probes", SignalAt(6, signal.SIGTERM), None, 6),
    ],
)
def test_sigterm_anywhere_resumes_to_the_uninterrupted_end(
    uninterrupted, prepared, tmp_path, caplog, where, signal_at, branch_step, saved_step
):
    _, end = uninterrupted
    stopped = build(tmp_path / "stopped", prepared)
    with caplog.at_level("INFO"), pytest.raises(SystemExit) as stop, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(stopped, signal_at=signal_at, signal_in_branch_step=branch_step)
    # No main-run step after the one the signal came in: steps 1, 3, 5 (the branches run after it) and 6.
    assert stopped.trainer.global_step == {1: 1, 2: 3 if branch_step is None else 5, 6: 6}[saved_step]
    last = tmp_path / "stopped" / "checkpoints" / "last.ckpt"
    holds = "it" if saved_step != 2 else "step 2, where the CBS probe in progress began (a resumed run redoes it)"
    assert str(stop.value) == (
        f"SIGTERM: training stopped after optimizer step {stopped.trainer.global_step}; {last} holds {holds}: "
        f"resume with trainer.fit(model, datamodule, ckpt_path={str(last)!r})"
    )
    assert f"SIGTERM: stopping after step {stopped.trainer.global_step}" in caplog.text
    if saved_step == 2:  # said once, with the stop: the probe, and what last.ckpt holds
        retrained = stopped.trainer.global_step - 2
        assert caplog.text.count("inside the CBS probe whose window began at step 2") == 1
        assert (
            f"step 2: last.ckpt holds step 2, so a resumed run redoes the probe there ({retrained} main-run"
            in caplog.text
        )
        assert not [w for w in caught if "CBS probe" in str(w.message)]
    saved = torch.load(tmp_path / "stopped" / "checkpoints" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == saved_step  # the main state at a step boundary, or the open probe's start
    resumed_dir = tmp_path / "resumed"
    fit(build(resumed_dir, prepared), ckpt_path=tmp_path / "stopped" / "checkpoints" / "last.ckpt")
    assert_same_end(final_state(resumed_dir), end)


@pytest.fixture
def slurm_job(monkeypatch, tmp_path) -> Path:
    """The environment of a SLURM batch job, and an ``scontrol`` that records how it was called: this machine
    has no SLURM, and Lightning's auto-requeue calls ``scontrol requeue <job id>``."""
    for name, value in {
        "SLURM_NTASKS": "1",
        "SLURM_JOB_NAME": "olmo",
        "SLURM_JOB_ID": "4242",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
    }.items():
        monkeypatch.setenv(name, value)
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol_calls.txt"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return calls


@pytest.mark.parametrize("step, saved_step", [(1, 1), (3, 2)])
def test_slurm_requeue_signal_saves_the_main_state_and_the_requeued_job_resumes(
    uninterrupted, prepared, tmp_path, slurm_job, step, saved_step
):
    _, end = uninterrupted
    run_dir = tmp_path / "job"  # a requeued job runs in the same folder (hydra.run.dir=.../${oc.env:SLURM_JOB_ID})
    stopped = build(run_dir, prepared)
    fit(stopped, signal_at=SignalAt(step, signal.SIGUSR1))
    assert stopped.trainer.global_step == step
    assert slurm_job.read_text().split() == ["requeue", "4242"]
    (hpc,) = run_dir.glob("hpc_ckpt_*.ckpt")
    assert torch.load(hpc, weights_only=False)["global_step"] == saved_step
    requeued = build(run_dir, prepared)
    fit(requeued)  # no ckpt_path: on a SLURM job Lightning resumes from the newest hpc checkpoint
    assert_same_end(final_state(run_dir), end)


# ---------------------------------------------------------------- two DDP processes under torchrun
def torchrun_probed_run(run_dir: Path, prepared: Path, *overrides: str, expect_stop: bool = False) -> str:
    command = [
        *TORCHRUN_TRAIN,
        *PROBED_RUN,
        f"data.path={prepared}",
        "trainer=ddp",
        "trainer.accelerator=cpu",
        "trainer.precision=32-true",
        "trainer.devices=2",
        *overrides,
        f"hydra.run.dir={run_dir}",
    ]
    result = subprocess.run(
        command,
        cwd=run_dir.parent,
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}", HYDRA_FULL_ERROR="1"),
    )
    assert (result.returncode != 0) == expect_stop, result.stderr[-5000:]
    return result.stdout + result.stderr


def test_ddp_ranks_stop_together_when_one_is_signalled_and_resume_to_the_same_end(prepared, tmp_path):
    torchrun_probed_run(tmp_path / "full", prepared)
    # Rank 1's process alone gets SIGTERM after step 3, inside the first probe's window: both ranks stop there.
    log = torchrun_probed_run(
        tmp_path / "stopped",
        prepared,
        "+callbacks.signal._target_=signals.SignalAt",
        "+callbacks.signal.step=3",
        f"+callbacks.signal.signum={int(signal.SIGTERM)}",
        "+callbacks.signal.rank=1",
        expect_stop=True,
    )
    assert "SIGTERM: stopping after step 3, inside the CBS probe whose window began at step 2" in log
    assert torch.load(tmp_path / "stopped" / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 2
    torchrun_probed_run(
        tmp_path / "resumed", prepared, f"ckpt_path={tmp_path / 'stopped' / 'checkpoints' / 'last.ckpt'}"
    )
    assert_same_end(final_state(tmp_path / "resumed"), final_state(tmp_path / "full"))
