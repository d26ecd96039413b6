"""The in-process runner, and what every runner shares: the search over k (``measure_window``), the held-out batches."""

from __future__ import annotations

import math
from collections.abc import Callable
from itertools import islice
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.trainer.connectors.data_connector import _process_dataloader
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.combined_loader import CombinedLoader
from lightning_utilities.core.apply_func import apply_to_collection

from lit_cbs._internals import collect_rng_states, request_val_dataloaders, set_rng_states
from lit_cbs.callbacks.accounting import BatchAccounting
from lit_cbs.callbacks.checkpoint import set_probe_window, stop_signal
from lit_cbs.callbacks.module_state import logging_muted
from lit_cbs.errors import LitCBSConfigError
from lit_cbs.probe.branch import BranchFailed, BranchTrainer, RecordedWindow, TrainingSnapshot
from lit_cbs.probe.engine import BranchOutcome, ProbeConfig, ProbePoint, Runner
from lit_cbs.probe.reading import BranchScore, measure_losses

__all__: list[str] = []  # the probe's own parts


def measure_window(
    config: ProbeConfig,
    window: RecordedWindow,
    branches: BranchTrainer,
    baseline: Callable[[], BranchScore | None] | None,
    trained: list[float],
    failed: list[float],
    final: bool,
    prefetch: bool = False,
) -> BranchOutcome:
    """The branches' outcome over the window so far, each k over every replicate window (k = 1's first from
    ``baseline()`` where it gives one); a failed window fails k. ``trained``/``failed`` gather over the looks;
    ``prefetch``: the ks the search measures whatever the losses but 1 first (a side job's k = 1 score may wait for
    the main run)."""
    measured: dict[float, BranchScore] = {}

    def one_window(k: float, replicate: int) -> BranchScore:
        main = baseline() if baseline is not None and k == 1.0 and replicate == 0 else None
        if main is not None:
            return main
        if replicate > 0 or k not in trained:
            trained.append(k)
        try:
            return branches.loss(window, k, keep=not final, replicate=replicate)
        except BranchFailed as error:
            rank_zero_warn(f"CBS probe branch k={k:g} failed ({error}); counted as not recovered")
            failed.append(k)
            return BranchScore(math.inf)

    def score(k: float) -> BranchScore:
        if k not in measured:
            windows = []
            for replicate in range(window.point.replicates):
                if k in failed:
                    break
                windows.append(one_window(k, replicate))
            measured[k] = BranchScore(math.inf) if k in failed else BranchScore.replicated(windows)
        return measured[k]

    ks = sorted(window.point.multipliers)
    first = ks if config.search == "grid" or len(ks) < 2 else [ks[0], ks[len(ks) // 2]]  # bisection's first point
    for k in first if prefetch else []:
        if k != 1.0:
            score(k)
    scores = measure_losses(config.search, window.point.multipliers, score, config.epsilon)
    window_tokens = window.tokens_of(min(window.recorded_samples, window.samples_per_rank))
    return BranchOutcome(scores, list(trained), list(failed), branches.tokens_trained, window_tokens, final)


def load_heldout_batches(trainer: pl.Trainer, count: int, device: torch.device | str) -> list[Any]:
    """This rank's first ``count`` batches of the fit's first validation loader as Lightning reads them, every RNG
    state (and the loader's ``torch.Generator``s) kept."""
    states = collect_rng_states(include_cuda=torch.cuda.is_available())
    saved: list[tuple[torch.Generator, torch.Tensor]] = []
    try:
        loaders = trainer.val_dataloaders  # prepared by the validation loop; None while it is off
        prepared = loaders is not None
        loaders = loaders if prepared else request_val_dataloaders(trainer)
        if loaders is not None and not isinstance(loaders, CombinedLoader):
            loaders = CombinedLoader(loaders, "sequential")
        flattened = loaders.flattened if loaders is not None else []
        if not flattened:
            raise LitCBSConfigError(
                "CBSProbeCallback(evaluate='heldout') scores branches on validation data, but the Trainer has none: "
                "give the datamodule (or the LightningModule) a `val_dataloader()` or pass "
                "`trainer.fit(..., val_dataloaders=...)`; or use evaluate='train_ema'"
            )
        loader: Any = (
            flattened[0]
            if prepared
            else _process_dataloader(trainer, TrainerFn.FITTING, RunningStage.VALIDATING, flattened[0])
        )
        batch_sampler = getattr(loader, "batch_sampler", None)
        samplers = (loader, getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None))
        found = [getattr(sampler, "generator", None) for sampler in samplers]
        saved = [(g, g.get_state()) for g in {id(g): g for g in found if isinstance(g, torch.Generator)}.values()]
        batches = [
            move_data_to_device(apply_to_collection(batch, torch.Tensor, torch.Tensor.detach), device)
            for batch in islice(loader, count)
        ]
    finally:
        for generator, state in saved:
            generator.set_state(state)
        set_rng_states(states)
    if not trainer.strategy.reduce_boolean_decision(len(batches) > 0, all=True):
        raise LitCBSConfigError(
            "CBSProbeCallback(evaluate='heldout'): the first validation dataloader yielded no batch (on at least "
            "one rank); give it data, at least one batch per rank, or use evaluate='train_ema'"
        )
    return batches


class InProcessRunner(Runner):
    """Trains a point's branches where the main run's part (or a look) ends, one point at a time."""

    mode = "in_process"
    late = False

    def __init__(self, config: ProbeConfig):
        self.config = config
        self.window: RecordedWindow | None = None  # the open point's, with the micro-batches recorded so far
        self._branches: BranchTrainer | None = None
        self._trained: list[float] = []
        self._failed: list[float] = []
        self._outcomes: list[tuple[ProbePoint, BranchOutcome | str]] = []

    def attach(
        self, trainer: pl.Trainer, accounting: BatchAccounting, branch_trainer: Callable[[int], BranchTrainer]
    ) -> None:
        """At setup: the run it trains in, and the maker of a point's ``BranchTrainer`` at its batch."""
        self.trainer, self.pl_module, self.accounting = trainer, trainer.lightning_module, accounting
        self.branch_trainer = branch_trainer

    def start(self, point: ProbePoint) -> None:
        trainer, accounting = self.trainer, self.accounting
        with accounting.branching():  # the copy is probe work, not the main run's time
            start = TrainingSnapshot(trainer, self.pl_module, self.config.snapshot_device)
        ranks = accounting.data_parallel_size
        looks = [(look - point.window_end_samples + point.window_samples) // ranks for look in point.looks]
        self.window = RecordedWindow(point, ranks, start, early_stop_samples=looks)
        self._branches, self._trained, self._failed = self.branch_trainer(point.batch_size), [], []
        set_probe_window(trainer, trainer.global_step)

    def record_batch(self, batch: Any) -> None:
        if self.window is not None:
            self.window.record_batch(batch, self.config.snapshot_device)

    def step(self, point: ProbePoint, samples_seen: int) -> None:
        """Where the part or a look ends, train and score the branches, then restore the main run."""
        window, branches = self.window, self._branches
        assert window is not None and branches is not None, "a point is open"
        final = window.recorded_samples >= window.samples_per_rank * point.replicates
        if not (final or window.recorded_samples in window.early_stop_samples):
            return
        trainer, pl_module, accounting = self.trainer, self.pl_module, self.accounting
        with accounting.branching():  # probe work: not the main run's time or gradients
            after_window = TrainingSnapshot(trainer, pl_module, self.config.snapshot_device)
            try:
                with logging_muted(pl_module):
                    outcome = measure_window(
                        self.config, window, branches, point.baseline, self._trained, self._failed, final
                    )
            finally:
                after_window.restore(trainer, pl_module)
                accounting.gradient_sync.set(None)
        self._outcomes.append((point, outcome))

    def poll(self) -> list[tuple[ProbePoint, BranchOutcome | str]]:
        outcomes, self._outcomes = self._outcomes, []
        return outcomes

    def close(self, point: ProbePoint) -> None:
        self.window, self._branches = None, None
        if stop_signal(self.trainer) is None and not self.trainer.received_sigterm:
            set_probe_window(self.trainer, None)  # else the run stops: its last checkpoint keeps the start
