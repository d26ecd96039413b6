"""FinalStateCheckpoint: last.ckpt holds the step a run ends with, however it stops."""

from __future__ import annotations

import os
import signal

import lightning.pytorch as pl
import pytest
import torch
from toys import RegressionData, RegressionModule, trainer_kwargs

from lit_cbs import BatchWarmup, PiecewiseBatch
from lit_cbs.checkpoint import FinalStateCheckpoint


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
    checkpoint = FinalStateCheckpoint(dirpath=tmp_path, filename="step{step}", auto_insert_metric_name=False, every_n_train_steps=every_n_train_steps,
                                      save_top_k=-1, save_last=True)
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
    assert trainer.global_step == 11 and not resumed.steps and warmup.tokens_seen == 44
    assert torch.equal(resumed.layer.weight, module.layer.weight)


def test_max_steps_stop_is_saved(tmp_path):
    trainer, module = fit(tmp_path, max_steps=7)
    assert_last_holds(tmp_path, module, 7)


def test_stop_on_a_periodic_step_is_saved(tmp_path):
    trainer, module = fit(tmp_path, max_steps=8)
    assert_last_holds(tmp_path, module, 8)


def test_sigterm_after_an_optimizer_step_is_saved(tmp_path):
    with pytest.raises(SystemExit):
        fit(tmp_path, SigtermAt(micro_batch=14))  # the 7th step's second micro-batch
    last = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert last["global_step"] == 7
    resumed = RegressionModule()
    resumed.load_state_dict(last["state_dict"])
    uninterrupted_trainer, uninterrupted = fit(tmp_path / "again", max_steps=7)
    assert torch.equal(resumed.layer.weight, uninterrupted.layer.weight)


def test_sigterm_inside_an_accumulation_window_stops_after_that_step(tmp_path):
    # Micro-batch 13 is the first of step 7's two: the run finishes step 7, saves it, and stops.
    with pytest.raises(SystemExit):
        _, module = fit(tmp_path, SigtermAt(micro_batch=13))
    last = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert last["global_step"] == 7


def test_keeps_the_most_recent_periodic_checkpoints(tmp_path):
    # The olmo recipes' setting: by step, the newest save_top_k periodic checkpoints, and last.
    checkpoint = FinalStateCheckpoint(dirpath=tmp_path, filename="step{step}", auto_insert_metric_name=False, every_n_train_steps=2, save_top_k=2,
                                      monitor="step", mode="max", save_last=True)
    trainer = pl.Trainer(**trainer_kwargs(enable_checkpointing=True, max_steps=9, callbacks=[checkpoint]))
    trainer.fit(RegressionModule(), datamodule=RegressionData(n=96, batch_size=2))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["last.ckpt", "step6.ckpt", "step8.ckpt"]
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 9
