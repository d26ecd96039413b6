"""Replicate data windows on a real Trainer: each k trains on the next windows of the run's data."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from toys import (
    SEQ,
    RegressionDataWithVal,
    RegressionModule,
    trainer_kwargs,
)

from lit_cbs import BatchWarmup, CBSProbeCallback, ConstantBatch
from lit_cbs.callbacks.accounting import BatchAccounting
from lit_cbs.probe.reading import BranchScore, difference


class RecordsBranchSamples(RegressionModule):
    """Records the samples of every branch step (training_step runs in branches too, and scores the
    held-out batches in eval mode)."""

    def __init__(self):
        super().__init__(lr=0.05, optimizer="adam")
        self.branch_samples: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        if BatchAccounting.attach(self.trainer).in_branch and self.training:
            self.branch_samples.append(batch["idx"].tolist())
        return super().training_step(batch, batch_idx)


def fit(probe=None, module=None):
    pl.seed_everything(0, verbose=False)
    module = module or RecordsBranchSamples()
    callbacks = [BatchWarmup(ConstantBatch(4), seq_len=SEQ)] + ([probe] if probe is not None else [])
    trainer = pl.Trainer(callbacks=callbacks, **trainer_kwargs(max_epochs=2, limit_val_batches=0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, RegressionDataWithVal(n=96, batch_size=2))
    return trainer, module


def replicated_probe(**kwargs):
    settings = dict(
        every_tokens=160,
        multipliers=(1, 2),
        window_tokens=64,
        epsilon=0.01,
        evaluate="heldout",
        heldout_batches=3,
        replicates=2,
    )
    settings.update(kwargs)
    return CBSProbeCallback(**settings)


def test_replicate_windows_train_on_the_next_data_and_leave_the_main_run_alone():
    _, plain = fit()
    probe = replicated_probe(search="grid")
    trainer, probed = fit(probe)
    assert len(probed.steps) == len(plain.steps)
    assert all(torch.equal(a["weight"], b["weight"]) for a, b in zip(probed.steps, plain.steps))
    assert torch.equal(probed.layer.weight, plain.layer.weight)
    assert probed.micro_batches == plain.micro_batches
    assert len(probe.history) >= 2
    window_samples = 64 // SEQ
    main_order = [i for batch in probed.micro_batches for i in batch]
    branch_steps = iter(probed.branch_samples)
    for reading in probe.history:
        assert reading.replicates == 2 and reading.window_tokens == 64
        assert reading.branches_trained == [1.0, 1.0, 2.0, 2.0]  # k by k, each on both windows
        assert reading.tokens_spent == 4 * 64
        start = reading.tokens // SEQ  # samples the main run had trained on when the window began
        windows = [
            main_order[start : start + window_samples],
            main_order[start + window_samples : start + 2 * window_samples],
        ]
        for _k in (1, 2):
            for window in windows:  # each branch trains on its window's samples, in the main run's order
                trained = []
                while len(trained) < window_samples:
                    trained += next(branch_steps)
                assert trained == window
        assert set(reading.replicate_batch_losses) == {"1", "2"}
        assert all(len(w) == 2 and all(len(b) == 3 for b in w) for w in reading.replicate_batch_losses.values())
        held_out_only = difference(
            BranchScore.heldout(reading.batch_losses["2"]), BranchScore.heldout(reading.batch_losses["1"])
        )
        assert reading.loss_se["2"] ** 2 == pytest.approx(held_out_only.se**2 + reading.replicate_se["2"] ** 2)


def test_bisect_uses_the_main_run_for_the_first_window_only():
    grid = replicated_probe(search="grid")
    fit(grid)
    bisect = replicated_probe(search="bisect")
    fit(bisect)
    for g, b in zip(grid.history, bisect.history):
        # The main run over the first window is the k = 1 branch there: the same held-out losses.
        assert b.replicate_batch_losses["1"][0] == pytest.approx(g.replicate_batch_losses["1"][0], rel=1e-12)
        # Per k, per window, per held-out batch (pytest.approx compares flat sequences, not nested ones).
        assert b.replicate_batch_losses.keys() == g.replicate_batch_losses.keys()
        for k, windows in g.replicate_batch_losses.items():
            assert len(b.replicate_batch_losses[k]) == len(windows)
            for bisected, gridded in zip(b.replicate_batch_losses[k], windows):
                assert bisected == pytest.approx(gridded, rel=1e-12)
        assert b.branches_trained == [1.0, 2.0, 2.0] and b.tokens_spent == 3 * 64
    assert bisect.tokens_spent < grid.tokens_spent
