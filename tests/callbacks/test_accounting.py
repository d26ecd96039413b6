"""BatchAccounting: one source of the batch and token counts, with or without BatchWarmup."""

from __future__ import annotations

import time

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader
from toys import RegressionData, RegressionModule, trainer_kwargs

from lit_cbs import BatchWarmup, ConstantBatch, GradientNoiseScale, PiecewiseBatch, TokenLRScheduler
from lit_cbs.callbacks import BatchAccounting
from lit_cbs.errors import LitCBSConfigError
from lit_cbs.rules.warmup_core import check_divisible


class TokenIds(torch.utils.data.Dataset):
    """Regression samples that also carry 6 token ids each."""

    def __init__(self, n: int = 48):
        self.regression = RegressionData(n=n).dataset

    def __len__(self):
        return len(self.regression)

    def __getitem__(self, i):
        return {**self.regression[i], "input_ids": torch.full((6,), i, dtype=torch.long)}


class TokenData(RegressionData):
    def train_dataloader(self):
        return DataLoader(
            TokenIds(len(self.dataset)), batch_size=self.batch_size, sampler=self.sampler(), drop_last=True
        )


def fit(*callbacks, module=None, data=None, **trainer_args):
    pl.seed_everything(0, verbose=False)
    module = module or RegressionModule()
    trainer = pl.Trainer(callbacks=list(callbacks), **trainer_kwargs(**trainer_args))
    trainer.fit(module, data or TokenData(n=48, batch_size=2))
    return trainer, module


def accounting_of(trainer) -> BatchAccounting:
    found = [callback for callback in trainer.callbacks if isinstance(callback, BatchAccounting)]
    assert len(found) == 1 and trainer.callbacks[0] is found[0]  # one, and its hooks run first
    return found[0]


def test_a_fixed_batch_run_is_counted_without_batch_warmup():
    trainer, module = fit(BatchAccounting(max_tokens=120), accumulate_grad_batches=2)
    accounting = accounting_of(trainer)
    # 2 samples x 2 micro-batches per step; the budget of 120 tokens (20 samples) ends at step 5.
    assert (accounting.micro_batch_size, accounting.accumulate, accounting.global_batch) == (2, 2, 4)
    assert accounting.seq_len == 6 and accounting.samples_seen == 20 and accounting.tokens_seen == 120
    assert trainer.global_step == 5 and [len(step["indices"]) for step in module.steps] == [4] * 5


def test_a_token_lr_schedule_advances_without_batch_warmup():
    # TokenLRScheduler alone: the accounting BatchAccounting.of attaches feeds it the token count.
    def scheduler(optimizer):
        return TokenLRScheduler(optimizer, lambda tokens: 1.0 / (1 + tokens))

    class AttachesAccounting(RegressionModule):
        def setup(self, stage):
            BatchAccounting.attach(self.trainer)

    trainer, module = fit(module=AttachesAccounting(lr=0.5, scheduler_factory=scheduler), max_steps=3)
    # The step after t tokens (12 per step: 2 samples x 6 tokens) trains with LR 0.5 / (1 + t).
    assert [step["lr"] for step in module.steps] == pytest.approx([0.5 / (1 + t) for t in (0, 12, 24)])
    assert accounting_of(trainer).tokens_seen == 36


def test_callbacks_share_one_accounting_that_batch_warmup_drives():
    warmup = BatchWarmup(PiecewiseBatch([2, 4], [0, 16], unit="samples"), max_tokens=240)
    noise = GradientNoiseScale()
    trainer, module = fit(noise, warmup, data=TokenData(n=48, batch_size=2), max_epochs=2)
    accounting = accounting_of(trainer)
    assert warmup.accounting is accounting and accounting.max_tokens == 240
    assert (accounting.global_batch, accounting.accumulate) == (4, 2)
    assert accounting.tokens_seen == 240 and accounting.samples_seen == 40
    assert (warmup.global_batch, warmup.micro_batch_size, warmup.accumulate) == (4, 2, 2)


