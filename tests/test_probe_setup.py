"""What the CBS probe reads as training starts: the held-out batches (lit_cbs.probe.heldout) and the token count
at which the run ends (lit_cbs.probe.limits), on real Trainers and DataLoaders."""

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
from lit_cbs.accounting import BatchAccounting
from lit_cbs.errors import LitCBSConfigError
from lit_cbs.probe.heldout import load_heldout_batches
from lit_cbs.probe.limits import run_end_tokens
from lit_cbs.schedules import PiecewiseBatch


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
        return fit_quietly(trainer, module, train_dataloaders=DataLoader(IndexedRegression(12), batch_size=2),
                           val_dataloaders=val_loader())
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
    fit_quietly(trainer, RegressionModule(), train_dataloaders=DataLoader(IndexedRegression(4), batch_size=2), val_dataloaders=loader)
    assert len(load.batches) == 1
    assert torch.equal(generator.get_state(), state)


def test_reading_does_not_change_the_training_shuffle():
    # The training loader shuffles from torch's global generator when each epoch's iterator starts;
    # reading the validation loader at train start used to draw from it first, changing the order.
    def micro_batches(callbacks):
        pl.seed_everything(0, verbose=False)
        module = ValidatedRegression()
        trainer = pl.Trainer(callbacks=callbacks, **trainer_kwargs(max_epochs=2, **VALIDATION_OFF))
        fit_quietly(trainer, module, train_dataloaders=DataLoader(IndexedRegression(8), batch_size=2, shuffle=True),
                    val_dataloaders=val_loader())
        return module.micro_batches

    load = LoadHeldout(count=2)
    assert micro_batches([load]) == micro_batches([])
    assert load.batches


@pytest.mark.parametrize("data", ["datamodule", "train_dataloaders"])
def test_no_validation_data_names_the_setting_and_the_fix(data):
    trainer = pl.Trainer(callbacks=[LoadHeldout(count=2)], **trainer_kwargs(max_steps=1))
    given = {"datamodule": RegressionData(n=8)} if data == "datamodule" else {"train_dataloaders": DataLoader(IndexedRegression(4))}
    with pytest.raises(LitCBSConfigError) as error:
        fit_quietly(trainer, RegressionModule(), **given)
    message = str(error.value)
    assert "\n" not in message
    assert "CBSProbeCallback(evaluate='heldout')" in message and "val_dataloader()" in message
    assert "val_dataloaders=" in message and "evaluate='train_ema'" in message


def test_an_empty_validation_loader_is_refused():
    load = LoadHeldout(count=2)
    trainer = pl.Trainer(callbacks=[load], **trainer_kwargs(max_steps=1, limit_val_batches=0))
    with pytest.raises(LitCBSConfigError, match=r"^CBSProbeCallback\(evaluate='heldout'\): the first validation dataloader yielded no batch"):
        fit_quietly(trainer, RegressionModule(), train_dataloaders=DataLoader(IndexedRegression(4), batch_size=2),
                    val_dataloaders=val_loader(n=0))


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
    fit_quietly(trainer, ValidatedRegression(), train_dataloaders=DataLoader(IndexedRegression(8), batch_size=2),
                val_dataloaders=val_loader(n=8, batch_size=2))
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


