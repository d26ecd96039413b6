"""``token_mean_loss``: the mean over every counted token of the optimizer step, however the step is split."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from lit_cbs.callbacks.accounting import BatchAccounting

__all__ = ["token_mean_loss"]


def token_mean_loss(module: pl.LightningModule, loss_sum: torch.Tensor, tokens: torch.Tensor | int) -> torch.Tensor:
    """What ``training_step`` returns so that each step's gradient is the mean over every counted token of the step,
    however it is split into micro-batches and ranks. ``loss_sum`` (nats) sums the loss over the ``tokens`` it counts,
    e.g. ``F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")`` and ``(labels != -100).sum()``.

    Examples:
        >>> import lightning.pytorch as pl, torch
        >>> module = pl.LightningModule()
        >>> module.trainer = pl.Trainer(accelerator="cpu", logger=False)
        >>> loss_sum = torch.tensor(6.0, requires_grad=True)  # 4 counted tokens, 6 nats
        >>> token_mean_loss(module, loss_sum, torch.tensor(4)).item()
        1.5
    """
    return BatchAccounting.attach(module.trainer).step_tokens.add(loss_sum, tokens)
