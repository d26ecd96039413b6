"""load_heldout_batches (lit_cbs.probe.in_process): the held-out batches come from each source of
validation data and reading them changes no random state; too few are said."""

from __future__ import annotations

import random
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from launch import in_process_ddp
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader
from toys import SEQ, IndexedRegression, RegressionData, RegressionModule, fit_quietly, toy_probe, trainer_kwargs

from lit_cbs import BatchWarmup, ConstantBatch
from lit_cbs.errors import LitCBSConfigError
from lit_cbs.probe.in_process import load_heldout_batches

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
            trainer,
            module,
            train_dataloaders=DataLoader(IndexedRegression(12), batch_size=2),
            val_dataloaders=val_loader(),
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
        trainer,
        RegressionModule(),
        train_dataloaders=DataLoader(IndexedRegression(4), batch_size=2),
        val_dataloaders=loader,
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
        {"datamodule": RegressionData(n=8)}
        if data == "datamodule"
        else {"train_dataloaders": DataLoader(IndexedRegression(4))}
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
        LitCBSConfigError,
        match=r"^CBSProbeCallback\(evaluate='heldout'\): the first validation dataloader yielded no batch",
    ):
        fit_quietly(
            trainer,
            RegressionModule(),
            train_dataloaders=DataLoader(IndexedRegression(4), batch_size=2),
            val_dataloaders=val_loader(n=0),
        )


class SaveHeldout(Callback):
    """The ranks run in child processes, which return no callback state: each saves the indices of its held-out
    batches."""

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
        **trainer_kwargs(
            strategy=in_process_ddp(),
            devices=2,
            max_steps=1,
            use_distributed_sampler=True,
            **VALIDATION_OFF,
        ),
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


def test_fewer_held_out_batches_than_asked_are_said():
    class ThreeValBatches(RegressionData):
        def val_dataloader(self):
            return torch.utils.data.DataLoader(self.dataset, batch_size=32)

    callback = toy_probe(evaluate="heldout", heldout_batches=16)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        callbacks=[BatchWarmup(ConstantBatch(4), seq_len=SEQ), callback],
        **trainer_kwargs(max_epochs=2, limit_val_batches=0),
    )
    with pytest.warns(UserWarning, match="heldout_batches=16 but the validation data has 3 batches"):
        trainer.fit(RegressionModule(lr=0.05, optimizer="adam"), ThreeValBatches(n=96, batch_size=2))
    assert callback.history and all(len(v) == 3 for v in callback.history[0].batch_losses.values())
