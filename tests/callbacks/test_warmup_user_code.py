"""BatchWarmup in hand-written Lightning code: what it refuses, warns about and logs (invariant 8)."""

from __future__ import annotations

import csv
import dataclasses
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader
from toys import RegressionData, RegressionModule, TwoOptimizers, mean_gradient, trainer_kwargs

from lit_cbs import BatchWarmup, CBSProbeCallback, ConstantBatch, GradientNoiseScale, PiecewiseBatch
from lit_cbs.errors import LitCBSConfigError
from lit_cbs.rules import OneCycle


def fit(warmup, *, module=None, data=None, **trainer_args):
    pl.seed_everything(0, verbose=False)
    module = module or RegressionModule()
    data = data or RegressionData(n=48, batch_size=2)
    trainer = pl.Trainer(callbacks=[warmup, *trainer_args.pop("callbacks", [])], **trainer_kwargs(**trainer_args))
    trainer.fit(module, data)
    return trainer, module


# ---------------------------------------------------------------- the micro-batch the loader really gives
class LoaderIgnoresBatchSize(RegressionData):
    def train_dataloader(self):
        return DataLoader(self.dataset, batch_size=16, sampler=self.sampler(), drop_last=True)


class LoaderBuiltOnceInSetup(RegressionData):
    def setup(self, stage):
        self.loader = super().train_dataloader()  # reads batch_size once, before BatchWarmup can change it

    def train_dataloader(self):
        return self.loader


def test_a_loader_that_ignores_batch_size_stops_training():
    module = RegressionModule()
    with pytest.raises(ValueError, match=r"batch_size=8 samples, but the train loader's batch holds 16"):
        fit(
            BatchWarmup(PiecewiseBatch([8, 16], [0, 32], unit="samples")),
            module=module,
            data=LoaderIgnoresBatchSize(batch_size=8),
        )
    assert not module.steps


def test_a_loader_that_cannot_change_its_micro_batch_is_refused_before_training():
    warmup = BatchWarmup(PiecewiseBatch([2, 4], [0, 10], unit="samples"), max_micro_batch_size=4)
    module = RegressionModule()
    with pytest.raises(
        ValueError,
        match=r"^BatchWarmup\(max_micro_batch_size=4\) changes the micro-batch between optimizer "
        r"steps \(2 -> 4 samples per rank\), which the train loader \(DataLoader\) cannot",
    ):
        fit(warmup, module=module, data=LoaderBuiltOnceInSetup(n=16, batch_size=2), max_epochs=2)
    assert not module.steps


def test_a_short_last_batch_is_not_a_mismatch():
    data = RegressionData(n=17, batch_size=2)
    data.train_dataloader = lambda: DataLoader(data.dataset, batch_size=2)  # 9 batches, the last holds 1
    trainer, module = fit(BatchWarmup(ConstantBatch(2)), data=data, max_epochs=2)
    assert trainer.global_step == 18 and len(module.steps[8]["indices"]) == 1


# ---------------------------------------------------------------- what automatic optimization cannot train
@pytest.mark.parametrize(
    "callback",
    [
        BatchWarmup(PiecewiseBatch([2, 4], [0, 8], unit="samples")),
        CBSProbeCallback(every_tokens=64, multipliers=(1, 2), window_tokens=64),
        GradientNoiseScale(),
    ],
    ids=lambda callback: type(callback).__name__,
)
def test_two_optimizers_are_refused_before_training_with_what_lit_cbs_supports(callback):
    module = TwoOptimizers()
    with pytest.raises(
        LitCBSConfigError,
        match=rf"^configure_optimizers returned 2 optimizers \(SGD, Adam\), but {type(callback).__name__} trains under "
        r"Lightning's automatic optimization, which steps one: give every parameter to one optimizer, a param group",
    ):
        fit(callback, module=module)
    assert not module.steps and "configure_optimizers" not in vars(module)  # the check took itself off
    one = RegressionModule()
    fit(BatchWarmup(ConstantBatch(2)), module=one, max_steps=1)
    assert len(one.steps) == 1 and "configure_optimizers" not in vars(one)


def test_a_second_batch_warmup_is_refused_before_training():
    with pytest.raises(RuntimeError, match="more than one stateful callback of type `BatchWarmup`"):
        pl.Trainer(callbacks=[BatchWarmup(ConstantBatch(2)), BatchWarmup(ConstantBatch(4))])  # Lightning's, at once
    trainer = pl.Trainer(callbacks=[BatchWarmup(ConstantBatch(2))], **trainer_kwargs())
    trainer.callbacks.append(BatchWarmup(ConstantBatch(4)))  # past Lightning's check of the list it was given
    module = RegressionModule()
    with pytest.raises(LitCBSConfigError, match=r"^the Trainer has 2 BatchWarmup callbacks, .*: keep one"):
        trainer.fit(module, RegressionData(n=48, batch_size=2))
    assert not module.steps


