"""recipes/train.py on a real SLURM cluster (tests/slurm/cluster.sh: two nodes on this machine), through the sbatch
script the docs give users (recipes/slurm/train.sbatch): DDP and FSDP2 over two nodes, a run grown from one node to
two as its batch grows, preemption and Lightning's auto-requeue (also inside a CBS probe), a Hydra sweep through the
submitit launcher, and CBS probes whose branches run as SLURM side jobs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from omegaconf import OmegaConf
from recipe_runs import ROOT, compose_config
from recipe_runs import train as train_script

from lit_cbs.probe import SlurmLauncher

# The cluster (a session fixture) listens on fixed ports: pytest-xdist runs a file's tests in one worker.
pytestmark = [pytest.mark.slurm, pytest.mark.slow]
SBATCH = ROOT / "recipes" / "slurm" / "train.sbatch"
TESTS = ROOT / "tests"

# The default recipe, short: 8 optimizer steps of 128-token samples, batch 8 then 16 from 4,096 tokens (micro-batch 8),
# on the CPU in fp32 (one process per task).
SHORT = [
    "data.batch_size=8",
    "batch.schedule.batch_sizes=[8,16]",
    "batch.schedule.thresholds=[0,4096]",
    "batch.max_micro_batch_size=8",
    "max_tokens=12288",
    "lr_schedule.warmup_tokens=1024",
    "val_check_tokens=4096",
    "callbacks.cbs_probe=null",
    "callbacks.progress_bar=null",
    "trainer.enable_progress_bar=false",
    "data.val_fraction=0.1",
    "plots=false",
]
CPU_DDP = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.precision=32-true"]
CPU_FSDP = ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.precision=32-true"]


def job_env(slurm_cluster: dict[str, str], **extra: str) -> dict[str, str]:
    """The environment sbatch passes on to a job: this Python first on PATH, tests/ importable, the cluster's conf."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("SLURM_", "MASTER_", "LOCAL_RANK"))}
    env.update(slurm_cluster)
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    env["PYTHONPATH"] = f"{TESTS}:{ROOT}"
    env["LIT_CBS"] = str(ROOT)
    env["OMP_NUM_THREADS"] = "1"  # a node is one core
    env.update(extra)
    return env


def sbatch(env: dict[str, str], cwd: Path, *arguments: str) -> str:
    """Submit and return the job id."""
    cwd.mkdir(parents=True, exist_ok=True)
    submitted = subprocess.run(["sbatch", "--parsable", *arguments], capture_output=True, text=True, env=env, cwd=cwd)
    assert submitted.returncode == 0, submitted.stderr
    return submitted.stdout.strip().split(";")[0]


def wait_for(condition, what: str, timeout: float = 300, job: tuple[dict, Path, str] | None = None) -> None:
    """Wait until ``condition()``; fail if ``timeout`` seconds pass first, or if ``job`` (env, folder, id) ends."""
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        if job is not None and finished(job[0], job[2]) and not condition():
            pytest.fail(f"job {job[2]} ended before {what}:\n{job_log(job[1], job[2])[-3000:]}")
        time.sleep(1)


def finished(env: dict[str, str], job: str) -> bool:
    return not subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True, env=env).stdout.strip()


def wait_for_jobs(env: dict[str, str], *jobs: str, timeout: float = 600) -> None:
    wait_for(lambda: all(finished(env, job) for job in jobs), f"SLURM jobs {', '.join(jobs)}", timeout)


def job_log(cwd: Path, job: str) -> str:
    return (cwd / f"slurm-{job}.out").read_text(errors="replace")


def batch_changes(run_dir: Path) -> list[tuple]:
    history = json.loads((run_dir / "batch_history.json").read_text())
    return [(c["step"], c["tokens_seen"], c["old_global_batch"], c["new_global_batch"]) for c in history["changes"]]


def sample_counts(folder: Path, job: str) -> Counter:
    counts: Counter = Counter()
    for path in folder.glob(f"samples-{job}-*-rank*.json"):
        for epoch, indices in json.loads(path.read_text()).items():
            counts.update((int(epoch), index) for index in indices)
    return counts


def record_samples(folder: Path, job: str) -> str:
    return f"+callbacks.samples={{_target_:cluster_callbacks.RecordSamples,folder:'{folder}',job:{job}}}"


