"""Running the module's own code off the record: what it changes besides tensors is put back, it logs nothing."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import lightning.pytorch as pl
import torch
from torchmetrics import Metric

from lit_cbs._internals import collect_rng_states, set_rng_states


class ModuleState:
    """What a step changes beside tensors: torchmetrics states, the RNG streams, the train/eval mode."""

    def __init__(self, pl_module: pl.LightningModule):
        self.metrics = [
            (metric, copy.deepcopy(metric.metric_state), metric._update_count)
            for metric in pl_module.modules()
            if isinstance(metric, Metric)
        ]
        self.rng = collect_rng_states(include_cuda=torch.cuda.is_available())
        self.training = pl_module.training

    def restore(self, pl_module: pl.LightningModule) -> None:
        set_rng_states(self.rng)
        for metric, state, update_count in self.metrics:
            for name, value in state.items():
                setattr(metric, name, copy.deepcopy(value))
            metric._update_count, metric._computed = update_count, None  # its cached result is stale
        pl_module.train(self.training)


@contextlib.contextmanager
def logging_muted(pl_module: pl.LightningModule) -> Iterator[None]:
    """Branches call the user's steps; their self.log calls must not reach the main run's logs."""
    if "log" in vars(pl_module):  # already muted by an enclosing block
        yield
        return
    # Instance attributes that shadow the methods until deleted below (mypy allows no assignment to a method).
    pl_module.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    pl_module.log_dict = lambda *args, **kwargs: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        del pl_module.log
        del pl_module.log_dict


@contextlib.contextmanager
def side_effects_undone(pl_module: pl.LightningModule) -> Iterator[None]:
    """Whatever runs inside leaves the ``ModuleState`` as it was and logs nothing."""
    saved = ModuleState(pl_module)
    try:
        with logging_muted(pl_module):
            yield
    finally:
        saved.restore(pl_module)