# ---------------------------------------------------------------- tokens only for token data
class TokenIds(torch.utils.data.Dataset):
    def __init__(self, width: int = 6):
        self.width = width  # token ids per sample

    def __len__(self):
        return 32

    def __getitem__(self, i):
        return {
            "input_ids": torch.full((self.width,), i, dtype=torch.long),
            "x": torch.randn(4, dtype=torch.float64),
            "y": torch.zeros(1, dtype=torch.float64),
            "idx": i,
        }


def test_float_features_are_not_tokens():
    warmup = BatchWarmup(ConstantBatch(4))
    data = RegressionData(n=48, batch_size=2)  # x: float [2, 4]
    trainer, _ = fit(warmup, data=data, enable_progress_bar=True)
    assert (
        warmup.accounting.seq_len is None
        and warmup.accounting.tokens_seen == 0
        and warmup.accounting.samples_seen == 48
    )
    assert "samples" in trainer.progress_bar_metrics and "tokens" not in trainer.progress_bar_metrics


def test_integer_token_ids_give_the_sequence_length():
    data = RegressionData(n=32, batch_size=2)
    data.train_dataloader = lambda: DataLoader(TokenIds(), batch_size=2)
    warmup = BatchWarmup(ConstantBatch(4), max_tokens=96)
    trainer, _ = fit(warmup, data=data, enable_progress_bar=True)
    assert warmup.accounting.seq_len == 6 and warmup.accounting.tokens_seen == 96 and trainer.global_step == 4
    assert trainer.progress_bar_metrics["tokens"] == 96


@pytest.mark.parametrize(
    "width, seq_len, said",
    [
        (128, None, "info"),
        (129, None, "warning"),  # 128 inputs + the last target, in one tensor
        (129, 128, None),  # given: nothing inferred
    ],
)
def test_the_tokens_per_sample_read_off_the_data_are_said_and_a_width_of_t_plus_1_warns(width, seq_len, said, caplog):
    data = RegressionData(n=32, batch_size=2)
    data.train_dataloader = lambda: DataLoader(TokenIds(width), batch_size=2)
    warmup = BatchWarmup(ConstantBatch(2), seq_len=seq_len)
    with caplog.at_level("INFO"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(warmup, data=data, max_steps=2)
    assert (
        warmup.accounting.seq_len == (seq_len or width)
        and warmup.accounting.tokens_seen == 4 * warmup.accounting.seq_len
    )
    found = f"{width} tokens per sample, the width of the batch's first 2-D integer tensor (int64 [2, {width}])"
    warned = [str(warning.message) for warning in caught if "tokens per sample" in str(warning.message)]
    if said == "warning":
        (message,) = warned
        assert message.startswith(f"BatchAccounting counts {found}; if it holds inputs and targets shifted by one")
        assert "give seq_len=128 (to BatchAccounting or BatchWarmup)" in message
    else:
        assert not warned
    assert (f"BatchAccounting: {found}" in caplog.text) == (said == "info")


# ---------------------------------------------------------------- checkpoints inside an accumulation window
@pytest.mark.parametrize("val_check_interval, warns", [(3, True), (4, False)])
def test_validation_checkpoints_inside_an_accumulation_window_warn(tmp_path, val_check_interval, warns):
    class Validated(RegressionModule):
        def validation_step(self, batch, batch_idx):
            return self.training_step(batch, batch_idx)

    data = RegressionData(n=48, batch_size=2)
    data.val_dataloader = lambda: DataLoader(data.dataset, batch_size=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(
            BatchWarmup(PiecewiseBatch([2, 4], [0, 8], unit="samples")),
            module=Validated(),
            data=data,
            callbacks=[ModelCheckpoint(dirpath=tmp_path)],
            enable_checkpointing=True,
            val_check_interval=val_check_interval,
            limit_val_batches=1,
        )
    messages = [str(w.message) for w in caught if "inside an accumulation window" in str(w.message)]
    assert bool(messages) == warns
    if warns:
        assert "val_check_interval to a multiple of 2 micro-batches (e.g. 4)" in messages[0]


def test_step_aligned_checkpoints_do_not_warn(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(
            BatchWarmup(ConstantBatch(8)),
            callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2)],
            enable_checkpointing=True,
        )
    assert not [w for w in caught if "accumulation window" in str(w.message)]


# ---------------------------------------------------------------- each logged row describes its own step
def test_logged_rows_agree_with_learning_rate_monitor(tmp_path):
    schedule = PiecewiseBatch([2, 4, 8], [0, 12, 40], unit="samples")
    module = RegressionModule(
        scheduler_factory=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + 0.1 * s))
    )
    logger = CSVLogger(tmp_path, name="run", version=0)
    trainer, module = fit(
        BatchWarmup(schedule, lr_rule="sqrt"),
        module=module,
        logger=logger,
        log_every_n_steps=1,
        callbacks=[LearningRateMonitor(logging_interval="step")],
        max_epochs=2,
    )
    rows = {}
    for row in csv.DictReader((tmp_path / "run" / "version_0" / "metrics.csv").read_text().splitlines()):
        rows.setdefault(int(row["step"]), {}).update({k: v for k, v in row.items() if v})
    assert sorted(rows) == list(range(trainer.global_step))
    for step, row in rows.items():
        assert float(row["lr"]) == pytest.approx(float(row["lr-SGD"]), rel=1e-12)
        assert float(row["lr"]) == pytest.approx(module.steps[step]["lr"], rel=1e-12)
        assert float(row["batch/global_size"]) == len(module.steps[step]["indices"])
        assert float(row["samples_seen"]) == sum(len(s["indices"]) for s in module.steps[: step + 1])