def test_the_recipe_on_two_nodes_and_a_run_grown_from_one_node_to_two(slurm_cluster, prepared, tmp_path):
    env = job_env(slurm_cluster)
    data = f"data.path={prepared}"
    samples = tmp_path / "samples"
    two_nodes = sbatch(
        {**env, "RUN_DIR": str(tmp_path / "ddp")}, tmp_path, "--nodes=2", "--ntasks-per-node=1", str(SBATCH),
        *CPU_DDP, *SHORT, data, record_samples(samples, "ddp"),
    )  # fmt: skip
    fsdp = sbatch({**env, "RUN_DIR": str(tmp_path / "fsdp")}, tmp_path, "--nodes=2", "--ntasks-per-node=1", str(SBATCH),
                  *CPU_FSDP, *SHORT, data)  # fmt: skip
    # plan=true's commands for a cluster grown with the batch, submitted as they are printed.
    planned = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "train.py"), "plan=true", "plan_for.max_devices=2", "trainer.devices=1",
         *CPU_DDP, *SHORT, data, record_samples(samples, "phases")],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    phases = [
        line.strip().replace("recipes/slurm/train.sbatch", str(SBATCH))  # submitted from here, not the repository
        for line in planned.stdout.splitlines()
        if line.strip().startswith("RUN_DIR=")
    ]
    assert len(phases) == 2 and "--nodes=1" in phases[0] and "--nodes=2" in phases[1], planned.stdout
    first = subprocess.run(phases[0], shell=True, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    first_job = first.stdout.strip().rsplit(" ", 1)[-1]
    second_command = phases[1].replace("sbatch ", "sbatch --parsable ", 1).replace("<the previous job's id>", first_job)
    second_job = subprocess.run(
        second_command, shell=True, capture_output=True, text=True, env=env, cwd=tmp_path
    ).stdout.strip()
    # The same recipe on one process, here.
    cfg = compose_config(*SHORT, data, output_dir=str(tmp_path / "one"))
    run = train_script.build_run(cfg)
    run.trainer.fit(run.model, datamodule=run.datamodule)
    train_script.write_run_summary(tmp_path / "one", cfg.run_name, run.trainer, run.batch_warmup, 1.0, False)

    wait_for_jobs(env, two_nodes, fsdp, first_job, second_job)
    for name, job in (("ddp", two_nodes), ("fsdp", fsdp)):
        log = job_log(tmp_path, job)
        assert "tokens           12,288" in log, log[-3000:]
        assert batch_changes(tmp_path / name) == batch_changes(tmp_path / "one") == [(4, 4096, 8, 16)]
        assert json.loads((tmp_path / name / "summary.json").read_text())["tokens"] == 12288
    # One process on each node, joined by Lightning's SLURMEnvironment.
    assert "All distributed processes registered. Starting with 2 processes" in job_log(tmp_path, two_nodes)
    phase2 = tmp_path / "outputs" / "tiny_warmup" / "phase2"
    assert batch_changes(phase2) == batch_changes(tmp_path / "ddp")
    assert json.loads((phase2 / "summary.json").read_text())["tokens"] == 12288
    # Every sample trained as often as in the uninterrupted run on two nodes: the phases together read the same.
    assert (
        sample_counts(samples, "phases") == sample_counts(samples, "ddp")
        and sum(sample_counts(samples, "ddp").values()) == 96
    )


PROBED = [
    *SHORT[:7],
    "callbacks.checkpoint.every_n_train_steps=2",
    "callbacks.progress_bar=null",
    "trainer.enable_progress_bar=false",
    "data.val_fraction=0.1",
    "plots=false",
    "max_tokens=20480",
    "callbacks.cbs_probe.geometric=[2048,4.0]",
    "callbacks.cbs_probe.window_tokens=4096",
    "callbacks.cbs_probe.multipliers=[1,2]",
    "callbacks.cbs_probe.heldout_batches=2",
]


def final_state(run_dir: Path) -> dict:
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    readings = [json.loads(line) for line in (run_dir / "cbs_probe.jsonl").read_text().splitlines()]
    return {
        "step": checkpoint["global_step"],
        "weights": checkpoint["state_dict"],
        "optimizer": checkpoint["optimizer_states"],
        "readings": [(r["tokens"], r["step"], r["losses"], r["batch_losses"]) for r in readings],
    }


def test_preempted_inside_a_probe_and_requeued_by_its_signal_a_run_ends_as_the_uninterrupted_one(
    slurm_cluster, prepared, tmp_path
):
    # The run: a probe whose window spans steps 3-6 (2,048 tokens on, 4,096 tokens, batch 8 then 16), 12 steps in all.
    env = job_env(slurm_cluster)
    markers = tmp_path / "markers"
    arguments = [*CPU_DDP, *PROBED, f"data.path={prepared}"]
    marked = [*arguments, f"+callbacks.markers={{_target_:cluster_callbacks.Markers,folder:'{markers}',steps:[3,8]}}"]
    uninterrupted = sbatch({**env, "RUN_DIR": str(tmp_path / "uninterrupted")}, tmp_path, "--nodelist=n2", str(SBATCH),
                           *arguments)  # fmt: skip
    victim = sbatch({**env, "RUN_DIR": str(tmp_path / "victim")}, tmp_path, "--nodelist=n1", str(SBATCH), *marked)
    # Inside the probe's window a job of the urgent partition takes the node: SLURM sends SIGTERM and requeues the run.
    wait_for(lambda: (markers / "step3").exists(), "the victim inside the probe window", job=(env, tmp_path, victim))
    urgent = sbatch(env, tmp_path, "--partition=urgent", "--nodelist=n1", "--output=urgent-%j.out", "--wrap=sleep 1")
    # After the probe, Lightning's auto-requeue signal (what --signal=USR1@300 sends before the time limit).
    wait_for(lambda: (markers / "step8").exists(), "the requeued victim after the probe", job=(env, tmp_path, victim))
    subprocess.run(["scancel", "--signal=USR1", victim], check=True, env=env)
    wait_for_jobs(env, victim, uninterrupted, urgent)
    log = job_log(tmp_path, victim)
    assert "SIGTERM: stopping after step" in log and "inside the CBS probe whose window began at step 2" in log
    assert "SIGUSR1: stopping after step" in log
    assert log.count("ckpt_path=auto: the newest complete checkpoint") == 2  # resumed twice, by itself
    resumed, reference = final_state(tmp_path / "victim"), final_state(tmp_path / "uninterrupted")
    assert resumed["step"] == reference["step"] == 12 and resumed["readings"] == reference["readings"]
    assert all(torch.equal(resumed["weights"][key], value) for key, value in reference["weights"].items())
    for state, expected in zip(resumed["optimizer"], reference["optimizer"]):
        assert state["param_groups"] == expected["param_groups"]
        for index, tensors in expected["state"].items():
            assert all(torch.equal(state["state"][index][key], value) for key, value in tensors.items())


def test_a_sweep_through_the_submitit_launcher_runs_on_the_cluster_and_fit_es_fits_it(
    slurm_cluster, prepared, tmp_path
):
    env = job_env(slurm_cluster)
    sweep = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "train.py"), "-m", "hydra/launcher=slurm", "+recipe=tiny_es_sweep",
         "batch.schedule.batch_size=8,16,32", "max_tokens=65536", "val_check_tokens=8192", f"data.path={prepared}",
         "data.val_fraction=0.1", "hydra.launcher.partition=main", "hydra.launcher.cpus_per_task=1",
         "hydra.launcher.gpus_per_node=null", "hydra.launcher.timeout_min=60", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900,
    )  # fmt: skip
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    jobs = sorted((tmp_path / "sweep").glob("*_tiny_es_sweep_*"))
    assert len(jobs) == 3 and all((job / "metrics.csv").is_file() for job in jobs)
    slurm_logs = list((tmp_path / "sweep" / ".submitit").rglob("*_log.out"))
    assert len(slurm_logs) == 3  # each point ran as a SLURM job
    fit = subprocess.run([sys.executable, str(ROOT / "recipes" / "fit_es.py"), str(tmp_path / "sweep")],
                         capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert fit.returncode == 0, fit.stderr[-3000:]
    assert re.search(r"B_crit", fit.stdout), fit.stdout


def probed_run(run_dir: Path, prepared: Path, *overrides: str):
    """The PROBED recipe on one process here, its resolved configuration written where side jobs rebuild it from."""
    cfg = compose_config(*[a for a in PROBED if not a.startswith("trainer.")], f"data.path={prepared}", *overrides,
                         output_dir=str(run_dir))  # fmt: skip
    pl.seed_everything(cfg.seed, workers=True)
    run = train_script.build_run(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "resolved_config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    run.trainer.fit(run.model, datamodule=run.datamodule)
    return [json.loads(line) for line in (run_dir / "cbs_probe.jsonl").read_text().splitlines()]


def test_probe_branches_as_slurm_side_jobs_read_what_the_in_process_probe_reads(
    slurm_cluster, prepared, tmp_path, monkeypatch
):
    for key, value in job_env(slurm_cluster).items():  # submitit submits from this process
        monkeypatch.setenv(key, value)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the side jobs (one core per node): the same sums in the same order
    try:
        in_process = probed_run(tmp_path / "in_process", prepared)
        side = probed_run(
            tmp_path / "side", prepared, "side_jobs=slurm", "side_jobs.launcher.partition=main",
            "side_jobs.launcher.cpus_per_task=1", "side_jobs.launcher.timeout_min=10",
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert [r["mode"] for r in side] == ["side_jobs"] * len(in_process) and len(in_process) == 2
    for reading, expected in zip(side, in_process):
        assert (reading["tokens"], reading["losses"], reading["batch_losses"], reading["k_star"]) == (
            expected["tokens"], expected["losses"], expected["batch_losses"], expected["k_star"]
        )  # fmt: skip
    job_logs = list((tmp_path / "side" / "cbs_probe_jobs").rglob("*_log.out"))
    assert len(job_logs) == 2 and all(
        "Starting with JobEnvironment" in log.read_text() for log in job_logs
    )  # SLURM jobs
    # A result file that cannot be read once its job has ended is the job's failure (retried), not a job still running.
    job_id = job_logs[0].name.split("_")[0]
    result = job_logs[0].with_name(f"{job_id}_0_result.pkl")
    result.write_bytes(b"not a pickle")
    state = SlurmLauncher().state({"job_id": job_id, "folder": str(job_logs[0].parent)})
    assert not state.running and state.reason.startswith(f"its result {result} is unreadable (")
