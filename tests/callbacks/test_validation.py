"""TokenValidation: validation after the step that crosses each multiple of its tokens, whatever the
micro-batch, on a real Trainer."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from toys import GlobalOrderRegressionData, RegressionModule, trainer_kwargs

from lit_cbs import BatchWarmup, PiecewiseBatch, TokenValidation
from lit_cbs.callbacks.accounting import BatchAccounting
from lit_cbs.errors import LitCBSConfigError


class Validated(RegressionModule):
    """Records the tokens seen at every validation."""

    def __init__(self):
        super().__init__()
        self.validated_at: list[int] = []

    def validation_step(self, batch, batch_idx):
        if batch_idx == 0:
            self.validated_at.append(BatchAccounting.attach(self.trainer).tokens_seen)
        return torch.nn.functional.mse_loss(self.layer(batch["x"]), batch["y"])


class ValData(GlobalOrderRegressionData):
    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.dataset, batch_size=8)


def test_validation_every_tokens_through_micro_batch_changes():
    # 4 tokens per sample; batch 4 -> 8 -> 16 samples (micro-batch 4, 8, 8 x 2): 16, 32, 64 tokens a step.
    warmup = BatchWarmup(
        PiecewiseBatch([4, 8, 16], [0, 64, 192], unit="tokens"), seq_len=4, max_micro_batch_size=8, max_tokens=512
    )
    module = Validated()
    trainer = pl.Trainer(
        callbacks=[warmup, TokenValidation(every_tokens=96)],
        **trainer_kwargs(max_epochs=-1, num_sanity_val_steps=0, limit_val_batches=1, check_val_every_n_epoch=None),
    )
    trainer.fit(module, ValData(n=96, batch_size=4))
    # Steps end at 16, 32, 48, 64 tokens, then 96, 128, 160, 192, then 256, 320, ...: validation after the
    # step that reaches or passes 96, 192, 288, 384, 480 (the last is also the run's end, where Lightning validates).
    assert module.validated_at == [96, 192, 320, 384, 512]
    assert [c.new_micro_batch_size for c in warmup.history] == [8, 8]


@pytest.mark.parametrize(
    "trainer_args, match",
    [
        (
            dict(val_check_interval=4),
            r"TokenValidation\(every_tokens=96\) decides when to validate, but Trainer\(val_check_interval=4\)",
        ),
        (dict(check_val_every_n_epoch=2), r"set check_val_every_n_epoch=None"),
    ],
)
def test_another_validation_cadence_is_refused_before_training(trainer_args, match):
    module = Validated()
    trainer = pl.Trainer(
        callbacks=[BatchWarmup(PiecewiseBatch([4], [0], unit="samples"), seq_len=4), TokenValidation(96)],
        **trainer_kwargs(**trainer_args),
    )
    with pytest.raises(LitCBSConfigError, match=match):
        trainer.fit(module, ValData(n=96, batch_size=4))
    assert not module.steps


def test_every_tokens_must_be_positive():
    with pytest.raises(LitCBSConfigError, match=r"every_tokens=0 must be a positive int"):
        TokenValidation(every_tokens=0)
