"""Every private Lightning, torch, torchmetrics and Hydra attribute lit_cbs uses, each behind one named function.

Lightning has no public API for some things a callback that changes the batch mid-run must know or
do (is this micro-batch the one that steps? which step does the logger's row belong to? rebuild the
train loader), and the CBS probe must snapshot and restore what a branch changes (RNG states,
metric update counts, ...). Keeping every such access here means a release that moves one breaks
this module alone; ``PRIVATE_ATTRIBUTES`` lists them, and tests/test_internals.py checks each
against the installed versions and names what moved.

Lightning is imported inside the functions that reach into it, so that the pure rules (which use
the torch attributes below) import this module without Lightning.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch

# Re-exported for the modules that use them (listed in PRIVATE_ATTRIBUTES).
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as checkpoint_wrapper
from torch.utils._pytree import tree_leaves as tree_leaves
from torch.utils._pytree import tree_map as tree_map

# What each function below reaches, as dotted paths from a module or from a live object (trainer.,
# model_checkpoint., metric., sequential_lr. or lr_scheduler.): tests/test_internals.py resolves every path.
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

# torch's fused multi-tensor kernels (what torch.optim's foreach implementations use).
foreach_sub_ = torch._foreach_sub_
foreach_copy_ = torch._foreach_copy_
foreach_norm = torch._foreach_norm


# ---------------------------------------------------------------------- Lightning's training loop
def should_accumulate(trainer) -> bool:
    """True while the current micro-batch is not the last of its optimizer step (Lightning will not step)."""
    return trainer.fit_loop.epoch_loop._should_accumulate()


def logging_step(trainer) -> int:
    """The logger step (row) that ``self.log`` writes to now; in the hooks of a micro-batch that stepped,
    the step just taken, numbered from 0."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def logs_this_step(trainer) -> bool:
    """Whether Lightning writes logs at this step (``log_every_n_steps``)."""
    return trainer._logger_connector.should_update_logs


def set_train_epoch_length(trainer, micro_batches: int) -> None:
    """Tell the fit loop that this epoch has ``micro_batches`` micro-batches after all (the train loader's
    micro-batch changed mid-epoch): Lightning steps on the last one and ends the epoch there. It reads
    the length once per epoch, from the loader, into three places, and tells the epoch's last
    micro-batch by the data fetcher's count of them against it."""
    trainer.fit_loop.max_batches = micro_batches
    combined_loader = trainer.fit_loop._combined_loader
    if combined_loader is not None and combined_loader.limits is not None:
        combined_loader.limits[:] = [micro_batches] * len(
            combined_loader.limits
        )  # the running iterator shares the list
    fetcher = trainer.fit_loop._data_fetcher
    if fetcher is not None and fetcher.length is not None:
        fetcher.length = micro_batches
        if fetcher.fetched >= micro_batches > 0:  # the micro-batch just fetched is the epoch's last after all
            fetcher.done = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = True


def set_validation_due(trainer, due: bool) -> None:
    """Make the fit loop validate after this micro-batch, or not: it validates when its count of
    micro-batches (this epoch's, or all of them with ``check_val_every_n_epoch=None``) is a multiple
    of ``trainer.val_check_batch``, which it reads after every micro-batch."""
    loop = trainer.fit_loop.epoch_loop
    count = (loop.total_batch_idx if trainer.check_val_every_n_epoch is None else loop.batch_idx) + 1
    trainer.val_check_batch = count if due else count + 1


