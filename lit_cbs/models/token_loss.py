"""A loss that is the mean over every counted token of the optimizer step, however the step is split."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from lit_cbs.callbacks.accounting import BatchAccounting

__all__ = ["token_mean_loss"]


def token_mean_loss(module: pl.LightningModule, loss_sum: torch.Tensor, tokens: torch.Tensor | int) -> torch.Tensor:
    """What ``training_step`` returns so that each optimizer step's gradient is the mean over every counted token of
    the step, whatever its split into micro-batches, accumulation and ranks (Lightning averages micro-batch means).
    The value is the micro-batch's mean; the gradient is ``loss_sum``'s, rescaled at the step by accumulate x world
    size / the step's tokens.

    Args:
        loss_sum: the micro-batch's loss summed over its counted tokens, e.g.
            ``F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")``.
        tokens: how many tokens ``loss_sum`` counts, e.g. ``(labels != -100).sum()``.

    Examples:
        A micro-batch whose 4 counted tokens sum to 6 nats:

        >>> import lightning.pytorch as pl, torch
        >>> module = pl.LightningModule()
        >>> module.trainer = pl.Trainer(accelerator="cpu", logger=False)
        >>> loss_sum = torch.tensor(6.0, requires_grad=True)
        >>> loss = token_mean_loss(module, loss_sum, torch.tensor(4))
        >>> loss.item()
        1.5
        >>> loss.backward()
        >>> loss_sum.grad.item()
        1.0
    """
    return BatchAccounting.attach(module.trainer).step_tokens.add(loss_sum, tokens)
