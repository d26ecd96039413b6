"""Side-job probes (lit_cbs/probe/side_jobs/): branches trained by real processes from the probe's
checkpoint while the main run trains on as k = 1. The readings equal the in-process probe's, the main run is the
run without a probe, failures are retried then recorded, and bad settings are refused before any branch trains."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import side_job_toys
import torch
from toys import fit_quietly, trainer_kwargs

from lit_cbs import CBSProbeCallback, FinalStateCheckpoint
from lit_cbs.errors import LitCBSConfigError
from lit_cbs.probe import LocalLauncher, SideJobs
from lit_cbs.probe.side_jobs import MAIN_SILENCE_SECONDS, main_is_gone

TESTS = Path(__file__).resolve().parents[1]
PROBE = dict(
    every_tokens=160, multipliers=(1, 2, 4), window_tokens=128, epsilon=0.01, evaluate="heldout", search="bisect"
)
# The toy run trains 24 steps of 16 tokens an epoch. Stopped after step 38 of 48, a PROBE run probes 3 times, at
# 160, 320 and 480 tokens (steps 10, 20 and 30), the last window ending with the run: one side job less than 2
# whole epochs take (each job is a process that imports torch and Lightning).
STEPS = 38


@pytest.fixture(autouse=True)
def job_path(monkeypatch):
    """The jobs import side_job_toys (and toys) as the test does."""
    monkeypatch.setenv("PYTHONPATH", f"{TESTS}:{TESTS.parent}")


def fit(probe: CBSProbeCallback | None, max_steps: int = -1):
    """The toy run over 2 epochs, stopped after ``max_steps`` (-1: at its end)."""
    pl.seed_everything(0, verbose=False)
    module = side_job_toys.module()
    callbacks = [side_job_toys.warmup()] + ([probe] if probe is not None else [])
    kwargs = trainer_kwargs(max_epochs=2, limit_val_batches=0, max_steps=max_steps)
    trainer = pl.Trainer(callbacks=callbacks, **kwargs)
    fit_quietly(trainer, module, datamodule=side_job_toys.Data(n=96, batch_size=2))
    return trainer, module


def side_jobs(**kwargs) -> SideJobs:
    """Side jobs of the toy run, looked for after every step (look_seconds=0) unless ``kwargs`` say otherwise."""
    return SideJobs(LocalLauncher(threads=1), build="side_job_toys:parts", **{"look_seconds": 0, **kwargs})


@pytest.fixture(scope="module")
def side_job_run(tmp_path_factory):
    """The toy run probed by side jobs (PROBE, one job at a time) and its folder (cbs_probe.jsonl, cbs_probe_jobs/):
    the first test compares it with the in-process probe, the stop/resume test its readings with an interrupted
    run's (each side-job run costs a process per job, each importing torch and Lightning)."""
    folder = tmp_path_factory.mktemp("side_job_run")
    probe = CBSProbeCallback(**PROBE, side_jobs=side_jobs(), output_dir=folder)
    with pytest.MonkeyPatch.context() as patch:  # job_path and the cwd of a test, which run after this
        patch.setenv("PYTHONPATH", f"{TESTS}:{TESTS.parent}")
        patch.chdir(folder)
        _, module = fit(probe, max_steps=STEPS)
    return probe, module, folder