def shift_epoch_micro_batches(trainer, delta: int) -> None:
    """Add ``delta`` to every count of micro-batches the fit loop keeps (this epoch's and the run's), so
    that a step boundary falls where the accumulation says: Lightning steps when the micro-batches of
    the epoch are a multiple of ``accumulate_grad_batches``."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    fetcher = trainer.fit_loop._data_fetcher
    # The data fetcher tells the epoch's last micro-batch by its count of them against the length.
    # Inside the epoch it counts what the progress counts; before the epoch loop starts (a resumed
    # run's on_train_start) it is 0, and the loop adds the progress's count to it then.
    if fetcher is not None and fetcher.fetched == progress.current.ready:
        fetcher.fetched += delta
    progress.increment_by(delta, is_last_batch=progress.is_last_batch)


def given_train_loader(trainer) -> Any:
    """The train loader passed as ``trainer.fit(train_dataloaders=...)``, or None (a datamodule's or the
    module's ``train_dataloader`` hook builds it)."""
    source = trainer.fit_loop._data_source.instance
    import lightning.pytorch as pl

    return None if isinstance(source, (pl.LightningModule, pl.LightningDataModule)) or source is None else source


def request_val_dataloaders(trainer) -> Any:
    """The validation loader(s) of the fit, from where Lightning's validation loop takes them (the
    datamodule's or module's ``val_dataloader``, or ``fit(val_dataloaders=...)``); None if there are none."""
    source = trainer.fit_loop.epoch_loop.val_loop._data_source
    from lightning.pytorch.trainer.connectors.data_connector import _request_dataloader

    return _request_dataloader(source) if source.is_defined() else None


def prepare_val_dataloader(trainer, dataloader) -> Any:
    """``dataloader`` as Lightning's validation reads it during fit (under DDP, with a DistributedSampler injected)."""
    from lightning.pytorch.trainer.connectors.data_connector import _process_dataloader
    from lightning.pytorch.trainer.states import RunningStage, TrainerFn

    return _process_dataloader(trainer, TrainerFn.FITTING, RunningStage.VALIDATING, dataloader)


def block_ddp_gradient_sync(strategy, block: bool) -> AbstractContextManager:
    """Context in which DDP's backward does not all-reduce gradients (``block=True``), as Lightning's
    own accumulation does; a no-op for other strategies."""
    from lightning.pytorch.loops.utilities import _block_parallel_sync_behavior

    return _block_parallel_sync_behavior(strategy, block=block)


def last_saved_step(checkpoint) -> int:
    """The optimizer step a ``ModelCheckpoint`` last saved at (0: none yet)."""
    return checkpoint._last_global_step_saved


def set_last_saved_step(checkpoint, step: int) -> None:
    """Tell a ``ModelCheckpoint`` that ``step`` is saved, so it does not save that step again."""
    checkpoint._last_global_step_saved = step


def checkpoint_triggers(checkpoint) -> tuple[Any, int]:
    """A ``ModelCheckpoint``'s ``train_time_interval`` (None if unset) and ``every_n_epochs`` as it
    resolved them (``every_n_epochs`` >= 1 saves after validation and at epoch ends)."""
    return checkpoint._train_time_interval, checkpoint._every_n_epochs


def checkpoint_every_n_train_steps(checkpoint) -> int:
    """A ``ModelCheckpoint``'s ``every_n_train_steps`` as it resolved it (0: it does not save by steps)."""
    return checkpoint._every_n_train_steps


def cluster_environment(trainer) -> Any:
    """The cluster environment Lightning detected (``SLURMEnvironment`` on a SLURM job, ...)."""
    return trainer._accelerator_connector.cluster_environment


def hpc_checkpoint_path(trainer) -> str | None:
    """The newest ``hpc_ckpt_<n>.ckpt`` in the default root dir (what Lightning saved on SLURM's requeue
    signal, and resumes from on a requeued SLURM job), or None."""
    return trainer._checkpoint_connector._hpc_resume_path


# ---------------------------------------------------------------------- RNG and metric state
def collect_rng_states(include_cuda: bool) -> dict[str, Any]:
    """The torch, numpy and Python RNG states (and CUDA's with ``include_cuda``), as Lightning checkpoints them."""
    from lightning.fabric.utilities.seed import _collect_rng_states

    return _collect_rng_states(include_cuda=include_cuda)


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore RNG states taken by ``collect_rng_states``."""
    from lightning.fabric.utilities.seed import _set_rng_states

    _set_rng_states(states)


def metric_update_count(metric) -> int:
    """How many times a torchmetrics ``Metric`` was updated since its last reset."""
    return metric._update_count


def set_metric_update_count(metric, count: int) -> None:
    """Set a ``Metric``'s update count after its states were restored, and drop its cached result."""
    metric._update_count = count
    metric._computed = None


# ---------------------------------------------------------------------- LR schedulers
def inner_schedulers(scheduler) -> list:
    """The schedulers a ``SequentialLR`` or ``ChainedScheduler`` runs."""
    return list(scheduler._schedulers)


def scale_last_lr(scheduler, factor: float) -> None:
    """Multiply the LRs a scheduler last set (``get_last_lr()``) by ``factor``, if it has set any."""
    if getattr(scheduler, "_last_lr", None) is not None:
        scheduler._last_lr = [lr * factor for lr in scheduler._last_lr]


# ---------------------------------------------------------------------- Hydra
def hydra_command_line(argv: list[str]) -> Any:
    """A Hydra app's command line as ``hydra.main`` reads it: ``overrides``, ``multirun``, ``config_name``, ...
    (an ``argparse.Namespace``; a command line it cannot read exits with its usage, as the app would)."""
    from hydra._internal.utils import get_args_parser

    return get_args_parser().parse_args(argv)
