"""Every private Lightning, torch, torchmetrics and Hydra attribute lit_cbs uses, behind one named function or
listed under the one module that reads it; tests/test_internals.py resolves every path in ``PRIVATE_ATTRIBUTES``
against the installed versions."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as checkpoint_wrapper
from torch.utils._pytree import tree_leaves as tree_leaves
from torch.utils._pytree import tree_map as tree_map

if TYPE_CHECKING:
    import lightning.pytorch as pl

# What each function (or module) reaches: dotted paths from a module or a live object (trainer., metric., ...).
PRIVATE_ATTRIBUTES = {
    "should_accumulate": ("trainer.fit_loop.epoch_loop._should_accumulate",),
    "logging_step": ("trainer.fit_loop.epoch_loop._batches_that_stepped",),
    "set_validation_due": ("trainer.val_check_batch", "trainer.fit_loop.epoch_loop.total_batch_idx"),
    "given_train_loader": ("trainer.fit_loop._data_source",),
    "collect_rng_states": ("lightning.fabric.utilities.seed._collect_rng_states",),
    "set_rng_states": ("lightning.fabric.utilities.seed._set_rng_states",),
    "request_val_dataloaders": (
        "trainer.fit_loop.epoch_loop.val_loop._data_source",
        "lightning.pytorch.trainer.connectors.data_connector._request_dataloader",
    ),
    "inner_schedulers": ("sequential_lr._schedulers",),
    "scale_last_lr": ("lr_scheduler._last_lr",),
    "checkpoint_wrapper": ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper",),
    "tree_map": ("torch.utils._pytree.tree_map",),
    "tree_leaves": ("torch.utils._pytree.tree_leaves",),
    "foreach_sub_": ("torch._foreach_sub_",),
    "foreach_copy_": ("torch._foreach_copy_",),
    "foreach_norm": ("torch._foreach_norm",),
    "hydra_command_line": ("hydra._internal.utils.get_args_parser",),
    # Read in place by the one module that needs each (a subclass's own attributes, or one line).
    "lit_cbs.probe.branch": ("lightning.pytorch.loops.utilities._block_parallel_sync_behavior",),
    "lit_cbs.probe.in_process": ("lightning.pytorch.trainer.connectors.data_connector._process_dataloader",),
    "lit_cbs.callbacks.accounting": (
        "trainer.fit_loop.max_batches",
        "trainer.fit_loop._combined_loader",
        "trainer.fit_loop._data_fetcher",
        "trainer.fit_loop.epoch_loop.batch_progress",
    ),
    "lit_cbs.callbacks.warmup": ("trainer.fit_loop.epoch_loop.batch_progress", "trainer.fit_loop._data_fetcher"),
    "lit_cbs.callbacks.logs": ("trainer._logger_connector.should_update_logs",),
    "lit_cbs.callbacks.module_state": ("metric._update_count", "metric._computed"),
    "lit_cbs.callbacks.warmup_checks": ("model_checkpoint._train_time_interval", "model_checkpoint._every_n_epochs"),
    "lit_cbs.callbacks.checkpoint": (
        "model_checkpoint._last_global_step_saved",
        "model_checkpoint._every_n_train_steps",
        "trainer._accelerator_connector.cluster_environment",
        "trainer._checkpoint_connector._hpc_resume_path",
    ),
}

__all__ = [*(name for name in PRIVATE_ATTRIBUTES if "." not in name), "PRIVATE_ATTRIBUTES"]

foreach_sub_ = torch._foreach_sub_
foreach_copy_ = torch._foreach_copy_
foreach_norm = torch._foreach_norm


def should_accumulate(trainer: pl.Trainer) -> bool:
    """True while the current micro-batch is not the last of its optimizer step."""
    return trainer.fit_loop.epoch_loop._should_accumulate()


def logging_step(trainer: pl.Trainer) -> int:
    """The logger row ``self.log`` writes to now; in a stepping micro-batch's hooks, the step just taken (from 0)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def set_validation_due(trainer: pl.Trainer, due: bool) -> None:
    """Make the fit loop validate after this micro-batch, or not (through ``val_check_batch``)."""
    loop = trainer.fit_loop.epoch_loop
    count = (loop.total_batch_idx if trainer.check_val_every_n_epoch is None else loop.batch_idx) + 1
    trainer.val_check_batch = count if due else count + 1


def given_train_loader(trainer: pl.Trainer) -> Any:
    """The loader passed as ``trainer.fit(train_dataloaders=...)``, or None (a hook builds it)."""
    source = trainer.fit_loop._data_source.instance
    import lightning.pytorch as pl

    return None if isinstance(source, (pl.LightningModule, pl.LightningDataModule)) or source is None else source


def request_val_dataloaders(trainer: pl.Trainer) -> Any:
    """The fit's validation loader(s), from where Lightning's validation loop takes them; None if none."""
    source = trainer.fit_loop.epoch_loop.val_loop._data_source
    from lightning.pytorch.trainer.connectors.data_connector import _request_dataloader

    return _request_dataloader(source) if source.is_defined() else None


def collect_rng_states(include_cuda: bool) -> dict[str, Any]:
    """The torch, numpy and Python RNG states (and CUDA's), as Lightning checkpoints them."""
    from lightning.fabric.utilities.seed import _collect_rng_states

    return _collect_rng_states(include_cuda=include_cuda)


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore RNG states taken by ``collect_rng_states``."""
    from lightning.fabric.utilities.seed import _set_rng_states

    _set_rng_states(states)


def inner_schedulers(scheduler: Any) -> list[Any]:
    """The schedulers a ``SequentialLR`` or ``ChainedScheduler`` runs."""
    return list(scheduler._schedulers)


def scale_last_lr(scheduler: Any, factor: float) -> None:
    """Multiply the LRs a scheduler last set (``get_last_lr()``) by ``factor``, if it has set any."""
    if getattr(scheduler, "_last_lr", None) is not None:
        scheduler._last_lr = [lr * factor for lr in scheduler._last_lr]


def hydra_command_line(argv: list[str]) -> Any:
    """A Hydra app's command line as ``hydra.main`` reads it (an ``argparse.Namespace``; exits with its usage)."""
    from hydra._internal.utils import get_args_parser

    return get_args_parser().parse_args(argv)
