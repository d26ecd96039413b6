"""``python -m lit_cbs.litgpt pretrain``: LitGPT's own loop, a 2-layer GPT on a byte tokenizer, data prepared here."""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("litgpt")
from litgpt.pretrain import get_lr  # noqa: E402

from lit_cbs.litgpt.__main__ import CONFIG_VARIABLE, main  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = {"name": "tiny", "block_size": 64, "vocab_size": 258, "padded_vocab_size": 258}
MODEL |= {"n_layer": 2, "n_head": 2, "n_embd": 32}
SCHEDULE = {"_target_": "lit_cbs.PiecewiseBatch", "batch_sizes": [4, 8, 16], "thresholds": [0, 4096, 8192]}


def byte_tokenizer(folder: Path) -> None:
    """A tokenizer.json of the 256 bytes and two special tokens, made here (no model hub)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {byte: i for i, byte in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|bos|>", "<|eos|>"])
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    special = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(special))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer and four text files of the standard library (LitGPT's TextFiles: the first is validation)."""
    root = tmp_path_factory.mktemp("litgpt")
    byte_tokenizer(root / "tokenizer")
    (root / "texts").mkdir()
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40]
    for part in range(4):
        text = "".join(path.read_text(errors="replace") for path in sources[part * 10 : (part + 1) * 10])
        (root / "texts" / f"part{part}.txt").write_text(text)
    return root


def litgpt_config(workspace: Path, out_dir: str, max_tokens: int, save_interval: int = 1000) -> Path:
    """LitGPT's own configuration of the run (``--config``)."""
    config = {
        "model_name": "tiny",
        "model_config": MODEL,
        "tokenizer_dir": "tokenizer",
        "data": {"class_path": "litgpt.data.TextFiles", "init_args": {"train_data_path": "texts", "num_workers": 0}},
        "train": {
            **{"micro_batch_size": 2, "global_batch_size": 4, "max_tokens": max_tokens, "max_seq_length": 64},
            **{"lr_warmup_steps": 4, "save_interval": save_interval, "log_interval": 1},
        },
        "eval": {"interval": 1000, "max_iters": 2},
        "out_dir": out_dir,
        "precision": "32-true",
        "logger_name": "csv",
    }
    path = workspace / f"{out_dir}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def lit_cbs_config(workspace: Path, name: str, **content: object) -> Path:
    path = workspace / f"{name}.lit_cbs.yaml"
    path.write_text(yaml.safe_dump({"lr_rule": "sqrt", "compile": False, **content}))
    return path