@pytest.mark.slow
def test_side_job_readings_equal_the_in_process_ones_and_leave_the_main_run_alone(side_job_run):
    _, plain = fit(None, max_steps=STEPS)
    in_process = CBSProbeCallback(**PROBE)
    fit(in_process, max_steps=STEPS)
    probe, module, folder = side_job_run
    assert torch.equal(module.layer.weight, plain.layer.weight) and module.micro_batches == plain.micro_batches
    assert len(probe.history) == len(in_process.history) >= 3
    for side, inside in zip(probe.history, in_process.history):
        assert (side.tokens, side.step, side.mode) == (inside.tokens, inside.step, "side_jobs")
        assert side.batch_losses == inside.batch_losses and side.losses == inside.losses  # bit for bit
        assert (side.bracket, side.loss_se, side.branches_trained) == (
            inside.bracket,
            inside.loss_se,
            inside.branches_trained,
        )
        assert side.arrived_at_tokens >= side.tokens + side.window_tokens
    written = [json.loads(line) for line in (folder / "cbs_probe.jsonl").read_text().splitlines()]
    assert written == [reading.to_record() for reading in probe.history]
    folders = sorted((folder / "cbs_probe_jobs").glob("probe*"))
    assert len(folders) == len(probe.history)
    assert all((folder / "scores.json").is_file() and not (folder / "start.ckpt").exists() for folder in folders)


@pytest.mark.slow
def test_a_failing_side_job_is_retried_then_the_probe_is_recorded_as_failed(tmp_path, monkeypatch):
    monkeypatch.setenv("SIDE_JOB_TOYS_COUNT", str(tmp_path / "count"))
    monkeypatch.setenv("SIDE_JOB_TOYS_FAIL", "2,3")  # the first probe's two jobs fail, each its own way (retries=1)
    probe = CBSProbeCallback(**{**PROBE, "every_tokens": 320}, side_jobs=side_jobs(retries=1), output_dir=tmp_path)
    fit(probe)
    assert [failure["tokens"] for failure in probe.failures] == [320]
    assert probe.failures[0]["reason"] == (
        "side job failed 2 times: exited with code 1: lit_cbs.errors.LitCBSConfigError: side_jobs.build="
        "'side_job_toys:parts' fails: RuntimeError: build 2 fails; exited with code 1: "
        "lit_cbs.errors.LitCBSConfigError: side_jobs.build='side_job_toys:parts' fails: RuntimeError: build 3 fails"
    )
    assert [reading.tokens for reading in probe.history] == [640]  # the next probe's job ran and its reading counts
    status = probe.status()
    assert {key: status[key] for key in ("read", "determined", "failed", "pending")} == {
        "read": 1, "determined": 0, "failed": probe.failures, "pending": []
    }  # fmt: skip
    assert status["side_jobs"]["checkpoints"] == 2 and status["side_jobs"]["polls"] >= 48  # look_seconds=0: every step


@pytest.mark.slow
def test_a_job_that_fails_twice_alike_is_not_started_again(tmp_path, monkeypatch):
    monkeypatch.setenv("SIDE_JOB_TOYS_COUNT", str(tmp_path / "count"))
    monkeypatch.setenv("SIDE_JOB_TOYS_FAIL", ",".join(map(str, range(2, 12))))  # every job's build
    monkeypatch.setenv("SIDE_JOB_TOYS_SAME", "1")
    probe = CBSProbeCallback(**{**PROBE, "every_tokens": 320}, side_jobs=side_jobs(retries=5), output_dir=tmp_path)
    fit(probe, max_steps=30)  # one probe point, at 320 tokens (640 is past the run's 480)
    (failure,) = probe.failures
    assert failure["tokens"] == 320 and not probe.history
    assert failure["reason"].startswith("side job failed 2 times, each: exited with code 1: ")
    assert failure["reason"].count("the build fails on purpose") == 1
    assert failure["reason"].endswith("; not started again after the same error twice")
    assert int((tmp_path / "count").read_text()) == 3  # the dry build, then two of the retries=5 allowed


def test_a_build_that_fails_stops_the_run_before_its_first_step(tmp_path, monkeypatch):
    monkeypatch.setenv("SIDE_JOB_TOYS_COUNT", str(tmp_path / "count"))
    monkeypatch.setenv("SIDE_JOB_TOYS_FAIL", "1")
    probe = CBSProbeCallback(**PROBE, side_jobs=side_jobs(), output_dir=tmp_path)
    with pytest.raises(LitCBSConfigError, match=r"side_jobs.build='side_job_toys:parts' fails: RuntimeError: build 1"):
        fit(probe)
    assert not (tmp_path / "cbs_probe_jobs").exists()


