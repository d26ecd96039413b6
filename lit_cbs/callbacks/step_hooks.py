"""The two callbacks ``BatchAccounting`` places right after itself, whose hooks every optimizer step needs before the
others': ``GradientSync`` (FSDP2) and ``StepTokens`` (``token_mean_loss``'s side of a step)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lit_cbs._internals import should_accumulate


class GradientSync(Callback):
    """Lightning skips the all-reduce of accumulating micro-batches only for DDP: this turns FSDP2's gradient sync
    off for them. ``BatchAccounting`` places it right after itself; a CBS probe's branch calls ``set`` itself."""

    def __init__(self) -> None:
        self._modules: list[Any] = []
        self._sync: bool | None = None

    def set(self, sync: bool | None) -> None:
        """Reduce FSDP2 gradients in the next backward (True) or keep them local (False); None resets to syncing."""
        if sync is None:
            sync, self._sync = True, None
        if sync != self._sync:
            for module in self._modules:
                module.set_requires_gradient_sync(sync, recurse=False)
            self._sync = sync

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from torch.distributed.fsdp import FSDPModule

        self._modules = [module for module in pl_module.modules() if isinstance(module, FSDPModule)]
        self._sync = None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._modules:
            self.set(not should_accumulate(trainer))


class StepTokens(Callback):
    """The counted tokens of the optimizer step under way (this rank's). ``BatchAccounting`` places it right
    after itself, so the step's gradient is rescaled before any other callback sees it."""

    def __init__(self, accounting: Any) -> None:  # BatchAccounting, which imports this
        self._accounting = accounting  # a CBS probe's branch (in_branch) rescales its own steps
        self.count: torch.Tensor | None = None  # None: no micro-batch of this step used token_mean_loss

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