def test_no_change_after_the_last_step_and_resume_applies_it(tmp_path):
    # 2 samples per step, 10 steps per epoch: the schedule asks for 4 after step 10 (20 samples), which
    # is the last step of the short run. Its checkpoint falls at the epoch's end, where resume is exact.
    schedule = PiecewiseBatch([2, 4], [0, 20], unit="samples")
    short = BatchWarmup(schedule)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="short", every_n_train_steps=10)
    trainer, _ = fit(
        short,
        data=RegressionData(n=20, batch_size=2),
        max_steps=10,
        max_epochs=3,
        callbacks=[checkpoint],
        enable_checkpointing=True,
    )
    assert (
        short.history == [] and short.global_batch == 2 and float(trainer.optimizers[0].param_groups[0]["lr"]) == 0.05
    )

    full = BatchWarmup(schedule)
    _, full_module = fit(full, data=RegressionData(n=20, batch_size=2), max_steps=16, max_epochs=3)
    resumed = BatchWarmup(schedule)
    pl.seed_everything(0, verbose=False)
    resumed_module = RegressionModule()
    trainer = pl.Trainer(callbacks=[resumed], **trainer_kwargs(max_steps=16, max_epochs=3))
    trainer.fit(resumed_module, RegressionData(n=20, batch_size=2), ckpt_path=tmp_path / "short.ckpt")
    # The same change at the same step (the resumed run records it at the start of epoch 1, not the end of 0).
    assert [dataclasses.replace(c, epoch=0) for c in resumed.history] == full.history and full.history[0].step == 10
    assert torch.equal(resumed_module.layer.weight, full_module.layer.weight)


# ---------------------------------------------------------------- what the README promises
def test_the_epoch_tail_step_divides_by_the_full_accumulation():
    # 10 samples, micro-batch 2, accumulate 4: one full step, then a tail of one micro-batch.
    data = RegressionData(n=10, batch_size=2)
    _, module = fit(BatchWarmup(ConstantBatch(8)), data=data)
    full, tail = module.steps
    assert len(full["indices"]) == 8 and len(tail["indices"]) == 2
    torch.testing.assert_close(full["grad"], mean_gradient(data.dataset, full["indices"], full["weight"]))
    torch.testing.assert_close(tail["grad"], mean_gradient(data.dataset, tail["indices"], tail["weight"]) * 2 / 8)


def test_one_cycle_lambda_replaces_one_cycle_lr():
    module = RegressionModule(
        scheduler_factory=lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=24)
    )
    with pytest.raises(TypeError, match=r"LambdaLR\(optimizer, lit_cbs.rules.lr_schedules.OneCycle\(total=24"):
        fit(BatchWarmup(PiecewiseBatch([2, 4], [0, 16], unit="samples")), module=module)

    reference = RegressionModule(
        scheduler_factory=lambda opt: torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=0.05, total_steps=24, cycle_momentum=False
        )
    )
    pl.seed_everything(0, verbose=False)
    pl.Trainer(**trainer_kwargs()).fit(reference, RegressionData(n=48, batch_size=2))
    replaced = RegressionModule(
        scheduler_factory=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, OneCycle(total=24))
    )
    fit(BatchWarmup(ConstantBatch(2)), module=replaced)
    assert [s["lr"] for s in replaced.steps] == pytest.approx([s["lr"] for s in reference.steps], rel=1e-12)

    warmed = RegressionModule(scheduler_factory=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, OneCycle(total=24)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a step-indexed schedule under a changing batch warns
        fit(BatchWarmup(PiecewiseBatch([2, 4], [0, 16], unit="samples"), lr_rule="linear"), module=warmed)
    # Steps 0-7 at batch 2, then batch 4 at twice the one-cycle LR of the same step.
    assert [s["lr"] for s in warmed.steps[:8]] == pytest.approx([s["lr"] for s in reference.steps[:8]], rel=1e-12)
    assert [s["lr"] for s in warmed.steps[8:]] == pytest.approx(
        [2 * s["lr"] for s in reference.steps[8 : len(warmed.steps)]], rel=1e-12
    )
