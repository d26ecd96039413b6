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


class StepTokens:
    """The counted tokens of the optimizer step under way (this rank's), for ``rescale``."""

    def __init__(self):
        self.count: torch.Tensor | None = None  # None: no micro-batch of this step used token_mean_loss

    @property
    def active(self) -> bool:
        return self.count is not None

    def add(self, loss_sum: torch.Tensor, tokens) -> torch.Tensor:
        tokens = torch.as_tensor(tokens, device=loss_sum.device, dtype=torch.float64)
        self.count = tokens if self.count is None else self.count + tokens
        mean = loss_sum / tokens.clamp(min=1).to(loss_sum.dtype)
        return loss_sum + (mean - loss_sum).detach()  # the value of the mean, the gradient of the sum

    def rescale(self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer, divisor: int) -> None:
        """Turn the step's gradients, each micro-batch's sum / ``divisor`` averaged over the ranks,
        into the sum over the step's tokens / their number (all ranks); then start a new step."""
        if self.count is None:
            return
        count, self.count = self.count, None
        total = float(trainer.strategy.reduce(count, reduce_op="sum")) if trainer.world_size > 1 else float(count)
        if total == 0:
            return  # every token of the step was masked: the gradient is zero already
        scale = divisor * trainer.world_size / total
        with torch.no_grad():
            for group in optimizer.param_groups:
                for parameter in group["params"]:
                    if parameter.grad is not None:
                        parameter.grad.mul_(scale)


def token_mean_loss(module: pl.LightningModule, loss_sum: torch.Tensor, tokens) -> torch.Tensor:
    """What ``training_step`` returns so that each optimizer step's gradient is the mean over every
    counted token of the step, whatever its split into micro-batches, accumulation and ranks.

    Args:
        module: the LightningModule (its Trainer's ``BatchAccounting`` counts the step's tokens).
        loss_sum: the micro-batch's loss summed over its counted tokens, e.g.
            ``F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")``.
        tokens: how many tokens ``loss_sum`` counts, e.g. ``(labels != -100).sum()``.

    Returns:
        A tensor whose value is the micro-batch's mean loss and whose gradient is that of ``loss_sum``;
        ``BatchAccounting`` rescales the step's gradient before the optimizer step.
    """
    from lit_cbs.callbacks.accounting import BatchAccounting

    return BatchAccounting.attach(module.trainer).step_tokens.add(loss_sum, tokens)
