"""A loss that is the mean over every counted token of the optimizer step, however the step is split."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from lit_cbs.callbacks.accounting import BatchAccounting

__all__ = ["token_mean_loss"]


def token_mean_loss(module: pl.LightningModule, loss_sum: torch.Tensor, tokens: torch.Tensor | int) -> torch.Tensor:
    """What ``training_step`` returns so that each optimizer step's gradient is the mean over every counted token of
    the step, whatever its split into micro-batches, accumulation and ranks.

    Lightning averages micro-batch means; where micro-batches count different numbers of tokens (padding, masked
    labels, a short last micro-batch) that is not the step's token mean, and it moves when a batch change splits
    the step anew. The result has the micro-batch's mean as value and the gradient of ``loss_sum``;
    ``BatchAccounting`` then rescales the step's gradients by accumulate x world size / the step's tokens.

    Args:
        module: the LightningModule (its Trainer's ``BatchAccounting`` counts the step's tokens).
        loss_sum: the micro-batch's loss summed over its counted tokens, e.g.
            ``F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")``.
        tokens: how many tokens ``loss_sum`` counts, e.g. ``(labels != -100).sum()``.

    Example:
        A micro-batch whose 4 counted tokens sum to 6 nats: the value is their mean, the gradient the sum's:

        >>> import lightning.pytorch as pl, torch
        >>> module = pl.LightningModule()
        >>> module.trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False,
        ...                             enable_progress_bar=False, enable_model_summary=False)
        >>> loss_sum = torch.tensor(6.0, requires_grad=True)
        >>> loss = token_mean_loss(module, loss_sum, torch.tensor(4))
        >>> loss.item()
        1.5
        >>> loss.backward()
        >>> loss_sum.grad.item()
        1.0
    """
    return BatchAccounting.attach(module.trainer).step_tokens.add(loss_sum, tokens)
