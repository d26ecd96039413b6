"""recipes/train.py end to end in subprocesses, on a small text folder: what a run leaves (metrics.csv,
summary.json, checkpoints, plots), preparing data from the folder (and training the same weights as a
run that finds it prepared), resuming from a checkpoint, DDP with 2 CPU processes under torchrun,
and a sweep past a failing job. (The recipe under FSDP2 with 2 processes: tests/models/test_hf.py, on a
transformers model, through the same CausalLM sharding code the OLMo decoder takes.)"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from launch import run_forked, subprocess_env
from recipe_runs import ROOT, TORCHRUN_TRAIN, TRAIN_SCRIPT

from lit_cbs.analysis.curves import read_metrics_csv
from lit_cbs.run.report import summary_text

TRAIN = str(TRAIN_SCRIPT)
pytestmark = pytest.mark.slow

# 8 optimizer steps of 8 then 16 samples of 128 tokens: the batch doubles at 4,096 tokens and the
# micro-batch with it (batch.max_micro_batch_size=64: 8, then 16 samples, accumulation 1; data.batch_size
# is the start, 4), validation every 2,048 tokens, a checkpoint every 2 steps, CBS probes (k = 1, 2) over
# windows of 4,096 tokens from 2,048 and 8,192 tokens.
SMALL_RUN = [
    "data.batch_size=4",
    "batch.schedule.batch_sizes=[8,16]",
    "batch.schedule.thresholds=[0,4096]",
    "max_tokens=12288",
    "lr_schedule.warmup_tokens=1024",
    "val_check_tokens=2048",
    "callbacks.checkpoint.every_n_train_steps=2",
    "callbacks.progress_bar=null",
    "trainer.enable_progress_bar=false",
    "callbacks.cbs_probe.geometric=[2048,4.0]",
    "callbacks.cbs_probe.window_tokens=4096",
    "callbacks.cbs_probe.multipliers=[1,2]",
    "callbacks.cbs_probe.heldout_batches=2",
]
CPU_PROCESSES = ["trainer.accelerator=cpu", "trainer.precision=32-true", "trainer.devices=2"]


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = subprocess_env(PYTHONPATH=str(ROOT), HYDRA_FULL_ERROR="1")
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def started_in(folder: Path, *args: str) -> subprocess.CompletedProcess:
    """recipes/train.py started from ``folder`` as a user starts it (no HYDRA_FULL_ERROR), whatever its exit code."""
    env = subprocess_env(PYTHONPATH=str(ROOT))
    env.pop("HYDRA_FULL_ERROR", None)
    command = [sys.executable, TRAIN, *args]
    return subprocess.run(command, cwd=folder, capture_output=True, text=True, env=env, timeout=300)


def train(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """SMALL_RUN with ``overrides`` into ``run_dir``, in a process of its own that imports nothing again (a copy of
    this one): the tests of a run's files and printed summary. Those of what a user sees as recipes/train.py starts
    (warnings, one-line refusals) start it afresh (``started_in``)."""
    env = {"PYTHONPATH": str(ROOT), "HYDRA_FULL_ERROR": "1"}
    arguments = [*SMALL_RUN, *overrides, f"hydra.run.dir={run_dir}"]
    result = run_forked(TRAIN_SCRIPT, *arguments, cwd=run_dir.parent, env=env, capture_output=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def torchrun_train(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    return run(
        [*TORCHRUN_TRAIN, *SMALL_RUN, *CPU_PROCESSES, *overrides, f"hydra.run.dir={run_dir}"], cwd=run_dir.parent
    )


@pytest.fixture(scope="module")
def text_folder(tmp_path_factory) -> Path:
    """About 170 kB of Python source: a few standard-library files."""
    folder = tmp_path_factory.mktemp("texts")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("argparse.py", "textwrap.py", "string.py", "json/decoder.py", "json/encoder.py"):
        (folder / name.replace("/", "_")).write_bytes((stdlib / name).read_bytes())
    return folder


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, text_folder):
    """One run that prepares its data from the text folder; later tests train on that preparation."""
    base = tmp_path_factory.mktemp("runs")
    cache = base / "cache"
    result = train(base / "first", f"data.input_dir={text_folder}", f"data.cache_dir={cache}")
    (prepared,) = cache.iterdir()
    return base / "first", prepared, result.stdout


def test_run_outputs(first_run):
    run_dir, _, stdout = first_run
    metrics = read_metrics_csv(run_dir / "metrics.csv")
    assert {"train/loss", "val/loss", "tokens_seen", "batch/global_size", "lr", "perf/tokens_per_s"} <= set(metrics)
    assert list(metrics["tokens_seen"][1]) == [1024.0 * (k + 1) for k in range(4)] + [
        4096.0 + 2048 * k for k in range(1, 5)
    ]
    assert list(metrics["batch/global_size"][1]) == [8.0] * 4 + [16.0] * 4  # each row: the batch of its own step
    history = json.loads((run_dir / "batch_history.json").read_text())
    assert [(c["step"], c["new_global_batch"]) for c in history["changes"]] == [(4, 16)]
    assert history["final"]["tokens_seen"] == 12288
    for name in ("loss_vs_tokens.png", "batch_lr_vs_tokens.png", "resolved_config.yaml", "checkpoints/last.ckpt"):
        assert (run_dir / name).is_file(), name
    assert (run_dir / "loss_vs_tokens.png").read_bytes()[:4] == b"\x89PNG"
    probes = [json.loads(line) for line in (run_dir / "cbs_probe.jsonl").read_text().splitlines()]
    # The first window spans the batch change, so the main run is no k=1 baseline: k=1 is trained.
    assert [(p["tokens"], p["batch_size"], p["branches_trained"]) for p in probes] == [
        (2048, 8, [1.0, 2.0]),
        (8192, 16, [2.0]),
    ]
    assert (run_dir / "cbs_curve.png").read_bytes()[:4] == b"\x89PNG"
    # report.html embeds those, and its own wall-clock figure, drawn into the run folder.
    assert 'data-figures="4"' in (run_dir / "report.html").read_text() and (run_dir / "wall_clock.png").is_file()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["tokens"], summary["optimizer_steps"], summary["first_batch"], summary["final_batch"]) == (
        12288,
        8,
        8,
        16,
    )
    assert summary["batch_changes"] == [
        {"step": 4, "tokens": 4096, "old": 8, "new": 16, "lr_factor": 2**0.5, "micro_batch_size": 16, "accumulate": 1}
    ]
    assert list(metrics["batch/micro_batch_size"][1]) == [8.0] * 4 + [16.0] * 4
    assert list(metrics["batch/accumulate"][1]) == [1.0] * 8
    seconds = metrics["fit_seconds"][1]
    assert all(later > earlier > 0 for earlier, later in zip(seconds, seconds[1:]))
    assert seconds[-1] <= summary["fit_seconds"]
    # Periodic checkpoints every 2 steps, but not inside a probe window (steps 3-5 and 7-8): last.ckpt held the
    # window's start while it ran, and holds the final step now.
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "last.ckpt",
        "step0000002.ckpt",
        "step0000006.ckpt",
        "step0000008.ckpt",
    ]
    assert summary["final_val_loss"] == pytest.approx(metrics["val/loss"][1][-1])
    assert summary_text(summary) in stdout  # the run ends by printing its summary
    # Branch steps: k=1 and k=2 at batch 8 (4 and 2 steps of a 4,096-token window), k=2 at batch 16 (1 step).
    assert summary["probe"]["tokens"] == 3 * 4096 and summary["probe"]["optimizer_steps"] == 4 + 2 + 1
    assert [r["k_star"] for r in summary["probe"]["readings"]] == [p["k_star"] for p in probes]


def test_prepared_from_text_folder(first_run, text_folder):
    _, prepared, _ = first_run
    metadata = json.loads((prepared / "lit_cbs.json").read_text())
    source_bytes = sum(path.stat().st_size for path in text_folder.iterdir())
    assert metadata["source_bytes"] == source_bytes and metadata["num_documents"] == 5
    assert metadata["train_tokens"] + metadata["val_tokens"] == source_bytes + 5  # bytes plus one EOS per file


def test_a_run_that_prepares_its_data_equals_a_run_that_finds_it_prepared(first_run, text_folder):
    """Same seed, same config: the first run prepares the folder into the empty cache, the second
    finds it there. Both must train the same weights on the same batches."""
    run_dir, prepared, _ = first_run
    cached = run_dir.parent / "cached"
    train(cached, f"data.input_dir={text_folder}", f"data.cache_dir={prepared.parent}")
    assert list(prepared.parent.iterdir()) == [prepared]  # a cache hit: nothing prepared again
    first, second = (read_metrics_csv(folder / "metrics.csv") for folder in (run_dir, cached))
    for name in ("train/loss", "val/loss"):
        assert first[name][1].tolist() == second[name][1].tolist(), name
    prepared_weights, cached_weights = (
        torch.load(folder / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
        for folder in (run_dir, cached)
    )
    assert prepared_weights.keys() == cached_weights.keys()
    assert all(torch.equal(prepared_weights[key], cached_weights[key]) for key in prepared_weights)


def test_data_kjv_trains_on_the_king_james_bible(tmp_path):
    cache = tmp_path / "cache"
    train(tmp_path / "run", "data=kjv", f"data.cache_dir={cache}")
    (prepared,) = (folder for folder in cache.iterdir() if (folder / "lit_cbs.json").is_file())  # not the books
    assert json.loads((prepared / "lit_cbs.json").read_text())["num_documents"] == 66
    assert read_metrics_csv(tmp_path / "run" / "metrics.csv")["train/loss"][1].size > 0


def test_resume_continues_exactly(first_run):
    run_dir, prepared, _ = first_run
    resumed = run_dir.parent / "resumed"
    train(resumed, f"data.path={prepared}", f"ckpt_path={run_dir / 'checkpoints' / 'step0000006.ckpt'}")
    assert json.loads((resumed / "summary.json").read_text())["optimizer_steps"] == 8
    metrics = read_metrics_csv(resumed / "metrics.csv")
    assert metrics["tokens_seen"][1][0] == 10240  # the first step after the checkpoint
    uninterrupted = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    continued = torch.load(resumed / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert uninterrupted.keys() == continued.keys()
    assert all(torch.equal(uninterrupted[key], continued[key]) for key in uninterrupted)


def test_torchrun_ddp(first_run):
    run_dir, prepared, _ = first_run
    ddp_dir = run_dir.parent / "ddp"
    torchrun_train(ddp_dir, "trainer=ddp", f"data.path={prepared}")
    metrics = read_metrics_csv(ddp_dir / "metrics.csv")
    # Two ranks: 8 samples (1,024 tokens) per step, micro-batch 4; after the change micro-batch 8, no accumulation.
    assert metrics["tokens_seen"][1][0] == 1024 and list(metrics["batch/micro_batch_size"][1][[0, -1]]) == [4, 8]
    assert set(metrics["batch/accumulate"][1]) == {1}
    assert metrics["tokens_seen"][1][-1] == 12288


def test_a_sweep_goes_on_past_a_failing_job(first_run, tmp_path):
    _, prepared, _ = first_run
    result = started_in(
        tmp_path,
        "-m",
        *SMALL_RUN,
        f"data.path={prepared}",
        "callbacks.cbs_probe=null",
        "batch.max_micro_batch_size=null",
        "data.batch_size=5,4",
        f"hydra.sweep.dir={tmp_path}",
    )
    assert result.returncode == 1  # the sweep reports the failed job once all jobs ran
    failed = tmp_path / "0_tiny_warmup_data.batch_size=5"
    done = tmp_path / "1_tiny_warmup_data.batch_size=4"
    assert (
        "error: global batch (batch.schedule) 8 is not a multiple of micro-batch 5"
        in (failed / "train.log").read_text()
    )
    assert json.loads((done / "summary.json").read_text())["optimizer_steps"] == 8
    log = (done / "train.log").read_text()
    assert "BatchWarmup: global batch 8 -> 16 samples" in log and "lit_cbs: tiny_warmup done" in log


def test_configuration_error_is_one_line_and_leaves_no_folder(tmp_path):
    result = started_in(tmp_path, "model.config.preset=olmo_3b")
    assert result.returncode == 1  # the last line on stderr names the key, the value and the choices
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith("error: model.config: unknown model preset 'olmo_3b'; known presets: ")
    )
    assert list(tmp_path.iterdir()) == []  # no outputs/tiny_warmup/<date>/ with Hydra's files and a log of the error


def test_a_lightning_key_the_recipes_replace_is_refused_in_one_line_before_anything_starts(tmp_path):
    result = started_in(tmp_path, "trainer.val_check_interval=64")
    assert result.returncode == 1 and "Could not override" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: trainer.val_check_interval=64: the recipes validate by tokens")
    assert list(tmp_path.iterdir()) == []


def test_a_run_refused_inside_fit_before_its_first_step_leaves_no_folder(prepared, tmp_path):
    result = started_in(tmp_path, *SMALL_RUN, f"data.path={prepared}", "optimizer=sgd", "batch.beta2_rule=half_life")
    assert result.returncode == 1
    assert "batch.beta2_rule='half_life'" in result.stderr.strip().splitlines()[-1]
    assert list(tmp_path.iterdir()) == []  # nor its resolved_config.yaml, metrics.csv, checkpoints/ or logs


def test_a_refused_run_in_the_folder_of_one_that_trained_removes_none_of_its_files(first_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(first_run[0], run_dir)
    before = {path.relative_to(run_dir): path.read_bytes() for path in run_dir.rglob("*") if path.is_file()}
    result = started_in(tmp_path, "model.config.preset=olmo_3b", f"hydra.run.dir={run_dir}")
    assert result.returncode == 1
    after = {path.relative_to(run_dir): path.read_bytes() for path in run_dir.rglob("*") if path.is_file()}
    assert after.keys() == before.keys()
    # Hydra rewrote its .hydra/ files and the log has the error appended; every file the trained run wrote is intact.
    kept = [name for name in before if name.parts[0] != ".hydra" and name != Path("train.log")]
    assert kept and all(after[name] == before[name] for name in kept)


def test_a_plan_writes_nothing_and_a_conf_folder_of_your_own_holds_your_options(tmp_path):
    # batch=mine from ./conf/batch/mine.yaml, where the user runs; plan=true leaves no folder behind.
    (tmp_path / "conf" / "batch").mkdir(parents=True)
    mine = (
        (ROOT / "conf" / "batch" / "warmup.yaml")
        .read_text()
        .replace("batch_sizes: [16, 32, 64]", "batch_sizes: [16, 32, 128]")
    )
    assert mine != (ROOT / "conf" / "batch" / "warmup.yaml").read_text()
    (tmp_path / "conf" / "batch" / "mine.yaml").write_text(mine)
    result = started_in(tmp_path, "plan=true", "batch=mine")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [
        line.split()
        for line in result.stdout.splitlines() + result.stderr.splitlines()
        if line.strip().startswith("2,523,136")
    ]
    assert rows and rows[0][2] == "128"  # the phase from 2,523,136 tokens trains at batch 128: the option was read
    assert sorted(path.name for path in tmp_path.iterdir()) == ["conf"]  # no outputs/ folder, no .hydra, no train.log


def test_a_folder_without_conf_of_its_own_starts_without_a_warning(tmp_path):
    # conf/config.yaml adds ./conf to Hydra's search path for your own options; none here is no reason to warn.
    result = started_in(tmp_path, "plan=true")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Warning" not in result.stderr and "is not available" not in result.stderr, result.stderr
    assert list(tmp_path.iterdir()) == []
