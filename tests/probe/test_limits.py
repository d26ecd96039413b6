"""run_end and the probe's points against the run's end (lit_cbs.probe.plan, ProbeConfig.check_inside_run)."""

from __future__ import annotations

import dataclasses
import logging
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, IterableDataset
from toys import (
    SEQ,
    RegressionData,
    RegressionModule,
    fit_quietly,
    fit_regression,
    toy_probe,
    trainer_kwargs,
)

from lit_cbs import BatchWarmup, CBSProbeCallback, ConstantBatch, PiecewiseBatch
from lit_cbs.callbacks.accounting import BatchAccounting
from lit_cbs.errors import LitCBSConfigError
from lit_cbs.probe.engine import ProbeConfig
from lit_cbs.probe.plan import run_end

SEQ_LEN = 4  # tokens per sample of TokenIds


class TokenIds(pl.LightningDataModule):
    """``n`` random sequences of SEQ_LEN token ids (2-D int64), in order; the last micro-batch is partial
    unless ``batch_size`` divides ``n``."""

    def __init__(self, n: int, batch_size: int):
        super().__init__()
        self.ids = torch.randint(0, 8, (n, SEQ_LEN), generator=torch.Generator().manual_seed(0))
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(self.ids, batch_size=self.batch_size)


class TokenStream(IterableDataset):
    """Token sequences from a stream that has no length."""

    def __iter__(self):
        return iter(TokenIds(40, 1).ids)


