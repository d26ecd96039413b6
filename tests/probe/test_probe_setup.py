"""What the CBS probe reads as training starts: the held-out batches (lit_cbs.probe.heldout) and the token count
at which the run ends (lit_cbs.probe.limits) and what the probe makes of it, on real Trainers and DataLoaders."""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, IterableDataset
from toys import IndexedRegression, RegressionData, RegressionModule, trainer_kwargs

from lit_cbs import BatchWarmup
from lit_cbs.callbacks.accounting import BatchAccounting
from lit_cbs.errors import LitCBSConfigError
from lit_cbs.probe import CBSProbeCallback
from lit_cbs.probe.heldout import load_heldout_batches
from lit_cbs.probe.limits import run_end
from lit_cbs.rules.batch_schedules import PiecewiseBatch


def fit_quietly(trainer: pl.Trainer, module: pl.LightningModule, **data) -> pl.Trainer:
    """``trainer.fit`` without the toys' warnings (few workers, small epochs)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, **data)
    return trainer


# ---------------------------------------------------------------------- held-out batches
VALIDATION_OFF = {"limit_val_batches": 0, "num_sanity_val_steps": 0}  # nothing prepares the val loader


def val_loader(n: int = 10, batch_size: int = 3, **kwargs) -> DataLoader:
    return DataLoader(IndexedRegression(n, seed=1), batch_size=batch_size, **kwargs)


def rng_states() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "random": random.getstate()}


def assert_same_rng(before: dict, after: dict) -> None:
    assert torch.equal(before["torch"], after["torch"])
    assert before["numpy"][0] == after["numpy"][0] and np.array_equal(before["numpy"][1], after["numpy"][1])
    assert before["numpy"][2:] == after["numpy"][2:]
    assert before["random"] == after["random"]


class LoadHeldout(Callback):
    """Calls load_heldout_batches where the probe does (on_train_start) and keeps what it saw."""

    def __init__(self, count: int):
        self.count = count
        self.batches: list | None = None
        self.prepared_by_lightning: bool | None = None
        self.rng_before: dict | None = None
        self.rng_after: dict | None = None

    def on_train_start(self, trainer, pl_module):
        self.prepared_by_lightning = trainer.val_dataloaders is not None
        self.rng_before = rng_states()
        self.batches = load_heldout_batches(trainer, self.count, "cpu")
        self.rng_after = rng_states()


class ValidatedRegression(RegressionModule):
    """The toy with a validation_step, so that Lightning's validation loop runs (and prepares its loader)."""

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        return self.training_step(batch, batch_idx)


class ModuleWithValLoader(ValidatedRegression):
    def train_dataloader(self):
        return DataLoader(IndexedRegression(12), batch_size=2)

    def val_dataloader(self):
        return val_loader()


class DataWithVal(RegressionData):
    """The toy data with a validation loader whose creation, as a user's might, draws from numpy and
    random, and whose iterator draws its base seed from torch's global generator."""

    def val_dataloader(self):
        np.random.rand()
        random.random()
        return [val_loader(), val_loader(batch_size=5)]  # two loaders: the first is the held-out one


def fit_with(callbacks, source: str, module=None, **overrides):
    module = module or (ModuleWithValLoader() if source == "module" else ValidatedRegression())
    trainer = pl.Trainer(callbacks=callbacks, **trainer_kwargs(max_steps=2, **overrides))
    if source == "datamodule":
        return fit_quietly(trainer, module, datamodule=DataWithVal(n=12))
    if source == "fit":
        return fit_quietly(
            trainer, module, train_dataloaders=DataLoader(IndexedRegression(12), batch_size=2), val_dataloaders=val_loader()
        )
    return fit_quietly(trainer, module)


@pytest.mark.parametrize("source", ["datamodule", "fit", "module"])
@pytest.mark.parametrize("validation", ["on", "off"])
def test_heldout_batches_come_from_each_source_of_validation_data(source, validation):
    # "on": Lightning's validation loop has prepared the loader; "off" (limit_val_batches=0 and no sanity
    # check): nothing has, so the loader is requested from the source as Lightning would.
    load = LoadHeldout(count=2)
    off = VALIDATION_OFF if validation == "off" else {}
    fit_with([load], source, **off)
    assert load.prepared_by_lightning == (validation == "on")
    assert [batch["idx"].tolist() for batch in load.batches] == [[0, 1, 2], [3, 4, 5]]
    expected = IndexedRegression(10, seed=1)
    assert torch.equal(load.batches[1]["x"], expected.x[3:6]) and not load.batches[1]["x"].requires_grad


def test_count_larger_than_the_loader_gives_all_of_it():
    load = LoadHeldout(count=50)
    fit_with([load], "fit")
    assert [batch["idx"].tolist() for batch in load.batches] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]


@pytest.mark.parametrize("validation", ["on", "off"])
def test_reading_leaves_every_random_state_as_it_was(validation):
    # DataWithVal's hook draws from numpy and random; iterating its loader draws from torch.
    load = LoadHeldout(count=2)
    off = VALIDATION_OFF if validation == "off" else {}
    fit_with([load], "datamodule", **off)
    assert load.batches and load.rng_before is not None
    assert_same_rng(load.rng_before, load.rng_after)