def test_batch_warmup_checks_the_accountings_settings_when_it_is_built():
    with pytest.raises(LitCBSConfigError, match=r"^seq_len=0 must be a positive int or None \(tokens per sample\)$"):
        BatchWarmup(ConstantBatch(2), seq_len=0)
    warmup = BatchWarmup(ConstantBatch(2), max_tokens=96, seq_len=6)
    assert (warmup.max_tokens, warmup.seq_len) == (96, 6)  # before a Trainer: what it will hand the accounting
    trainer, _ = fit(warmup)
    assert (accounting_of(trainer).max_tokens, accounting_of(trainer).seq_len) == (96, 6)


def test_max_tokens_given_twice_must_agree():
    with pytest.raises(
        LitCBSConfigError, match=r"BatchWarmup\(max_tokens=96\) conflicts with BatchAccounting\(max_tokens=48\)"
    ):
        fit(BatchAccounting(max_tokens=48), BatchWarmup(ConstantBatch(2), max_tokens=96))


def test_max_tokens_on_data_without_token_ids_is_refused_before_a_step():
    module = RegressionModule()
    with pytest.raises(LitCBSConfigError, match=r"max_tokens=48 but the batches hold no token ids"):
        fit(BatchAccounting(max_tokens=48), module=module, data=RegressionData(n=48, batch_size=2))
    assert not module.steps


def test_counts_resume_from_a_checkpoint(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    fit(BatchAccounting(), checkpoint, max_steps=3, enable_checkpointing=True)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(callbacks=[BatchAccounting()], **trainer_kwargs(max_steps=5))
    trainer.fit(RegressionModule(), TokenData(n=48, batch_size=2), ckpt_path=tmp_path / "epoch=0-step=3.ckpt")
    accounting = accounting_of(trainer)
    assert trainer.global_step == 5 and accounting.samples_seen == 10 and accounting.tokens_seen == 60


def test_check_divisible_names_the_setting_and_the_nearest_sizes():
    assert check_divisible(24, 4, 2) == 3
    with pytest.raises(
        LitCBSConfigError,
        match=r"data.global_batch 20 is not a multiple of .* = 8 samples; nearest valid sizes: 16 or 24: set "
        r"data.global_batch to one of them, or use a micro-batch \(batch_size\) that divides 10 \(a rank's share\)$",
    ):
        check_divisible(20, 4, 2, name="data.global_batch")
    with pytest.raises(LitCBSConfigError, match=r"or use a number of data-parallel ranks that divides 9$"):
        check_divisible(9, 1, 2)


class BranchesAtStep(Callback):
    """Stands in for a CBS probe: at the end of optimizer step ``step`` (1-based), ``seconds`` of probe work."""

    def __init__(self, step: int, seconds: float):
        self.step, self.seconds = step, seconds
        self.seen_in_branch: list[bool] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            accounting = BatchAccounting.attach(trainer)
            with accounting.branching():
                self.seen_in_branch.append(accounting.in_branch)
                time.sleep(self.seconds)
        self.seen_in_branch.append(BatchAccounting.attach(trainer).in_branch)


def test_branching_marks_probe_work_and_counts_its_seconds_from_fit_start():
    probe = BranchesAtStep(step=2, seconds=0.2)
    trainer, _ = fit(probe, max_steps=3)
    accounting = accounting_of(trainer)
    assert probe.seen_in_branch == [False, True, False, False]
    assert 0.2 <= accounting.branch_seconds < 0.5
    # A second fit on the same Trainer's callbacks counts afresh.
    pl.seed_everything(0, verbose=False)
    again = pl.Trainer(callbacks=[accounting, BranchesAtStep(step=1, seconds=0.1)], **trainer_kwargs(max_steps=1))
    again.fit(RegressionModule(), TokenData(n=48, batch_size=2))
    assert 0.1 <= accounting.branch_seconds < 0.3  # not 0.2 from the first fit + 0.1


def test_branching_counts_its_seconds_once_and_also_when_it_raises():
    accounting = BatchAccounting()
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="out of memory"), accounting.branching():
        with accounting.branching():  # nested: harmless, counted once
            time.sleep(0.1)
            assert accounting.in_branch
        assert accounting.in_branch
        raise RuntimeError("out of memory")
    elapsed = time.perf_counter() - start
    assert not accounting.in_branch
    assert 0.1 <= accounting.branch_seconds <= elapsed  # twice 0.1 if the nested block counted too