def test_a_launcher_that_cannot_start_is_refused_before_training(tmp_path):
    probe = CBSProbeCallback(**PROBE, side_jobs=SideJobs(LocalLauncher(python="/nonexistent/python"), build="x:y"))
    with pytest.raises(
        LitCBSConfigError, match=r"LocalLauncher\(python='/nonexistent/python'\) cannot start a side job"
    ):
        fit(probe)


def test_side_job_settings_are_checked_where_they_are_made():
    with pytest.raises(LitCBSConfigError, match="side_jobs.build='train' must be 'package.module:function'"):
        SideJobs(LocalLauncher(), build="train")
    with pytest.raises(LitCBSConfigError, match="early_stop=.* with side_jobs it never waits"):
        CBSProbeCallback(**PROBE, early_stop=(0.5,), side_jobs=side_jobs())
    with pytest.raises(LitCBSConfigError, match="side jobs rebuild the probe's rules by name: give lr_rule as a name"):
        CBSProbeCallback(**PROBE, lr_rule=lambda ratio: ratio**0.5, side_jobs=side_jobs())


def fit_until(probe: CBSProbeCallback, folder: Path, max_steps: int = -1, ckpt_path: Path | None = None):
    """The toy run with last.ckpt in ``folder``, stopped after ``max_steps`` (-1: its end), resumed from
    ``ckpt_path``."""
    pl.seed_everything(0, verbose=False)
    checkpoint = FinalStateCheckpoint(dirpath=folder, save_last=True)
    callbacks = [side_job_toys.warmup(), probe, checkpoint]
    kwargs = trainer_kwargs(max_epochs=2, limit_val_batches=0, max_steps=max_steps, enable_checkpointing=True)
    trainer = pl.Trainer(callbacks=callbacks, **kwargs)
    fit_quietly(trainer, side_job_toys.module(), datamodule=side_job_toys.Data(n=96, batch_size=2), ckpt_path=ckpt_path)
    return trainer


@pytest.mark.slow
def test_a_stopped_main_run_collects_the_jobs_that_finished_and_restarts_those_lost(side_job_run, tmp_path, caplog):
    # Probes every 10 steps (160 tokens) over 8-step windows; the run stops after steps 19 and 29 and resumes. Its
    # readings are those of the run never stopped: the first test's (the same toy run and PROBE; neither its
    # checkpoint callback nor how many jobs run at once changes a reading).
    def probe(**settings) -> CBSProbeCallback:
        jobs = SideJobs(
            LocalLauncher(threads=1, max_running=None), build="side_job_toys:parts", look_seconds=0, **settings
        )
        return CBSProbeCallback(**PROBE, side_jobs=jobs, output_dir=tmp_path / "probes")

    uninterrupted, _, never_stopped = side_job_run
    # Its files too, as when the run never stopped wrote into this folder: each probe of the runs below opens its job
    # folder afresh over one a finished run left, and cbs_probe.jsonl is rewritten from their readings alone.
    shutil.copytree(never_stopped, tmp_path / "probes")
    first = probe(wait_at_end=0)
    fit_until(first, tmp_path / "run", max_steps=19)  # the first probe's window ended at step 18; its job runs
    (pending,) = first._side.pending.values()
    launcher = first.config.side_jobs.launcher
    assert launcher.state(pending.handle).running
    launcher.cancel(pending.handle)  # the job is lost (its machine went away with the main run's)
    second = probe(wait_at_end=0)
    with caplog.at_level("INFO"):
        fit_until(second, tmp_path / "run", max_steps=29, ckpt_path=tmp_path / "run" / "last.ckpt")
    assert "side job attempt 1 was killed by signal 9; it starts again (1 of 3 attempts)" in caplog.text
    folders = sorted((tmp_path / "probes" / "cbs_probe_jobs").glob("probe*"))
    for folder in folders:  # both probes' jobs finish while no main run is running
        for _ in range(600):
            if (folder / "scores.json").is_file():
                break
            time.sleep(0.5)
    third = probe()
    with caplog.at_level("INFO"):
        fit_until(third, tmp_path / "run", max_steps=STEPS, ckpt_path=tmp_path / "run" / "last.ckpt")
    assert [(r.tokens, r.losses, r.batch_losses) for r in third.history] == [
        (r.tokens, r.losses, r.batch_losses) for r in uninterrupted.history
    ]
    written = [
        json.loads(line)["tokens"] for line in (tmp_path / "probes" / "cbs_probe.jsonl").read_text().splitlines()
    ]
    assert written == [160, 320, 480]  # each reading once


