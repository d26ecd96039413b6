"""``StepTokens``: ``token_mean_loss``'s side of an optimizer step, its gradient made the mean over its tokens."""

from __future__ import annotations

from typing import Protocol

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

__all__: list[str] = []


class _Counts(Protocol):  # BatchAccounting
    in_branch: bool


class StepTokens(Callback):
    """The counted tokens of the optimizer step under way (this rank's). ``BatchAccounting`` places it right
    after itself, so the step's gradient is rescaled before any other callback sees it."""

    def __init__(self, accounting: _Counts) -> None:
        self._accounting = accounting  # a CBS probe's branch (in_branch) rescales its own steps
        self.count: torch.Tensor | None = None  # None: no micro-batch of this step used token_mean_loss

    @property
    def active(self) -> bool:
        return self.count is not None

    def add(self, loss_sum: torch.Tensor, tokens: torch.Tensor | int) -> torch.Tensor:
        tokens = torch.as_tensor(tokens, device=loss_sum.device, dtype=torch.float64)
        self.count = tokens if self.count is None else self.count + tokens
        mean = loss_sum / tokens.clamp(min=1).to(loss_sum.dtype)
        return loss_sum + (mean - loss_sum).detach()  # the value of the mean, the gradient of the sum

    def rescale(self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer, divisor: int) -> None:
        """Turn the step's gradient (micro-batch sums / ``divisor``, mean over ranks) into the mean over its tokens."""
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

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if not self._accounting.in_branch:  # a branch divides by its own accumulation
            self.rescale(trainer, optimizer, trainer.accumulate_grad_batches)
