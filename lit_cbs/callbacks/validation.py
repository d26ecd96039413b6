"""``TokenValidation``: validate every so many tokens, however large the batch and the micro-batch."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lit_cbs._internals import set_validation_due, should_accumulate
from lit_cbs.callbacks.accounting import BatchAccounting
from lit_cbs.errors import LitCBSConfigError, positive_int

__all__ = ["TokenValidation"]


class TokenValidation(Callback):
    """Run the validation loop after the optimizer step that crosses each multiple of ``every_tokens`` (tokens
    seen, all ranks): Lightning's ``val_check_interval`` counts micro-batches, which grow with BatchWarmup. Leave
    ``val_check_interval`` at its default and ``check_val_every_n_epoch`` at None or 1.

    Examples:
        >>> from lit_cbs.callbacks import TokenValidation
        >>> TokenValidation(every_tokens=1_000_000).every_tokens
        1000000
        >>> TokenValidation(every_tokens=0)
        Traceback (most recent call last):
        ...
        lit_cbs.errors.LitCBSConfigError: every_tokens=0 must be a positive int (tokens between validations)
    """

    def __init__(self, every_tokens: int):
        positive_int("every_tokens", every_tokens, "tokens between validations")  # LitCBSConfigError unless an int >= 1
        self.every_tokens = every_tokens
        self._accounting: BatchAccounting | None = None
        self._tokens_at_last_step = 0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if trainer.val_check_interval != 1.0:
            raise LitCBSConfigError(
                f"TokenValidation(every_tokens={self.every_tokens}) decides when to validate, but "
                f"Trainer(val_check_interval={trainer.val_check_interval}) asks for its own cadence: leave "
                "val_check_interval at its default, or drop TokenValidation"
            )
        if trainer.check_val_every_n_epoch not in (None, 1):
            raise LitCBSConfigError(
                f"TokenValidation validates inside epochs, which Trainer(check_val_every_n_epoch="
                f"{trainer.check_val_every_n_epoch}) forbids on most of them: set check_val_every_n_epoch=None"
            )
        self._accounting = BatchAccounting.attach(trainer)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self._accounting is not None  # setup attached it
        self._tokens_at_last_step = self._accounting.tokens_seen

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        accounting = self._accounting
        assert accounting is not None  # setup attached it
        if accounting.seq_len is None:
            raise LitCBSConfigError(
                f"TokenValidation(every_tokens={self.every_tokens}) counts tokens, but the batches hold no token ids: "
                "give seq_len=... to BatchAccounting or BatchWarmup, or validate with Trainer(val_check_interval=...)"
            )
        if should_accumulate(trainer):
            set_validation_due(trainer, False)
            return
        before, self._tokens_at_last_step = self._tokens_at_last_step, accounting.tokens_seen
        set_validation_due(trainer, accounting.tokens_seen // self.every_tokens > before // self.every_tokens)
