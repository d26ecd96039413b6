"""The held-out batches a probe scores its branches on (``CBSProbeCallback(evaluate="heldout")``).

They are the first batches of the run's validation data, found where Lightning's own validation
finds it: the datamodule's ``val_dataloader``, ``trainer.fit(..., val_dataloaders=...)``, or the
LightningModule's ``val_dataloader``, prepared as Lightning prepares it (under DDP a
``DistributedSampler`` is injected, so each rank reads its own shard). Reading them leaves every
random stream of the run as it was: a DataLoader iterator draws its base seed from torch's global
generator (or the loader's own), which would otherwise shift the training shuffle.
"""

from __future__ import annotations

from itertools import islice
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import apply_to_collection, move_data_to_device
from lightning.pytorch.utilities.combined_loader import CombinedLoader

from lit_cbs._internals import collect_rng_states, prepare_val_dataloader, request_val_dataloaders, set_rng_states
from lit_cbs.errors import LitCBSConfigError

__all__ = ["load_heldout_batches"]


def load_heldout_batches(trainer: pl.Trainer, count: int, device: torch.device | str) -> list:
    """The first ``count`` batches (or all, if fewer) of the run's validation data, detached, on ``device``.

    The loader is the one Lightning's validation reads during ``fit``: the one it has already set up,
    else the one the datamodule's ``val_dataloader``, ``fit(val_dataloaders=...)`` or the module's
    ``val_dataloader`` returns (so it works with ``limit_val_batches=0`` or ``num_sanity_val_steps=0``
    too), with Lightning's distributed sampler injected under DDP (``use_distributed_sampler=True``):
    each rank reads the first ``count`` batches of its own shard. A loader that brings its own
    ``DistributedSampler`` is read as it is; with ``use_distributed_sampler=False`` a loader without
    one gives every rank the same batches. Of several validation loaders, the first is used. Batches
    are as the loader yields them (before the module's ``on_before_batch_transfer`` and
    ``on_after_batch_transfer`` hooks).

    The global torch (CPU and CUDA), numpy and Python RNG states, and the loader's own generators,
    are the same after the call as before. Call it inside ``fit`` (``on_train_start`` or later),
    on every rank: the empty-loader check is a collective decision.

    Args:
        trainer: the Trainer inside its ``fit``.
        count: batches wanted (per rank), ``ProbeConfig.heldout_batches``.
        device: where the batches are kept (``ProbeConfig.snapshot_device``).

    Returns:
        This rank's first ``count`` validation batches (fewer if the loader has fewer), detached, on ``device``.

    Raises:
        LitCBSConfigError: the Trainer has no validation data, or its first loader yields no batch
            on some rank (raised on every rank alike).

    Examples:
        The validation loader of a one-step fit (validation itself off), read without moving torch's generator:

        >>> import lightning.pytorch as pl, torch
        >>> from torch.utils.data import DataLoader
        >>> from lit_cbs.callbacks import BatchAccounting
        >>> from lit_cbs.data import RandomTokenData
        >>> from lit_cbs.models import CausalLM
        >>> lm = CausalLM({"vocab_size": 32, "d_model": 16, "n_layers": 1, "n_heads": 2, "mlp_hidden": 32,
        ...                "context_length": 8, "tie_embeddings": True})
        >>> trainer = pl.Trainer(accelerator="cpu", max_steps=1, limit_val_batches=0, logger=False,
        ...     callbacks=[BatchAccounting(seq_len=8)], enable_progress_bar=False, enable_checkpointing=False,
        ...     enable_model_summary=False)
        >>> val = DataLoader(torch.arange(54).view(6, 9), batch_size=2)  # 3 batches of 2 samples
        >>> trainer.fit(lm, RandomTokenData(vocab_size=32, seq_len=8, batch_size=4, samples=8).train_dataloader(),
        ...             val_dataloaders=val)
        >>> state = torch.get_rng_state()
        >>> batches = load_heldout_batches(trainer, count=2, device="cpu")
        >>> len(batches), batches[0].shape, torch.equal(torch.get_rng_state(), state)
        (2, torch.Size([2, 9]), True)

        Without validation data it says what to give:

        >>> trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
        ...     enable_checkpointing=False, enable_model_summary=False)
        >>> trainer.fit(lm, RandomTokenData(vocab_size=32, seq_len=8, batch_size=4, samples=8))
        >>> load_heldout_batches(trainer, count=2, device="cpu")
        Traceback (most recent call last):
        ...
        lit_cbs.errors.LitCBSConfigError: CBSProbeCallback(evaluate='heldout') scores branches on validation data, ...
    """
    states = collect_rng_states(include_cuda=torch.cuda.is_available())
    try:
        loader = _first_validation_loader(trainer)
        batches = _read_untouched(loader, count, device)
    finally:
        set_rng_states(states)
    if not trainer.strategy.reduce_boolean_decision(len(batches) > 0, all=True):
        raise LitCBSConfigError(
            "CBSProbeCallback(evaluate='heldout'): the first validation dataloader yielded no batch (on at least "
            "one rank); give it data, at least one batch per rank, or use evaluate='train_ema'"
        )
    return batches


def _first_validation_loader(trainer: pl.Trainer) -> Any:
    """The first validation loader of the fit, as Lightning's validation loop reads it."""
    loaders = (
        trainer.val_dataloaders
    )  # prepared by the validation loop; None while it is off (limit_val_batches=0, ...)
    prepared = loaders is not None
    if not prepared:
        loaders = request_val_dataloaders(trainer)
    if loaders is None:
        flattened = []
    else:
        flattened = (
            loaders if isinstance(loaders, CombinedLoader) else CombinedLoader(loaders, "sequential")
        ).flattened
    if not flattened:
        raise LitCBSConfigError(
            "CBSProbeCallback(evaluate='heldout') scores branches on validation data, but the Trainer has none: "
            "give the datamodule (or the LightningModule) a `val_dataloader()` or pass "
            "`trainer.fit(..., val_dataloaders=...)`; or use evaluate='train_ema'"
        )
    return flattened[0] if prepared else prepare_val_dataloader(trainer, flattened[0])


def _read_untouched(loader: Any, count: int, device: torch.device | str) -> list:
    """The first ``count`` batches of ``loader`` on ``device``; the loader's and its sampler's own
    ``torch.Generator``s (which a shuffled or seeded loader advances) are put back afterwards."""
    generators = {id(g): g for g in _loader_generators(loader)}.values()
    saved = [(generator, generator.get_state()) for generator in generators]
    try:
        return [
            move_data_to_device(apply_to_collection(batch, torch.Tensor, torch.Tensor.detach), device)
            for batch in islice(loader, count)
        ]
    finally:
        for generator, state in saved:
            generator.set_state(state)


def _loader_generators(loader: Any) -> list[torch.Generator]:
    samplers = [
        loader,
        getattr(loader, "sampler", None),
        getattr(getattr(loader, "batch_sampler", None), "sampler", None),
    ]
    return [
        sampler.generator for sampler in samplers if isinstance(getattr(sampler, "generator", None), torch.Generator)
    ]