def test_a_seeded_validation_loader_keeps_its_generator_state():
    generator = torch.Generator().manual_seed(7)
    state = generator.get_state()
    load = LoadHeldout(count=1)
    loader = val_loader(shuffle=True, generator=generator)
    trainer = pl.Trainer(callbacks=[load], **trainer_kwargs(max_steps=1, limit_val_batches=0))
    fit_quietly(
        trainer, RegressionModule(), train_dataloaders=DataLoader(IndexedRegression(4), batch_size=2), val_dataloaders=loader
    )
    assert len(load.batches) == 1
    assert torch.equal(generator.get_state(), state)


def test_reading_does_not_change_the_training_shuffle():
    # The training loader shuffles from torch's global generator when each epoch's iterator starts;
    # reading the validation loader at train start used to draw from it first, changing the order.
    def micro_batches(callbacks):
        pl.seed_everything(0, verbose=False)
        module = ValidatedRegression()
        trainer = pl.Trainer(callbacks=callbacks, **trainer_kwargs(max_epochs=2, **VALIDATION_OFF))
        fit_quietly(
            trainer,
            module,
            train_dataloaders=DataLoader(IndexedRegression(8), batch_size=2, shuffle=True),
            val_dataloaders=val_loader(),
        )
        return module.micro_batches

    load = LoadHeldout(count=2)
    assert micro_batches([load]) == micro_batches([])
    assert load.batches


@pytest.mark.parametrize("data", ["datamodule", "train_dataloaders"])
def test_no_validation_data_names_the_setting_and_the_fix(data):
    trainer = pl.Trainer(callbacks=[LoadHeldout(count=2)], **trainer_kwargs(max_steps=1))
    given = (
        {"datamodule": RegressionData(n=8)} if data == "datamodule" else {"train_dataloaders": DataLoader(IndexedRegression(4))}
    )
    with pytest.raises(LitCBSConfigError) as error:
        fit_quietly(trainer, RegressionModule(), **given)
    message = str(error.value)
    assert "\n" not in message
    assert "CBSProbeCallback(evaluate='heldout')" in message and "val_dataloader()" in message
    assert "val_dataloaders=" in message and "evaluate='train_ema'" in message


def test_an_empty_validation_loader_is_refused():
    load = LoadHeldout(count=2)
    trainer = pl.Trainer(callbacks=[load], **trainer_kwargs(max_steps=1, limit_val_batches=0))
    with pytest.raises(
        LitCBSConfigError, match=r"^CBSProbeCallback\(evaluate='heldout'\): the first validation dataloader yielded no batch"
    ):
        fit_quietly(
            trainer,
            RegressionModule(),
            train_dataloaders=DataLoader(IndexedRegression(4), batch_size=2),
            val_dataloaders=val_loader(n=0),
        )


class SaveHeldout(Callback):
    """ddp_spawn returns no callback state: each rank saves the indices of its held-out batches."""

    def __init__(self, outdir: Path):
        self.outdir = outdir

    def on_train_start(self, trainer, pl_module):
        batches = load_heldout_batches(trainer, 2, "cpu")
        torch.save([batch["idx"].tolist() for batch in batches], self.outdir / f"rank{trainer.global_rank}.pt")


@pytest.mark.slow
def test_under_ddp_each_rank_reads_its_own_shard(tmp_path):
    # With validation off nothing has prepared the loader: the sampler is injected as Lightning's validation would.
    trainer = pl.Trainer(
        callbacks=[SaveHeldout(tmp_path)],
        **trainer_kwargs(strategy="ddp_spawn", devices=2, max_steps=1, use_distributed_sampler=True, **VALIDATION_OFF),
    )
    fit_quietly(
        trainer,
        ValidatedRegression(),
        train_dataloaders=DataLoader(IndexedRegression(8), batch_size=2),
        val_dataloaders=val_loader(n=8, batch_size=2),
    )
    # Lightning's DistributedSampler (shuffle off for validation) deals sample i to rank i % 2.
    assert torch.load(tmp_path / "rank0.pt") == [[0, 2], [4, 6]]
    assert torch.load(tmp_path / "rank1.pt") == [[1, 3], [5, 7]]


# ---------------------------------------------------------------------- where the run ends
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
            self.ends.append(run_end(trainer, BatchAccounting.attach(trainer), batch_idx + 1, into_step, self.largest_batch))

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


def test_a_window_the_run_would_cut_short_is_not_started(caplog):
    probe = CBSProbeCallback(every_tokens=64, multipliers=(1, 2), window_tokens=64)
    with caplog.at_level("INFO"):
        fit_tokens([probe], TokenIds(24, 4), accumulate_grad_batches=2, max_epochs=2)
    assert probe.history and all(r.tokens + r.window_tokens <= 192 for r in probe.history)
    assert "would end past the run's end (max_epochs=2, at 192 tokens)" in caplog.text
    assert probe.tokens_spent == sum(r.tokens_spent for r in probe.history)  # no branch of a dropped window


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
