"""A loss that is the mean over every unmasked token of the optimizer step, however it is split.

Lightning divides each micro-batch's loss by the accumulation and DDP/FSDP average the gradients
over the ranks, so the step's gradient is the mean of the micro-batch means. When micro-batches
hold different numbers of counted tokens (padding, masked labels, an epoch's short last
micro-batch), that is not the mean over the step's tokens, and it changes whenever a batch change
splits the step differently.

``token_mean_loss(module, loss_sum, tokens)`` makes it exact. Its result has the value of the
micro-batch's mean (what the progress bar and the guard read) and the gradient of its *sum*;
before the optimizer step (and before gradient clipping) ``BatchAccounting`` adds up the step's
counted tokens over every micro-batch and rank (one all-reduce of a scalar) and multiplies the
gradients by accumulate x world size / tokens, which makes them sum of token losses / tokens of
the step. A CBS probe's branches do the same with their own accumulation.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from lit_cbs.callbacks.accounting import BatchAccounting

__all__ = ["token_mean_loss"]


def token_mean_loss(module: pl.LightningModule, loss_sum: torch.Tensor, tokens) -> torch.Tensor:
    """What ``training_step`` returns so that each optimizer step's gradient is the mean over every
    counted token of the step, whatever its split into micro-batches, accumulation and ranks.

    Args:
        module: the LightningModule (its Trainer's ``BatchAccounting`` counts the step's tokens).
        loss_sum: the micro-batch's loss summed over its counted tokens, e.g.
            ``F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")``.
        tokens: how many tokens ``loss_sum`` counts, e.g. ``(labels != -100).sum()``.

    Returns:
        A tensor whose value is the micro-batch's mean loss (nats per counted token) and whose gradient is
        that of ``loss_sum``; ``BatchAccounting`` rescales the step's gradient before the optimizer step.

    Raises:
        RuntimeError: ``module`` is not attached to a Trainer (Lightning's ``module.trainer``).

    Examples:
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