def pretrain(workspace: Path, config: Path, lit_cbs: Path, *extra: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "lit_cbs.litgpt", "pretrain", "--config", str(config), *extra]
    return subprocess.Popen(
        [*command, "--lit_cbs", str(lit_cbs)],
        cwd=workspace,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finished(process: subprocess.Popen[str]) -> str:
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output[-3000:]
    return output


def logged_steps(out_dir: Path) -> list[dict[str, float]]:
    """lit_cbs's row of each optimizer step in the last fit's metrics.csv (LitGPT's own rows hold its columns)."""
    versions = sorted((out_dir / "logs" / "csv").glob("version_*"), key=lambda path: int(path.name.split("_")[1]))
    with (versions[-1] / "metrics.csv").open() as file:
        rows = [row for row in csv.DictReader(file) if row["batch/global_size"]]
    return [{key: float(value) for key, value in row.items() if value} for row in rows]


@pytest.fixture(scope="module")
def reference(workspace: Path) -> Path:
    """The uninterrupted run: 4 -> 8 -> 16 sequences at 4,096 and 8,192 tokens, 16,384 tokens in all."""
    lit_cbs = lit_cbs_config(workspace, "warmup", schedule=SCHEDULE)
    finished(pretrain(workspace, litgpt_config(workspace, "reference", 16384, save_interval=2), lit_cbs))
    return workspace / "reference"


def test_the_batch_changes_at_the_scheduled_tokens_with_the_lr_factors_exact(reference: Path) -> None:
    rows = logged_steps(reference)
    assert len(rows) == 4096 // 64 // 4 + 4096 // 64 // 8 + 8192 // 64 // 16 == 32  # 16 + 8 + 8 steps
    max_iters = 16384 // (2 * 64)
    for row in rows:
        tokens_before = row["tokens_seen"] - row["batch/global_size"] * 64
        batch = 4 if tokens_before < 4096 else 8 if tokens_before < 8192 else 16
        assert row["batch/global_size"] == batch
        iteration = int(row["tokens_seen"] // (2 * 64)) - 1  # the step's last micro-batch set its LR
        # litgpt's own LR (its warmup of 4 steps of 2 micro-batches), times sqrt(2) per doubling
        expected = get_lr(1e-3, iteration, 4 * 2, max_iters, 4e-5) * math.sqrt(batch / 4)
        assert row["lr"] == pytest.approx(expected, rel=1e-12, abs=0)
    history = json.loads((reference / "batch_history.json").read_text())
    assert [(c["tokens_seen"], c["old_accumulate"], c["new_accumulate"]) for c in history] == [
        (4096, 2, 4),
        (8192, 4, 8),
    ]
    final = torch.load(reference / "final" / "lit_model.pth", weights_only=False)
    assert (final["iter_num"], final["step_count"]) == (128, 32)
    assert final["lit_cbs"]["core"]["global_batch"] == 16


def test_a_run_killed_and_resumed_ends_bitwise_where_the_uninterrupted_one_ends_and_goes_on_on_two_devices(
    workspace: Path, reference: Path
) -> None:
    lit_cbs = lit_cbs_config(workspace, "warmup", schedule=SCHEDULE)
    config = litgpt_config(workspace, "killed", 16384, save_interval=2)
    process = pretrain(workspace, config, lit_cbs)
    inside = workspace / "killed" / "step-00000018" / "lit_model.pth"  # between the changes at steps 16 and 24
    while not inside.is_file() and process.poll() is None:
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    output, _ = process.communicate()
    assert process.returncode == -signal.SIGKILL, output[-2000:]
    assert not (workspace / "killed" / "final").exists(), "killed after the run ended: nothing was tested"
    shutil.copytree(workspace / "killed", workspace / "two_devices")
    output = finished(pretrain(workspace, config, lit_cbs, "--resume", "auto"))
    assert "Resuming training from" in output
    ours = torch.load(workspace / "killed" / "final" / "lit_model.pth", weights_only=False)
    theirs = torch.load(reference / "final" / "lit_model.pth", weights_only=False)
    for name, tensor in theirs["model"].items():
        assert torch.equal(ours["model"][name], tensor), name
    for index, state in theirs["optimizer"]["state"].items():
        assert all(torch.equal(ours["optimizer"]["state"][index][key], value) for key, value in state.items())
    assert ours["optimizer"]["param_groups"] == theirs["optimizer"]["param_groups"]
    assert ours["lit_cbs"]["core"] == theirs["lit_cbs"]["core"]
    assert (ours["iter_num"], ours["step_count"]) == (theirs["iter_num"], theirs["step_count"])

    # The same checkpoint resumed on 2 devices (DDP: Lightning has no FSDP on CPUs): the global batch at every token
    # count as in the uninterrupted run, 2 micro-batches of 2 per step fewer per device, and LitGPT's own LR (its
    # iterations are per device: the step's LR is get_lr's at its last micro-batch there) times the same factors.
    ddp = lit_cbs_config(workspace, "warmup_ddp", schedule=SCHEDULE, strategy="ddp")
    config = litgpt_config(workspace, "two_devices", 16384, save_interval=2)
    finished(pretrain(workspace, config, ddp, "--resume", "auto", "--devices", "2"))
    before = {row["tokens_seen"]: row["batch/global_size"] for row in logged_steps(reference)}
    rows = logged_steps(workspace / "two_devices")
    assert rows[0]["tokens_seen"] > 18 * 4 * 64 and rows[-1]["tokens_seen"] == 16384  # from the kill on
    for row in rows:
        assert row["batch/global_size"] == before[row["tokens_seen"]]
        iteration = int(row["tokens_seen"] // (2 * 2 * 64)) - 1
        expected = get_lr(1e-3, iteration, 4 * 1, 16384 // 2 // (2 * 64), 4e-5) * math.sqrt(
            row["batch/global_size"] / 4
        )
        assert row["lr"] == pytest.approx(expected, rel=1e-12, abs=0)
    final = torch.load(workspace / "two_devices" / "final" / "lit_model.pth", weights_only=False)
    assert (final["iter_num"], final["step_count"], final["lit_cbs"]["core"]["accumulate"]) == (64, 32, 4)


def test_cbs_adaptive_grows_the_batch_from_side_job_readings_equal_to_a_checkpoint_probe(workspace: Path) -> None:
    probe = {
        **{"every_tokens": 4096, "multipliers": [1, 2], "window_tokens": 2048, "evaluate": "heldout"},
        **{"heldout_batches": 4, "epsilon": 0.3},
        "side_jobs": {
            "launcher": {"_target_": "lit_cbs.probe.LocalLauncher", "threads": 1},
            **{"keep_checkpoints": True, "wait_at_end": 5, "look_seconds": 0},
        },
    }
    schedule = {"_target_": "lit_cbs.CBSAdaptive", "start": 4, "final": 16}
    lit_cbs = lit_cbs_config(workspace, "adaptive", schedule=schedule, probe=probe)
    output = finished(pretrain(workspace, litgpt_config(workspace, "adaptive", 262144), lit_cbs))
    run = workspace / "adaptive"
    readings = [json.loads(line) for line in (run / "cbs_probe.jsonl").read_text().splitlines()]
    first = readings[0]
    assert (first["tokens"], first["batch_size"], first["mode"], first["determined"]) == (4096, 4, "side_jobs", True)
    assert first["adaptive_batch"] == 8 and "failed" not in output.split("lit_cbs:")[-1]
    history = json.loads((run / "batch_history.json").read_text())
    assert history[0]["new_global_batch"] == 8
    assert history[0]["tokens_seen"] >= first["arrived_at_tokens"]  # grown once the reading was in, not before
    rows = logged_steps(run)
    assert {row["batch/global_size"] for row in rows if row["tokens_seen"] > history[0]["tokens_seen"] + 512} >= {8}
    # The point's checkpoint (kept), probed afresh: the side job's reading, every branch's held-out loss alike.
    checkpoint = next((run / "cbs_probe_jobs").glob("probe000_*")) / "lit_model.pth"
    command = [sys.executable, "-m", "lit_cbs.litgpt", "probe", str(checkpoint), "--lit_cbs", str(lit_cbs)]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}  # the side job's threads
    result = subprocess.run(command, cwd=workspace, capture_output=True, text=True, env=environment, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    again = json.loads(result.stdout.strip().splitlines()[-1])
    for key in ("tokens", "step", "batch_size", "losses", "batch_losses", "k_star", "cbs_lower", "determined"):
        assert again[key] == first[key], key
    assert again["mode"] == "checkpoint"


@pytest.mark.parametrize(
    ("argument", "said"),
    [
        ("--train.global_batch_size=8", "--train.global_batch_size=8 but the lit_cbs schedule starts at 4 sequences"),
        ("--train.max_tokens=16640", "--train.max_tokens=16640 trains 260 sequences"),  # not a multiple of 16
    ],
)
def test_settings_litgpt_cannot_train_are_refused_naming_its_flag(
    workspace: Path, monkeypatch: pytest.MonkeyPatch, argument: str, said: str
) -> None:
    monkeypatch.chdir(workspace)
    monkeypatch.delenv(CONFIG_VARIABLE, raising=False)  # main() exports it for other devices' processes: undone after
    lit_cbs = lit_cbs_config(workspace, "warmup", schedule=SCHEDULE)
    config = litgpt_config(workspace, "refused", 16384)
    with pytest.raises(SystemExit, match=said.replace(".", r"\.").replace("[", r"\[")):
        main(["pretrain", "--config", str(config), argument, "--lit_cbs", str(lit_cbs)])
    assert not (workspace / "refused" / "final").exists()


def test_a_lit_cbs_config_is_checked_before_litgpt_starts(workspace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CONFIG_VARIABLE, raising=False)
    bad = lit_cbs_config(workspace, "bad", schedule=SCHEDULE, probe={"every_tokens": 4096})
    with pytest.raises(SystemExit, match="probe.side_jobs is missing"):
        main(["pretrain", "--lit_cbs", str(bad)])
    typo = lit_cbs_config(workspace, "typo", schedule=SCHEDULE, lr_rul="sqrt")
    with pytest.raises(SystemExit, match="unknown key 'lr_rul'"):
        main(["pretrain", "--lit_cbs", str(typo)])


def test_litgpts_gpt_trains_in_a_lightning_trainer_with_batch_warmup_and_the_probe(
    workspace: Path, reference: Path, tmp_path: Path
) -> None:
    """The other way in: ``LitGPTModule`` on the data LitGPT prepared (the reference run's), lit_cbs's callbacks."""
    import lightning.pytorch as pl
    from litgpt.config import Config

    from lit_cbs import BatchWarmup, CBSProbeCallback, PiecewiseBatch
    from lit_cbs.data import TokenDataModule
    from lit_cbs.litgpt import LitGPTModule

    module = LitGPTModule(Config(**MODEL), {"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-3}})
    data = TokenDataModule(path=workspace / "texts", seq_len=64, batch_size=2)
    warmup = BatchWarmup(PiecewiseBatch([4, 8], [0, 2048]), lr_rule="sqrt", max_tokens=4096)
    probe = CBSProbeCallback(at_tokens=[1024], multipliers=[1, 2], window_tokens=512, output_dir=tmp_path)
    trainer = pl.Trainer(
        callbacks=[warmup, probe], max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    trainer.fit(module, data)
    assert [(change.tokens_seen, change.new_global_batch) for change in warmup.history] == [(2048, 8)]
    assert warmup.accounting is not None and warmup.accounting.tokens_seen == 4096
    (reading,) = probe.history
    assert (reading.tokens, reading.batch_size, reading.branches_trained) == (1024, 4, [1.0, 2.0])


def test_a_probe_of_a_checkpoint_trains_on_the_rows_the_run_trains_next(
    workspace: Path, reference: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The window a probe reads from a checkpoint (its loader's saved position) is what LitGPT's loop, resumed from
    it, trains on: the loop's iterator is watched, nothing else changed."""
    from litgpt import pretrain as litgpt_pretrain

    from lit_cbs.litgpt import checkpoint_parts

    trained: list[torch.Tensor] = []

    class Watched(litgpt_pretrain.CycleIterator):  # type: ignore[misc]
        def __next__(self) -> torch.Tensor:
            batch = super().__next__()
            trained.extend(batch.unbind(0))
            return batch

    monkeypatch.setattr(litgpt_pretrain, "CycleIterator", Watched)
    monkeypatch.chdir(workspace)
    monkeypatch.delenv(CONFIG_VARIABLE, raising=False)
    checkpoint = reference / "step-00000018" / "lit_model.pth"
    parts = checkpoint_parts(checkpoint)
    assert parts.datamodule is not None
    window = [row for batch, _ in zip(parts.datamodule.train_dataloader(), range(8)) for row in batch.unbind(0)]
    lit_cbs = lit_cbs_config(workspace, "warmup", schedule=SCHEDULE)
    config = litgpt_config(workspace, "next_rows", 16384)
    main(["pretrain", "--config", str(config), "--resume", str(checkpoint), "--lit_cbs", str(lit_cbs)])
    assert len(window) == 16 and len(trained) >= 16
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(window, trained[:16]))
