"""Every private Lightning, torch, torchmetrics and Hydra attribute lit_cbs uses, each behind one named function;
tests/test_internals.py resolves every path in ``PRIVATE_ATTRIBUTES`` against the installed versions."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as checkpoint_wrapper
from torch.utils._pytree import tree_leaves as tree_leaves
from torch.utils._pytree import tree_map as tree_map

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import Strategy
    from torchmetrics import Metric

# What each function reaches, as dotted paths from a module or a live object (trainer., model_checkpoint., ...).
PRIVATE_ATTRIBUTES = {
    "should_accumulate": ("trainer.fit_loop.epoch_loop._should_accumulate",),
    "logging_step": ("trainer.fit_loop.epoch_loop._batches_that_stepped",),
    "logs_this_step": ("trainer._logger_connector.should_update_logs",),
    "set_train_epoch_length": (
        "trainer.fit_loop.max_batches",
        "trainer.fit_loop._combined_loader",
        "trainer.fit_loop._data_fetcher",
        "trainer.fit_loop.epoch_loop.batch_progress",
    ),
    "shift_epoch_micro_batches": ("trainer.fit_loop.epoch_loop.batch_progress", "trainer.fit_loop._data_fetcher"),
    "set_validation_due": ("trainer.val_check_batch", "trainer.fit_loop.epoch_loop.total_batch_idx"),
    "given_train_loader": ("trainer.fit_loop._data_source",),
    "last_saved_step": ("model_checkpoint._last_global_step_saved",),
    "set_last_saved_step": ("model_checkpoint._last_global_step_saved",),
    "checkpoint_triggers": ("model_checkpoint._train_time_interval", "model_checkpoint._every_n_epochs"),
    "checkpoint_every_n_train_steps": ("model_checkpoint._every_n_train_steps",),
    "cluster_environment": ("trainer._accelerator_connector.cluster_environment",),
    "hpc_checkpoint_path": ("trainer._checkpoint_connector._hpc_resume_path",),
    "collect_rng_states": ("lightning.fabric.utilities.seed._collect_rng_states",),
    "set_rng_states": ("lightning.fabric.utilities.seed._set_rng_states",),
    "block_ddp_gradient_sync": ("lightning.pytorch.loops.utilities._block_parallel_sync_behavior",),
    "request_val_dataloaders": (
        "trainer.fit_loop.epoch_loop.val_loop._data_source",
        "lightning.pytorch.trainer.connectors.data_connector._request_dataloader",
    ),
    "prepare_val_dataloader": ("lightning.pytorch.trainer.connectors.data_connector._process_dataloader",),
    "metric_update_count": ("metric._update_count",),
    "set_metric_update_count": ("metric._update_count", "metric._computed"),
    "inner_schedulers": ("sequential_lr._schedulers",),
    "scale_last_lr": ("lr_scheduler._last_lr",),
    "checkpoint_wrapper": ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper",),
    "tree_map": ("torch.utils._pytree.tree_map",),
    "tree_leaves": ("torch.utils._pytree.tree_leaves",),
    "foreach_sub_": ("torch._foreach_sub_",),
    "foreach_copy_": ("torch._foreach_copy_",),
    "foreach_norm": ("torch._foreach_norm",),
    "hydra_command_line": ("hydra._internal.utils.get_args_parser",),
}

__all__ = [*PRIVATE_ATTRIBUTES, "PRIVATE_ATTRIBUTES"]

foreach_sub_ = torch._foreach_sub_
foreach_copy_ = torch._foreach_copy_
foreach_norm = torch._foreach_norm


def should_accumulate(trainer: pl.Trainer) -> bool:
    """True while the current micro-batch is not the last of its optimizer step."""
    return trainer.fit_loop.epoch_loop._should_accumulate()


def logging_step(trainer: pl.Trainer) -> int:
    """The logger row ``self.log`` writes to now; in a stepping micro-batch's hooks, the step just taken (from 0)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def logs_this_step(trainer: pl.Trainer) -> bool:
    """Whether Lightning writes logs at this step (``log_every_n_steps``)."""
    return trainer._logger_connector.should_update_logs


