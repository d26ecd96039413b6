"""``TrainingSnapshot``: an in-memory copy of everything a training step changes, restored in place.

A CBS probe takes one at the start of its window (every branch starts there) and one at its end
(the main run goes on from there).
"""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import torch

from lit_cbs.callbacks.module_state import ModuleState

__all__ = ["TrainingSnapshot"]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank-local storage of a tensor (a DTensor's shard under FSDP2)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _reshard(pl_module) -> None:
    """Put FSDP2 parameters back into their sharded form.

    A forward without backward (held-out loss) leaves modules built with
    reshard_after_forward=False unsharded; snapshots copy and restore the shards.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in pl_module.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _copy_to(value, device):
    if isinstance(value, torch.Tensor):
        return _local(value).detach().to(device, copy=True)
    return copy.deepcopy(value)


class TrainingSnapshot:
    """An in-memory copy of everything a training step changes, restored in place.

    Parameters, buffers and optimizer state are copied rank-locally (FSDP2 shards stay shards);
    schedulers and the grad scaler through their state_dicts; RNG states of torch (CPU and CUDA),
    numpy and random; the states of torchmetrics metrics in the module (a training_step that
    updates a metric would otherwise count the branches' batches).

    Args:
        trainer: the Trainer whose optimizers, LR schedulers and grad scaler are copied.
        pl_module: the module whose parameters, buffers, RNG streams and metric states are copied.
        device: where the copies live ("cpu" keeps accelerator memory free).

    Examples:
        >>> import lightning.pytorch as pl
        >>> import torch
        >>> module = pl.LightningModule()
        >>> module.layer = torch.nn.Linear(2, 1)
        >>> trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
        >>> snapshot = TrainingSnapshot(trainer, module)
        >>> bias, draw = module.layer.bias.item(), torch.rand(1)
        >>> with torch.no_grad():
        ...     _ = module.layer.bias.fill_(5.0)  # what a branch would change
        >>> snapshot.restore(trainer, module)
        >>> module.layer.bias.item() == bias, bool(torch.rand(1) == draw)  # weights and RNG as they were
        (True, True)
    """

    def __init__(self, trainer: pl.Trainer, pl_module: pl.LightningModule, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        _reshard(pl_module)
        self.tensors = [_copy_to(t, self.device) for t in self._module_tensors(pl_module)]
        self.optimizers = [
            (
                {
                    param: {key: _copy_to(v, self.device) for key, v in state.items()}
                    for param, state in opt.state.items()
                },
                [{key: copy.deepcopy(v) for key, v in group.items() if key != "params"} for group in opt.param_groups],
            )
            for opt in trainer.optimizers
        ]
        self.schedulers = [copy.deepcopy(config.scheduler.state_dict()) for config in trainer.lr_scheduler_configs]
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.scaler = copy.deepcopy(scaler.state_dict()) if scaler is not None else None
        self.module_state = ModuleState(pl_module)

    @staticmethod
    def _module_tensors(pl_module) -> list[torch.Tensor]:
        return list(pl_module.parameters()) + list(pl_module.buffers())

    @torch.no_grad()
    def restore(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Put the copied state back in place (the same tensors, so optimizers keep their references); optimizer
        state a branch created is dropped and the gradients are cleared. The snapshot can be restored again.

        Args:
            trainer: the Trainer the snapshot was taken of.
            pl_module: the module the snapshot was taken of.
        """
        _reshard(pl_module)
        for live, saved in zip(self._module_tensors(pl_module), self.tensors):
            _local(live).copy_(saved)
        for opt, (states, groups) in zip(trainer.optimizers, self.optimizers):
            for param in list(opt.state):
                if param not in states:
                    del opt.state[param]  # state created by a branch (e.g. Adam's first step)
            for param, saved_state in states.items():
                live_state = opt.state[param]
                for key in list(live_state):
                    if key not in saved_state:
                        del live_state[key]
                for key, value in saved_state.items():
                    if isinstance(value, torch.Tensor) and isinstance(live_state.get(key), torch.Tensor):
                        _local(live_state[key]).copy_(value)
                    elif isinstance(value, torch.Tensor):
                        live_state[key] = value.to(_local(param).device, copy=True)
                    else:
                        live_state[key] = copy.deepcopy(value)
            for group, saved_group in zip(opt.param_groups, groups):
                group.update(copy.deepcopy(saved_group))
            opt.zero_grad(set_to_none=True)
        for config, state in zip(trainer.lr_scheduler_configs, self.schedulers):
            config.scheduler.load_state_dict(copy.deepcopy(state))
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and self.scaler is not None:
            scaler.load_state_dict(copy.deepcopy(self.scaler))
        self.module_state.restore(pl_module)