@pytest.mark.slow
def test_a_job_whose_main_run_is_gone_stops_instead_of_waiting_for_its_score(tmp_path):
    # The first probe's job, run again as if its main run had died inside the window: no main_score.json is written.
    probe = CBSProbeCallback(**PROBE, side_jobs=side_jobs(keep_checkpoints=True), output_dir=tmp_path)
    fit(probe, max_steps=19)
    folder = tmp_path / "cbs_probe_jobs" / "probe000_160tokens"
    (folder / "main_score.json").unlink()
    (folder / "scores.json").unlink()
    job = json.loads((folder / "job.json").read_text())
    job["main"]["pid"] = _dead_pid()  # as if the main run's process had ended
    (folder / "job.json").write_text(json.dumps(job))
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "lit_cbs.probe.side_jobs", str(folder / "job.json")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 1 and not (folder / "scores.json").exists()
    assert f"MainRunGone: the main run (process {job['main']['pid']}) has ended before its score" in result.stderr
    assert time.monotonic() - started < 120  # it does not wait for the heartbeat's silence


def _dead_pid() -> int:
    """The id of a process that has ended (and was reaped)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_silent_main_run_is_gone_after_a_while(tmp_path):
    heartbeat = tmp_path / "main.alive"
    heartbeat.touch()
    main = {"host": "another-host", "pid": 1, "heartbeat": str(heartbeat)}
    assert main_is_gone(main) is None
    os.utime(heartbeat, (time.time() - 2 * MAIN_SILENCE_SECONDS,) * 2)
    assert main_is_gone(main).startswith("the main run has not been heard from for ")


def test_a_job_does_not_inherit_the_main_runs_process_group(tmp_path, monkeypatch):
    # Under torchrun the main run's ranks carry these; a job that kept them took itself for one of its ranks.
    for name, value in {"TORCHELASTIC_RUN_ID": "run", "LOCAL_RANK": "1", "GROUP_RANK": "0", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    launcher = LocalLauncher()
    code = "import json, os; print(json.dumps(sorted(os.environ)))"
    handle = launcher.submit(["-c", code], tmp_path, "env")
    while launcher.state(handle).running:
        time.sleep(0.05)
    seen = json.loads((tmp_path / "env.log").read_text())
    assert "PATH" in seen and not {"TORCHELASTIC_RUN_ID", "LOCAL_RANK", "GROUP_RANK", "MASTER_PORT"} & set(seen)


@pytest.mark.slow
def test_the_main_run_looks_for_results_at_most_every_look_seconds(side_job_run, tmp_path):
    # The toy's steps take milliseconds: with looks at most every 2 s the run looks a few times, not at every step,
    # and still takes every reading (the last ones when training ends).
    probe = CBSProbeCallback(**PROBE, side_jobs=side_jobs(look_seconds=2), output_dir=tmp_path)
    fit(probe, max_steps=STEPS)
    uninterrupted, _, _ = side_job_run
    looks = probe.status()["side_jobs"]["polls"]
    assert looks < STEPS / 2, looks
    assert [(r.tokens, r.losses) for r in probe.history] == [(r.tokens, r.losses) for r in uninterrupted.history]
