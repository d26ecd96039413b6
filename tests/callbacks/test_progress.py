"""RunProgressBar on a real Trainer: the bar counts the run's tokens or optimizer steps and ends full."""

from __future__ import annotations

import re

import lightning.pytorch as pl
import pytest
from toys import RegressionData, RegressionModule, trainer_kwargs

from lit_cbs import BatchWarmup, PiecewiseBatch
from lit_cbs.callbacks.checkpoint import FinalStateCheckpoint
from lit_cbs.callbacks.progress import RunProgressBar


def fit(bar: RunProgressBar, *callbacks, ckpt_path=None, **trainer_args) -> pl.Trainer:
    args = trainer_kwargs(enable_progress_bar=True, max_epochs=5, callbacks=[bar, *callbacks])
    args.update(trainer_args)
    trainer = pl.Trainer(**args)
    trainer.fit(RegressionModule(), datamodule=RegressionData(n=96, batch_size=2), ckpt_path=ckpt_path)
    return trainer


def test_bar_counts_tokens_to_max_tokens_across_epochs():
    # 4 then 8 samples of 3 "tokens" per step; 96 samples per epoch, so the run spans 2 epochs.
    warmup = BatchWarmup(PiecewiseBatch([4, 8], [0, 120]), max_tokens=400, seq_len=3)
    bar = RunProgressBar(refresh_rate=5)
    trainer = fit(bar, warmup)
    assert trainer.current_epoch >= 1 and warmup.accounting.tokens_seen >= 400
    progress = bar.train_progress_bar
    assert (progress.n, progress.total, progress.unit) == (
        warmup.accounting.tokens_seen,
        warmup.accounting.tokens_seen,
        "tokens",
    )


def test_bar_counts_optimizer_steps_to_max_steps():
    bar = RunProgressBar(refresh_rate=3)
    trainer = fit(bar, BatchWarmup(PiecewiseBatch([4], [0], unit="samples")), max_steps=30)
    progress = bar.train_progress_bar
    assert (progress.n, progress.total, progress.unit) == (30, 30, "steps") and trainer.global_step == 30


def test_a_resumed_runs_bar_starts_where_it_stopped_and_rates_only_what_this_fit_trains(tmp_path):
    def warmup():
        return BatchWarmup(PiecewiseBatch([4], [0], unit="samples"), max_tokens=400, seq_len=3)

    first = fit(
        RunProgressBar(),
        warmup(),
        FinalStateCheckpoint(dirpath=tmp_path, save_last=True),
        enable_checkpointing=True,
        max_steps=20,
    )
    assert first.global_step == 20  # 240 of the 400 tokens
    bar = RunProgressBar()
    fit(bar, warmup(), ckpt_path=tmp_path / "last.ckpt")
    progress = bar.train_progress_bar
    assert (progress.initial, progress.n, progress.total) == (240, 408, 408) and progress.desc.startswith("Epoch 1")
    # The rate shown is this fit's 168 tokens over its time (from all 408 it would be 2.4x that).
    shown = re.search(r"([\d.]+)(k?)tokens/s", str(progress))
    rate = float(shown[1]) * (1000 if shown[2] else 1)
    assert rate == pytest.approx((408 - 240) / progress.format_dict["elapsed"], rel=0.2)


def test_bar_without_a_run_wide_count_is_lightnings():
    bar = RunProgressBar()
    fit(bar, max_epochs=1)
    assert (bar.train_progress_bar.n, bar.train_progress_bar.total) == (48, 48)  # micro-batches of the epoch