def set_train_epoch_length(trainer: pl.Trainer, micro_batches: int) -> None:
    """Tell the fit loop, which reads the length once per epoch into three places, that this epoch has
    ``micro_batches`` micro-batches after all."""
    trainer.fit_loop.max_batches = micro_batches
    combined_loader = trainer.fit_loop._combined_loader
    if combined_loader is not None and combined_loader.limits is not None:
        # The running iterator shares the list.
        combined_loader.limits[:] = [micro_batches] * len(combined_loader.limits)
    fetcher = trainer.fit_loop._data_fetcher
    if fetcher is not None and fetcher.length is not None:
        fetcher.length = micro_batches
        if fetcher.fetched >= micro_batches > 0:  # the micro-batch just fetched is the epoch's last after all
            fetcher.done = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = True


def set_validation_due(trainer: pl.Trainer, due: bool) -> None:
    """Make the fit loop validate after this micro-batch, or not (through ``val_check_batch``)."""
    loop = trainer.fit_loop.epoch_loop
    count = (loop.total_batch_idx if trainer.check_val_every_n_epoch is None else loop.batch_idx) + 1
    trainer.val_check_batch = count if due else count + 1


def shift_epoch_micro_batches(trainer: pl.Trainer, delta: int) -> None:
    """Add ``delta`` to the fit loop's micro-batch counts, so a step boundary falls where the accumulation says."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    fetcher = trainer.fit_loop._data_fetcher
    # Before the epoch loop starts (a resumed run's on_train_start) the fetcher's count is 0; the loop adds it then.
    if fetcher is not None and fetcher.fetched == progress.current.ready:
        fetcher.fetched += delta
    progress.increment_by(delta, is_last_batch=progress.is_last_batch)


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


def prepare_val_dataloader(trainer: pl.Trainer, dataloader: Any) -> Any:
    """``dataloader`` as Lightning's validation reads it during fit (under DDP, with a DistributedSampler)."""
    from lightning.pytorch.trainer.connectors.data_connector import _process_dataloader
    from lightning.pytorch.trainer.states import RunningStage, TrainerFn

    return _process_dataloader(trainer, TrainerFn.FITTING, RunningStage.VALIDATING, dataloader)


def block_ddp_gradient_sync(strategy: Strategy, block: bool) -> AbstractContextManager[Any]:
    """Context in which DDP's backward does not all-reduce gradients (``block=True``); a no-op elsewhere."""
    from lightning.pytorch.loops.utilities import _block_parallel_sync_behavior

    return _block_parallel_sync_behavior(strategy, block=block)


def last_saved_step(checkpoint: ModelCheckpoint) -> int:
    """The optimizer step a ``ModelCheckpoint`` last saved at (0: none yet)."""
    return checkpoint._last_global_step_saved


def set_last_saved_step(checkpoint: ModelCheckpoint, step: int) -> None:
    """Tell a ``ModelCheckpoint`` that ``step`` is saved."""
    checkpoint._last_global_step_saved = step


def checkpoint_triggers(checkpoint: ModelCheckpoint) -> tuple[Any, int]:
    """A ``ModelCheckpoint``'s resolved ``train_time_interval`` (None if unset) and ``every_n_epochs``."""
    return checkpoint._train_time_interval, checkpoint._every_n_epochs


def checkpoint_every_n_train_steps(checkpoint: ModelCheckpoint) -> int:
    """A ``ModelCheckpoint``'s resolved ``every_n_train_steps`` (0: not by steps)."""
    return checkpoint._every_n_train_steps


def cluster_environment(trainer: pl.Trainer) -> Any:
    """The cluster environment Lightning detected (``SLURMEnvironment`` on a SLURM job, ...)."""
    return trainer._accelerator_connector.cluster_environment


def hpc_checkpoint_path(trainer: pl.Trainer) -> str | None:
    """The newest ``hpc_ckpt_<n>.ckpt`` in the default root dir (saved on SLURM's requeue signal), or None."""
    return trainer._checkpoint_connector._hpc_resume_path


def collect_rng_states(include_cuda: bool) -> dict[str, Any]:
    """The torch, numpy and Python RNG states (and CUDA's), as Lightning checkpoints them."""
    from lightning.fabric.utilities.seed import _collect_rng_states

    return _collect_rng_states(include_cuda=include_cuda)


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore RNG states taken by ``collect_rng_states``."""
    from lightning.fabric.utilities.seed import _set_rng_states

    _set_rng_states(states)


def metric_update_count(metric: Metric) -> int:
    """How many times a torchmetrics ``Metric`` was updated since its last reset."""
    return metric._update_count


def set_metric_update_count(metric: Metric, count: int) -> None:
    """Set a ``Metric``'s update count after its states were restored, and drop its cached result."""
    metric._update_count = count
    metric._computed = None


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
