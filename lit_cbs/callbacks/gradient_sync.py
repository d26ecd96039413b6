"""``GradientSync``: FSDP2 reduce-scatters a step's gradient only on the micro-batch that steps."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lit_cbs._internals import should_accumulate

__all__: list[str] = []


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