class Bigram(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.logits = torch.nn.Embedding(8, 8)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self.logits(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class RecordEnds(Callback):
    """Asks run_end where the probe does (the first micro-batch, then every step boundary); keeps the
    tokens the run really ended at."""

    def __init__(self, largest_batch: int):
        self.largest_batch = largest_batch
        self.ends = []
        self.end = None

    def setup(self, trainer, pl_module, stage):
        BatchAccounting.attach(trainer)  # attached before training, as the probe's setup does

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if not self.ends:
            into_step = batch_idx % trainer.accumulate_grad_batches + 1
            self.ends.append(
                run_end(trainer, BatchAccounting.attach(trainer), batch_idx + 1, into_step, self.largest_batch)
            )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.ends.append(run_end(trainer, BatchAccounting.attach(trainer), batch_idx + 1, 0, self.largest_batch))

    def on_train_end(self, trainer, pl_module):
        self.end = BatchAccounting.attach(trainer).tokens_seen


def fit_tokens(callbacks, data=None, **overrides):
    trainer = pl.Trainer(callbacks=list(callbacks), **trainer_kwargs(**overrides))
    given = {"datamodule": data} if isinstance(data, pl.LightningDataModule) else {"train_dataloaders": data}
    fit_quietly(trainer, Bigram(), **given)
    return trainer


# 24 samples of 4 tokens in micro-batches of 4, accumulate 2: steps of 8 samples (32 tokens), 96 tokens an epoch.
@pytest.mark.parametrize(
    ("limits", "max_tokens", "expected", "end"),
    [
        ({"max_steps": 5, "max_epochs": -1}, None, (160, 160, "max_steps=5"), 160),
        ({"max_epochs": 2}, None, (192, 192, "max_epochs=2"), 192),
        ({"max_steps": 4, "max_epochs": 2}, None, (128, 128, "max_steps=4"), 128),
        ({"max_epochs": 2}, 100, (100, 100, "max_tokens=100"), 128),  # the step that reaches the budget ends it
    ],
)
@pytest.mark.parametrize("accumulate", [1, 2])
def test_run_end_names_the_first_limit_at_every_step(limits, max_tokens, expected, end, accumulate):
    # The same 8-sample steps from 2 micro-batches of 4, or from 1 of 8.
    record = RecordEnds(largest_batch=8)
    data = TokenIds(24, 4 * (3 - accumulate))
    fit_tokens([BatchAccounting(max_tokens=max_tokens), record], data, accumulate_grad_batches=accumulate, **limits)
    assert record.end == end
    assert {(e.earliest, e.latest, e.limit) for e in record.ends} == {expected}


def test_run_end_brackets_a_growing_batch():
    record = RecordEnds(largest_batch=16)
    warmup = BatchWarmup(PiecewiseBatch([8, 16], [0, 16], unit="samples"))
    fit_tokens([warmup, record], TokenIds(96, 4), max_steps=6, max_epochs=-1)
    assert record.end == 4 * (2 * 8 + 4 * 16)  # 2 steps of 8 samples, then 4 of 16
    assert all(e.earliest <= record.end <= e.latest and e.limit == "max_steps=6" for e in record.ends)
    assert record.ends[0].earliest == 6 * 8 * 4 and record.ends[0].latest == 6 * 16 * 4


def test_run_end_is_unknown_without_a_limit_or_a_length():
    record = RecordEnds(largest_batch=4)
    fit_tokens([record], DataLoader(TokenStream(), batch_size=4), max_epochs=1)
    assert {(e.earliest, e.latest, e.limit) for e in record.ends} == {(None, None, None)}


@pytest.mark.parametrize(
    ("limits", "name"), [({"max_steps": 5, "max_epochs": -1}, "max_steps=5"), ({"max_epochs": 1}, "max_epochs=1")]
)
def test_a_probe_point_past_the_end_is_refused_naming_the_limit(limits, name):
    probe = CBSProbeCallback(at_tokens=[200], multipliers=(1, 2), window_tokens=64)
    with pytest.raises(LitCBSConfigError, match=f"the first is at 200 tokens but the run ends by {name}"):
        fit_tokens([probe], TokenIds(24, 4), accumulate_grad_batches=2, **limits)


def test_the_window_is_checked_at_the_batch_of_each_point_the_run_reaches():
    # Steps of 8 samples (32 tokens), of 16 from 64 tokens on: k = 2 at the probe at 128 tokens takes 128 tokens a step.
    warmup = BatchWarmup(PiecewiseBatch([8, 16], [0, 64]))
    probe = CBSProbeCallback(at_tokens=[32, 128], multipliers=(1, 2), window_tokens=64)
    record = RecordEnds(largest_batch=16)
    with pytest.raises(
        LitCBSConfigError,
        match=r"^window_tokens=64 is smaller than one step of the largest branch \(k=2 x batch 16 x 4 tokens = 128\) "
        r"at the probe at 128 tokens",
    ):
        fit_tokens([warmup, probe, record], TokenIds(96, 4), max_steps=6, max_epochs=-1)
    assert record.end is None or record.end <= 16  # stopped at the first micro-batch, before any step


def test_a_first_window_past_the_run_end_is_refused_at_the_start_unless_a_growing_batch_decides():
    # Steps of 8 samples (32 tokens): the probe at 64 tokens (after step 2) records 128 tokens, to 192 > 160 at
    # max_steps=5.
    probe = CBSProbeCallback(at_tokens=[64], multipliers=(1, 2), window_tokens=128)
    record = RecordEnds(largest_batch=8)
    with pytest.raises(
        LitCBSConfigError,
        match=r"^the first probe \(64 tokens \+ window_tokens=128\) ends past max_steps=5, so it never runs",
    ):
        fit_tokens([probe, record], TokenIds(96, 4), accumulate_grad_batches=2, max_steps=5, max_epochs=-1)
    assert record.end is None or record.end <= 16  # stopped at the first micro-batch, before any step
    # Grown to 16 samples after step 2, the run ends at 288 tokens and takes the probe; at 8 it would not: decided
    # there.
    warmup = BatchWarmup(PiecewiseBatch([8, 16], [0, 64]))
    probe = CBSProbeCallback(at_tokens=[64], multipliers=(1, 2), window_tokens=128)
    fit_tokens([warmup, probe], TokenIds(96, 4), max_steps=5, max_epochs=-1)
    assert [(r.tokens, r.batch_size) for r in probe.history] == [(64, 16)]


def test_a_window_the_run_would_cut_short_is_not_started(caplog):
    probe = CBSProbeCallback(every_tokens=64, multipliers=(1, 2), window_tokens=64)
    with caplog.at_level("INFO"):
        fit_tokens([probe], TokenIds(24, 4), accumulate_grad_batches=2, max_epochs=2)
    assert probe.history and all(r.tokens + r.window_tokens <= 192 for r in probe.history)
    assert "would end past the run's end (max_epochs=2, at 192 tokens)" in caplog.text
    assert probe.tokens_spent == sum(r.tokens_spent for r in probe.history)  # no branch of a dropped window


def test_probe_schedule_outside_the_run_is_refused():
    with pytest.raises(LitCBSConfigError, match="no probe point lies inside the run.*max_tokens=200"):
        fit_regression(probe=toy_probe(at_tokens=[10_000], every_tokens=None), max_tokens=200)


def test_no_window_starts_that_max_tokens_would_cut_short(caplog):
    # 96 samples of SEQ tokens per epoch; points every 160 tokens with 128-token windows: the window
    # from 640 tokens ends at 768 <= max_tokens and runs; the one from 800 would pass 832 and never starts.
    probe = toy_probe()
    pl.seed_everything(0, verbose=False)
    warmup = BatchWarmup(ConstantBatch(4), lr_rule="sqrt", seq_len=SEQ, max_tokens=832)
    trainer = pl.Trainer(callbacks=[warmup, probe], **trainer_kwargs(max_epochs=10))
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        trainer.fit(RegressionModule(lr=0.05, optimizer="adam"), RegressionData(n=96, batch_size=2))
    assert warmup.accounting.tokens_seen == 832
    assert [r.tokens for r in probe.history] == [160, 320, 480, 640]
    assert not [w for w in caught if "dropped" in str(w.message)]
    assert (
        "CBS probe at 800 tokens not started: its window of 128 tokens would end past the run's end "
        "(max_tokens=832, at 832 tokens)" in caplog.text
    )


def test_a_grid_of_which_one_batch_fits_is_refused_at_the_first_batch():
    # Micro-batches of 4, accumulate 2 (batch 8): k = 0.25 gives 2 samples, no whole micro-batch, so only k = 1 fits.
    probe = CBSProbeCallback(every_tokens=64, multipliers=(0.25, 1), window_tokens=64)
    record = RecordEnds(largest_batch=8)
    with pytest.raises(
        LitCBSConfigError,
        match=r"multipliers=\['0.25', '1'\]: at most one of them gives a batch .* at the run's "
        r"global batches \[8\], and one batch brackets no CBS",
    ):
        fit_tokens([probe, record], TokenIds(24, 4), accumulate_grad_batches=2, max_epochs=2)
    assert record.end is None or record.end <= 16  # stopped at the first micro-batch, before any step


def test_the_first_probe_is_checked_against_the_run_end_in_one_place():
    """ProbeConfig.check_inside_run: whether the first point lies inside the run, and whether the whole first
    probe (its replicate windows too) fits: a recipe, whose max_tokens is final, and the callback at a fresh
    run's first batch."""
    at_100 = ProbeConfig(at_tokens=[100], multipliers=(1, 2), window_tokens=50)
    at_100.check_inside_run(101, "max_tokens=101")
    with pytest.raises(
        LitCBSConfigError, match=r"no probe point lies inside the run: the first is at 100 tokens .*max_tokens=100"
    ):
        at_100.check_inside_run(100, "max_tokens=100")
    at_100.check_inside_run(150, "max_tokens=150", whole_span=True)
    with pytest.raises(
        LitCBSConfigError, match=r"^the first probe \(100 tokens \+ window_tokens=50\) ends past max_tokens=149"
    ):
        at_100.check_inside_run(149, "max_tokens=149", whole_span=True)
    # The callback knows the window its probe records: the setting in whole steps of the largest branch.
    at_100.check_inside_run(148, "max_steps=5", whole_span=True, window_tokens=48)
    with pytest.raises(
        LitCBSConfigError, match=r"\(100 tokens \+ window_tokens=50, 48 in whole steps of its largest branch\)"
    ):
        at_100.check_inside_run(147, "max_steps=5", whole_span=True, window_tokens=48)
    replicated = dataclasses.replace(at_100, evaluate="heldout", replicates=2)
    with pytest.raises(LitCBSConfigError, match=r"\(100 tokens \+ 2 x window_tokens=50\)"):
        replicated.check_inside_run(150, "max_tokens=150", whole_span=True)
    with pytest.raises(LitCBSConfigError, match="the first is at inf tokens"):
        at_100.check_inside_run(10_000, "max_steps=5", next_probe=1)  # past the last point
