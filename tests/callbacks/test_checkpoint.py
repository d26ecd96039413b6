"""FinalStateCheckpoint: last.ckpt holds the step a run ends with, however it stops."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from launch import subprocess_env
from toys import GlobalOrderRegressionData, RegressionData, RegressionModule, trainer_kwargs

from lit_cbs import BatchWarmup, PiecewiseBatch
from lit_cbs.callbacks.checkpoint import FinalStateCheckpoint

USER_SIGTERM = Path(__file__).resolve().parents[1] / "scripts" / "user_sigterm.py"


class SigtermAt(pl.Callback):
    """Sends this process SIGTERM after the ``micro_batch``-th micro-batch (1-based), as a scheduler would."""

    def __init__(self, micro_batch: int):
        self.micro_batch = micro_batch
        self.seen = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen += 1
        if self.seen == self.micro_batch:
            os.kill(os.getpid(), signal.SIGTERM)


def fit(tmp_path, *callbacks, every_n_train_steps=4, max_tokens=None, **trainer_args):
    """Regression with micro-batch 2, accumulation 2 (4 samples per step); returns trainer and module."""
    checkpoint = FinalStateCheckpoint(
        dirpath=tmp_path,
        filename="step{step}",
        auto_insert_metric_name=False,
        every_n_train_steps=every_n_train_steps,
        save_top_k=-1,
        save_last=True,
    )
    warmup = BatchWarmup(PiecewiseBatch([4], [0], unit="samples"), max_tokens=max_tokens, seq_len=1)
    args = trainer_kwargs(enable_checkpointing=True, max_epochs=2, callbacks=[warmup, checkpoint, *callbacks])
    args.update(trainer_args)
    trainer = pl.Trainer(**args)
    module = RegressionModule()
    trainer.fit(module, datamodule=RegressionData(n=96, batch_size=2))
    return trainer, module


def assert_last_holds(tmp_path, module: RegressionModule, step: int):
    last = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert last["global_step"] == step
    assert torch.equal(last["state_dict"]["layer.weight"], module.layer.weight.detach())


def test_max_tokens_stop_is_saved(tmp_path):
    trainer, module = fit(tmp_path, max_tokens=42)  # 11 steps of 4 samples (1 token each)
    assert trainer.global_step == 11
    assert_last_holds(tmp_path, module, 11)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["last.ckpt", "step4.ckpt", "step8.ckpt"]


def test_resuming_from_the_final_state_trains_no_further_step(tmp_path):
    _, module = fit(tmp_path, max_tokens=42)
    warmup = BatchWarmup(PiecewiseBatch([4], [0], unit="samples"), max_tokens=42, seq_len=1)
    trainer = pl.Trainer(**trainer_kwargs(max_epochs=2, callbacks=[warmup]))
    resumed = RegressionModule()
    trainer.fit(resumed, datamodule=RegressionData(n=96, batch_size=2), ckpt_path=tmp_path / "last.ckpt")
    assert trainer.global_step == 11 and not resumed.steps and warmup.accounting.tokens_seen == 44
    assert torch.equal(resumed.layer.weight, module.layer.weight)


def test_a_run_resumed_into_another_folder_says_so_in_one_line(tmp_path, caplog, recwarn):
    first, second = tmp_path / "first", tmp_path / "second"
    fit(first, max_steps=5)
    warmup = BatchWarmup(PiecewiseBatch([4], [0], unit="samples"), seq_len=1)
    checkpoint = FinalStateCheckpoint(
        dirpath=second, every_n_train_steps=4, save_last=True
    )  # the same state key: it loads
    trainer = pl.Trainer(
        **trainer_kwargs(enable_checkpointing=True, max_epochs=2, max_steps=9, callbacks=[warmup, checkpoint])
    )
    with caplog.at_level("INFO"):
        trainer.fit(RegressionModule(), datamodule=RegressionData(n=96, batch_size=2), ckpt_path=first / "last.ckpt")
    assert f"FinalStateCheckpoint: resumed from a run that saved to {first}; this run saves to {second}" in caplog.text
    assert not [w for w in recwarn if "dirpath has changed" in str(w.message)]  # Lightning's warning, said better above
    assert torch.load(second / "last.ckpt", weights_only=False)["global_step"] == 9


def test_max_steps_stop_is_saved(tmp_path):
    trainer, module = fit(tmp_path, max_steps=7)
    assert_last_holds(tmp_path, module, 7)


def test_stop_on_a_periodic_step_is_saved(tmp_path):
    trainer, module = fit(tmp_path, max_steps=8)
    assert_last_holds(tmp_path, module, 8)


def test_sigterm_after_an_optimizer_step_is_saved(tmp_path):
    with pytest.raises(
        SystemExit, match=r"^SIGTERM: training stopped after optimizer step 7; .*last\.ckpt holds it: resume with"
    ):
        fit(tmp_path, SigtermAt(micro_batch=14))  # the 7th step's second micro-batch
    last = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert last["global_step"] == 7
    resumed = RegressionModule()
    resumed.load_state_dict(last["state_dict"])
    uninterrupted_trainer, uninterrupted = fit(tmp_path / "again", max_steps=7)
    assert torch.equal(resumed.layer.weight, uninterrupted.layer.weight)


@pytest.mark.slow
def test_sigterm_ends_a_plain_lightning_script_with_one_line_that_says_how_to_resume(tmp_path):
    # A user's own script (no recipe, no try/except around trainer.fit): a real SIGTERM after step 3.
    stopped = subprocess.run(
        [sys.executable, str(USER_SIGTERM), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(),
    )
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert stopped.returncode == 1  # not 0, which a bare SystemExit gives and a scheduler reads as done
    assert stopped.stderr.strip().splitlines()[-1] == (
        f"SIGTERM: training stopped after optimizer step 3; {last} holds it: resume with "
        f"trainer.fit(model, datamodule, ckpt_path={str(last)!r})"
    )
    assert torch.load(last, weights_only=False)["global_step"] == 3  # what the line says


def test_sigterm_inside_an_accumulation_window_stops_after_that_step(tmp_path):
    # Micro-batch 13 is the first of step 7's two: the run finishes step 7, saves it, and stops.
    with pytest.raises(SystemExit):
        _, module = fit(tmp_path, SigtermAt(micro_batch=13))
    last = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert last["global_step"] == 7


def test_sigterm_on_an_epochs_last_micro_batch_resumes_in_the_next_epoch(tmp_path):
    # Epoch 0 (100 samples) grows the micro-batch 2 -> 4 and ends in a short step: its 30th and last
    # micro-batch is one of 4 where the step wants two. SIGTERM there: the resumed run, stopped by
    # max_steps, trains epoch 1 from its first sample with the LR its epoch-indexed scheduler gives it.
    def run(*callbacks, ckpt_path=None):
        pl.seed_everything(0, verbose=False)
        warmup = BatchWarmup(
            PiecewiseBatch([2, 4, 8], [0, 20, 50], unit="samples"), lr_rule="sqrt", max_micro_batch_size=4
        )
        trainer = pl.Trainer(
            **trainer_kwargs(
                enable_checkpointing=bool(callbacks), max_epochs=-1, max_steps=38, callbacks=[warmup, *callbacks]
            )
        )
        module = RegressionModule(
            scheduler_factory=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5),
            scheduler_interval="epoch",
        )
        trainer.fit(module, datamodule=GlobalOrderRegressionData(n=100, batch_size=2), ckpt_path=ckpt_path)
        return trainer, module

    _, full = run()
    assert [len(step["indices"]) for step in full.steps if step["epoch"] == 0][-2:] == [8, 4]
    with pytest.raises(SystemExit):
        run(FinalStateCheckpoint(dirpath=tmp_path, save_last=True), SigtermAt(micro_batch=30))
    trainer, resumed = run(ckpt_path=tmp_path / "last.ckpt")
    assert [step["epoch"] for step in resumed.steps] == [1] * 13 and trainer.global_step == len(full.steps) == 38
    assert [s["indices"] for s in resumed.steps] == [s["indices"] for s in full.steps if s["epoch"] == 1]
    assert [s["lr"] for s in resumed.steps] == [s["lr"] for s in full.steps if s["epoch"] == 1]
    assert torch.equal(resumed.layer.weight, full.layer.weight)


def test_keeps_the_most_recent_periodic_checkpoints(tmp_path):
    # The olmo recipes' setting: by step, the newest save_top_k periodic checkpoints, and last.
    checkpoint = FinalStateCheckpoint(
        dirpath=tmp_path,
        filename="step{step}",
        auto_insert_metric_name=False,
        every_n_train_steps=2,
        save_top_k=2,
        monitor="step",
        mode="max",
        save_last=True,
    )
    trainer = pl.Trainer(**trainer_kwargs(enable_checkpointing=True, max_steps=9, callbacks=[checkpoint]))
    trainer.fit(RegressionModule(), datamodule=RegressionData(n=96, batch_size=2))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["last.ckpt", "step6.ckpt", "step8.ckpt"]
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 9