class PredictEnd(Callback):
    """Asks run_end_tokens before and after every micro-batch; keeps the tokens the run really ended at."""

    def __init__(self, warmup: BatchWarmup | None = None, stop_after_batches: int | None = None):
        self.warmup = warmup
        self.stop_after_batches = stop_after_batches
        self.predictions: list[tuple] = []
        self.end: int | None = None

    def setup(self, trainer, pl_module, stage):
        BatchAccounting.of(trainer)  # attached before training, as the probe's setup does

    def predict(self, trainer):
        self.predictions.append(run_end_tokens(trainer, BatchAccounting.of(trainer), self.warmup))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.predict(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.predict(trainer)
        if self.stop_after_batches is not None and len(self.predictions) == 2 * self.stop_after_batches:
            trainer.should_stop = True

    def on_train_end(self, trainer, pl_module):
        self.end = BatchAccounting.of(trainer).tokens_seen


def fit_tokens(predict: PredictEnd, callbacks=(), data=None, **overrides) -> PredictEnd:
    trainer = pl.Trainer(callbacks=[*callbacks, predict], **trainer_kwargs(**overrides))
    given = {"datamodule": data} if isinstance(data, pl.LightningDataModule) else {"train_dataloaders": data}
    fit_quietly(trainer, Bigram(), **given)
    return predict


# 22 samples in micro-batches of 4: an epoch is 6 micro-batches, the last of 2 samples; accumulate 4
# makes steps of 16 and 6 samples (64 and 24 tokens), 88 tokens an epoch.
@pytest.mark.parametrize(
    ("limits", "max_tokens", "end", "limit"),
    [
        ({"max_steps": 5, "max_epochs": -1}, None, 4 * (16 + 6 + 16 + 6 + 16), "max_steps"),
        ({"max_epochs": 2}, None, 2 * 88, "max_epochs"),
        ({"max_epochs": -1}, 100, 64 + 24 + 64, "max_tokens"),  # the end of the step that reaches the budget
        ({"max_steps": 5, "max_epochs": 2}, None, 2 * 88, "max_epochs"),
        ({"max_steps": 3, "max_epochs": 2}, 300, 64 + 24 + 64, "max_steps"),
        ({"max_steps": 3, "max_epochs": 2}, 100, 64 + 24 + 64, "max_tokens"),  # a tie goes to max_tokens
        ({"max_epochs": 3, "min_steps": 4}, 60, 64 + 24 + 64 + 24, "max_tokens"),  # min_steps holds the stop off
        ({"max_epochs": 2, "limit_train_batches": 3}, None, 2 * 48, "max_epochs"),  # 3 full micro-batches an epoch
    ],
)
def test_run_end_is_the_first_limit_reached(limits, max_tokens, end, limit):
    callbacks = [BatchAccounting(max_tokens=max_tokens)] if max_tokens else []
    predict = fit_tokens(PredictEnd(), callbacks, TokenIds(22, 4), accumulate_grad_batches=4, **limits)
    assert predict.end == end
    assert set(predict.predictions) == {(end, limit)}  # at every micro-batch, from the first on


@pytest.mark.parametrize(("max_steps", "samples"), [(5, 16 + 8), (10, 47 + 2 * 16)])
def test_run_end_under_a_batch_warmup_that_changes_the_batch(max_steps, samples):
    # 47 samples in micro-batches of 2 (the 24th holds 1). Global batch 4 -> 8 asked for at 12 samples and
    # applied at 16, after the first step whose micro-batches this epoch (8) divide by accumulate 4; 8 -> 16
    # asked for at 40 and applied at the epoch's end (20 micro-batches do not divide by 8). Epoch 0: 4
    # steps of 4 samples, then 4 of 8 (the last 7); epoch 1: steps of 16.
    warmup = BatchWarmup(PiecewiseBatch([4, 8, 16], thresholds=[0, 12, 40], unit="samples"), lr_rule="none")
    predict = fit_tokens(PredictEnd(warmup), [warmup], TokenIds(47, 2), max_steps=max_steps, max_epochs=-1)
    changes = [(16, 8), (47, 16)] if max_steps == 10 else [(16, 8)]
    assert [(change.samples_seen, change.new_global_batch) for change in warmup.history] == changes
    assert predict.end == samples * SEQ_LEN
    assert set(predict.predictions) == {(predict.end, "max_steps")}


def test_run_end_under_a_token_schedule_and_a_budget():
    warmup = BatchWarmup(PiecewiseBatch([4, 8], thresholds=[0, 64], unit="tokens"), lr_rule="none", max_tokens=400)
    predict = fit_tokens(PredictEnd(warmup), [warmup], TokenIds(47, 2), max_epochs=-1)
    assert len(warmup.history) == 1 and predict.end >= 400
    assert set(predict.predictions) == {(predict.end, "max_tokens")}


def test_run_end_of_a_run_resumed_mid_epoch(tmp_path):
    # 24 samples in micro-batches of 4, accumulate 2: 3 steps of 8 samples an epoch. The first fit stops
    # after step 4, inside an epoch; the resumed one must see the end where a run of max_steps=7 ends,
    # from its first micro-batch on.
    first = pl.Trainer(callbacks=[PredictEnd()], **trainer_kwargs(max_steps=4, max_epochs=-1, accumulate_grad_batches=2))
    fit_quietly(first, Bigram(), datamodule=TokenIds(24, 4))
    first.save_checkpoint(tmp_path / "step4.ckpt")
    predict = PredictEnd()
    trainer = pl.Trainer(callbacks=[predict], **trainer_kwargs(max_steps=7, max_epochs=-1, accumulate_grad_batches=2))
    fit_quietly(trainer, Bigram(), datamodule=TokenIds(24, 4), ckpt_path=tmp_path / "step4.ckpt")
    assert trainer.global_step == 7 and predict.end == 7 * 8 * SEQ_LEN
    assert set(predict.predictions) == {(predict.end, "max_steps")}


def test_run_end_is_unknown_without_a_limit_or_a_length():
    no_limit = fit_tokens(PredictEnd(stop_after_batches=3), data=TokenIds(22, 4), max_epochs=-1)
    assert set(no_limit.predictions) == {(None, None)}
    stream = fit_tokens(PredictEnd(), data=DataLoader(TokenStream(), batch_size=4), max_epochs=1)
    assert set(stream.predictions) == {(None, None)} and stream.end == 40 * SEQ_LEN
    # max_steps on a stream is counted as if the stream does not run out first (it does not here).
    steps = fit_tokens(PredictEnd(), data=DataLoader(TokenStream(), batch_size=4), max_steps=3, max_epochs=1)
    assert set(steps.predictions) == {(3 * 4 * SEQ_LEN, "max_steps")}


def test_run_end_without_tokens_is_unknown():
    predict = PredictEnd()
    trainer = pl.Trainer(callbacks=[predict], **trainer_kwargs(max_steps=2))
    fit_quietly(trainer, RegressionModule(), datamodule=RegressionData(n=8))
    assert set(predict.predictions) == {(None, None)}


def test_a_guarded_warmup_leaves_max_steps_unknown_and_max_epochs_exact():
    # The guard may hold back or revert an increase after the loss it sees, so the tokens of the steps to
    # come cannot be known; an epoch's tokens do not depend on the batch.
    def fit(**limits) -> PredictEnd:
        warmup = BatchWarmup(PiecewiseBatch([4, 8], thresholds=[0, 16], unit="samples"), lr_rule="none", guard=True)
        return fit_tokens(PredictEnd(warmup), [warmup], TokenIds(22, 4), **limits)

    assert set(fit(max_steps=3, max_epochs=-1).predictions) == {(None, None)}
    by_epochs = fit(max_epochs=2)
    assert by_epochs.end == 2 * 88 and set(by_epochs.predictions) == {(2 * 88, "max_epochs")}


class SavePredictions(PredictEnd):
    """ddp_spawn returns no callback state: each rank saves its predictions and the tokens at the end."""

    def __init__(self, outdir: Path):
        super().__init__()
        self.outdir = outdir

    def on_train_end(self, trainer, pl_module):
        super().on_train_end(trainer, pl_module)
        torch.save({"predictions": self.predictions, "end": self.end}, self.outdir / f"rank{trainer.global_rank}.pt")


@pytest.mark.slow
def test_run_end_under_ddp_counts_every_rank(tmp_path):
    # 23 samples dealt to 2 ranks (padded to 12 each) in micro-batches of 5: 3 an epoch, the last of 2.
    trainer = pl.Trainer(
        callbacks=[SavePredictions(tmp_path)],
        **trainer_kwargs(strategy="ddp_spawn", devices=2, max_epochs=2, accumulate_grad_batches=2, use_distributed_sampler=True),
    )
    fit_quietly(trainer, Bigram(), datamodule=TokenIds(23, 5))
    for rank in range(2):
        saved = torch.load(tmp_path / f"rank{rank}.pt")
        assert saved["end"] == 2 * 12 * 2 * SEQ_LEN
        assert set(saved["predictions"]) == {(saved["end"], "max_epochs")}
