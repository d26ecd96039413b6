"""The CBS at a saved checkpoint: a probe's branches trained from it, on the data the run trains next.

A checkpoint holds everything a probe branch starts from (weights, optimizer and scheduler state, the batch
and LR factor ``BatchWarmup`` reached, the token count) and, with a ``GlobalOrderLoader``, where the run is in
its data: one position in a global sample order that does not depend on the number of ranks. So the window a
probe at that step trains on is the run's next ``window_tokens`` (the tokens the run trained, or would have
trained, after it), read again from the data instead of recorded as the run trains it.

``probe_checkpoint`` resumes a ``Trainer.fit`` from the checkpoint with a ``CheckpointProbe`` callback, which at
``on_train_start`` (everything restored, nothing trained) reads that window, trains the branches through the
same ``BranchTrainer`` as the in-process probe, scores them on the run's held-out batches, decides with the
same rule, error bars, replicates, search and early stop, and stops the fit before its first step. With the same
seed and thread count a reading of the checkpoint at step S equals the in-process probe's at the probe point
that starts at S. The same callback trains a side job's branches (``lit_cbs.probe.side_jobs``), where the main
run's own window may stand in for k = 1.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.data import extract_batch_size

from lit_cbs._internals import given_train_loader
from lit_cbs.callbacks.accounting import BatchAccounting, resizable_train_loader
from lit_cbs.callbacks.module_state import logging_muted
from lit_cbs.callbacks.warmup import BatchWarmup
from lit_cbs.data.loader import GlobalOrderLoader
from lit_cbs.errors import LitCBSConfigError, require_automatic_optimization
from lit_cbs.probe.branch import (
    BranchMeasurer,
    BranchTrainer,
    RecordedWindow,
    branch_micro_batch,
    no_baseline,
)
from lit_cbs.probe.config import ProbeConfig
from lit_cbs.probe.engine import BranchOutcome, ProbeEngine, ProbePoint
from lit_cbs.probe.heldout import load_heldout_batches
from lit_cbs.probe.limits import known
from lit_cbs.probe.reading import BranchScore, ProbeReading, first_measured
from lit_cbs.probe.snapshot import TrainingSnapshot
from lit_cbs.probe.start import ProbePlan, ProbeSkip, plan_probe

__all__ = ["CheckpointProbe", "RunParts", "probe_checkpoint"]

MODE = "checkpoint"  # ProbeReading.mode of a reading taken from a saved checkpoint
NO_DATA_POSITION = (
    "a CBS probe of a checkpoint reads the run's next window of data from the checkpoint's data position, which only "
    "a lit_cbs.GlobalOrderLoader train loader keeps: give the datamodule one"
)


@dataclass
class RunParts:
    """What a probe of a saved checkpoint rebuilds the run from.

    Args:
        model: the run's LightningModule, freshly built (its weights come from the checkpoint).
        datamodule: the run's datamodule: its train loader must be a ``GlobalOrderLoader`` (the window is read
            at the checkpoint's data position); its validation data gives the held-out batches.
        trainer: ``lightning.Trainer`` keyword arguments as the run had them (``precision``, ``strategy``,
            ``gradient_clip_val``, ``accelerator``, ``devices``, ...): branches train as the run trains.
        callbacks: the run's ``BatchWarmup`` (or ``BatchAccounting``), as it was made for the run: branches
            take its micro-batch rule and optimizer rules; its state comes from the checkpoint.

    Examples:
        >>> import lightning.pytorch as pl
        >>> parts = RunParts(pl.LightningModule(), trainer={"precision": "bf16-mixed", "gradient_clip_val": 1.0})
        >>> parts.datamodule, parts.trainer["precision"], parts.callbacks
        (None, 'bf16-mixed', [])
    """

    model: pl.LightningModule
    datamodule: pl.LightningDataModule | None = None
    trainer: dict[str, Any] = field(default_factory=dict)
    callbacks: list[Callback] = field(default_factory=list)


class CheckpointProbe(Callback):
    """Trains a probe's branches at the start of a fit resumed from a checkpoint, then stops the fit before its
    first step (``probe_checkpoint`` and the side jobs of ``CBSProbeCallback`` use it).

    Args:
        config: the probe's settings.
        plan: the window as the run planned it (a side job: the multipliers and window the main run chose at
            its probe point); None: planned here at the checkpoint's batch (``plan_probe``).
        baseline: the main run's own score over the first window, which stands in for k = 1 there (a side
            job's); returns None where k = 1 trains as a branch.

    Attributes:
        reading: the reading, decided here (without ``plan``), else None.
        scores: each measured k's score; ``measurer``: what was trained and what failed.
        tokens_trained: branch tokens (global).
        seconds: wall seconds the probe took at the fit's start.

    Examples:
        >>> probe = CheckpointProbe(ProbeConfig(multipliers=[1, 2, 4], window_tokens=65_536))
        >>> probe.reading, probe.scores, probe.tokens_trained  # until a fit resumed from a checkpoint runs it
        (None, {}, 0)
    """

    def __init__(
        self,
        config: ProbeConfig,
        plan: ProbePlan | None = None,
        baseline: Callable[[], BranchScore | None] = no_baseline,
    ):
        self.config, self.plan, self.baseline = config, plan, baseline
        self.reading: ProbeReading | None = None
        self.scores: dict[float, BranchScore] = {}
        self.measurer: BranchMeasurer | None = None
        self.tokens_trained = 0
        self.seconds = 0.0
        self._outcomes: list[tuple[ProbePoint, BranchOutcome | str]] = []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Before the checkpoint's loader state is put into the train loader, which Lightning refuses (with a
        message about its own internals) for a loader that keeps no position.

        Raises:
            LitCBSConfigError: the train loader is not a ``GlobalOrderLoader``.
        """
        loader = given_train_loader(trainer)
        if loader is None:
            # trainer.datamodule is set by Lightning's data connector, undeclared on Trainer
            loader = (trainer.datamodule or pl_module).train_dataloader()  # type: ignore[attr-defined]
        if not isinstance(loader, GlobalOrderLoader):
            raise LitCBSConfigError(NO_DATA_POSITION)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        started = time.perf_counter()
        try:
            self._probe(trainer, pl_module)
        finally:
            trainer.should_stop = True  # no step of the main run: the fit ends here
            self.seconds = time.perf_counter() - started

    def _probe(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        require_automatic_optimization(pl_module, "a CBS probe of a checkpoint", "it trains branches through it")
        accounting = BatchAccounting.attach(trainer)
        callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector, undeclared
        warmup = next((callback for callback in callbacks if isinstance(callback, BatchWarmup)), None)
        loader = resizable_train_loader(trainer)
        seq_len, world = accounting.seq_len, accounting.data_parallel_size
        if seq_len is None:
            raise LitCBSConfigError(
                "a CBS probe of a checkpoint counts its window in tokens, but the checkpoint's run counted none: give "
                "seq_len=... to BatchWarmup or BatchAccounting (or the datamodule a `tokens_per_sample` attribute)"
            )
        batch = known(accounting.global_batch, "BatchAccounting.global_batch")  # from the checkpoint
        micro = known(accounting.micro_batch_size, "BatchAccounting.micro_batch_size")

        def micro_batch_for(k: float) -> int | None:
            return branch_micro_batch(k, batch, accounting, warmup)

        plan = self.plan or self._plan_here(accounting, micro_batch_for)
        heldout = None
        if self.config.evaluate == "heldout":
            heldout = load_heldout_batches(trainer, self.config.heldout_batches, self.config.snapshot_device)
        samples_per_rank = plan.window_samples // world
        batches = self._read_window(loader, micro, samples_per_rank * self.config.replicates)
        with accounting.branching():
            window = RecordedWindow(
                tokens=accounting.tokens_seen,
                step=trainer.global_step,
                batch_size=batch,
                accumulate=accounting.accumulate,
                micro_batch_size=micro,
                data_parallel_size=world,
                seq_len=seq_len,
                multipliers=plan.multipliers,
                window_samples=plan.window_samples,
                start=TrainingSnapshot(trainer, pl_module, self.config.snapshot_device),
                replicates=self.config.replicates,
                batches=batches,
                early_stop_samples=plan.early_stop_samples,
            )
            branches = BranchTrainer(
                trainer,
                pl_module,
                accounting,
                self.config.rules,
                self.config.evaluate,
                self.config.ema_alpha,
                micro_batch_for=micro_batch_for,
                heldout=heldout,
                cooldown_fraction=self.config.cooldown_fraction,
            )
            try:
                with logging_muted(pl_module):
                    self._measure(window, branches)
            finally:
                window.start.restore(trainer, pl_module)
                accounting.set_gradient_sync(None)
        self.tokens_trained = branches.tokens_trained

    def _plan_here(self, accounting: BatchAccounting, micro_batch_for: Callable[[float], int | None]) -> ProbePlan:
        plan = plan_probe(
            self.config,
            tokens=accounting.tokens_seen,
            batch_size=known(accounting.global_batch, "BatchAccounting.global_batch"),
            seq_len=known(accounting.seq_len, "BatchAccounting.seq_len"),
            data_parallel_size=accounting.data_parallel_size,
            branch_micro_batch=micro_batch_for,
        )
        if isinstance(plan, ProbeSkip):
            raise LitCBSConfigError(f"this checkpoint cannot be probed with these settings: {plan.reason}")
        return plan

    @staticmethod
    def _read_window(loader: Any, micro_batch_size: int, samples: int) -> list[Any]:
        """This rank's next ``samples`` samples in micro-batches of ``micro_batch_size`` (the main run's), from the
        loader's position on; an epoch's short last micro-batch makes one more read necessary."""
        count = -(-samples // micro_batch_size)
        while True:
            batches = loader.peek(count)
            if sum(extract_batch_size(batch) for batch in batches) >= samples:
                return batches
            count += 1

    def _measure(self, window: RecordedWindow, branches: BranchTrainer) -> None:
        """Train and score the branches; without a plan from a main run, the engine decides the reading here, at
        each early look first (the first determined reading ends the probe there)."""
        per_rank = window.samples_per_rank
        stops = [*window.early_stop_samples, per_rank] if self.plan is None else [per_rank]
        trained: list[float] = []
        failed: list[float] = []
        point = ProbePoint(
            index=0,
            tokens=window.tokens,
            step=window.step,
            batch_size=window.batch_size,
            seq_len=window.seq_len,
            multipliers=window.multipliers,
            window_samples=window.window_samples,
            folder="",
            main_baseline=False,
            window_end_samples=0,
            replicates=window.replicates,
        )
        engine = ProbeEngine(self.config, self)
        engine.points[0] = point
        for stop in stops:
            final = stop == per_rank
            window.recorded_samples = per_rank * window.replicates if final else stop
            train = functools.partial(branches.loss, window, keep=not final)
            self.measurer = BranchMeasurer(train, window.replicates, self.baseline, trained, failed)
            for k in first_measured(self.config.search, window.multipliers):
                if k != 1.0 or self.baseline is no_baseline:  # k = 1 may wait for the main run's window to end
                    self.measurer.score(k)
            self.scores = self.measurer.scores(self.config.search, window.multipliers, self.config.epsilon)
            if self.plan is not None:
                return
            window_tokens = window.tokens_of(min(window.recorded_samples, per_rank))
            self._outcomes.append(
                (
                    point,
                    BranchOutcome(
                        self.scores, list(trained), list(failed), branches.tokens_trained, window_tokens, final
                    ),
                )
            )
            engine.poll()
            if engine.history:
                self.reading = engine.history[0]
                return

    # The runner the engine asks: the outcomes come from ``_measure``, at the fit's start.
    mode = MODE
    late = False

    def start(self, point: ProbePoint) -> None:
        """Nothing: the branches train at the fit's start."""

    def step(self, point: ProbePoint, samples_seen: int) -> None:
        """Nothing: no main run trains."""

    def window_ended(self, point: ProbePoint) -> None:
        """Nothing: no main run trains."""

    def poll(self) -> list[tuple[ProbePoint, BranchOutcome | str]]:
        outcomes, self._outcomes = self._outcomes, []
        return outcomes

    def close(self, point: ProbePoint) -> None:
        """Nothing to clean up."""


def probe_checkpoint(
    ckpt_path: str | Path,
    parts: RunParts,
    config: ProbeConfig | None = None,
    *,
    output_dir: str | Path | None = None,
    **settings: Any,
) -> ProbeReading:
    """Measure the CBS at a saved checkpoint of a run, as the in-process probe measures it at that step.

    Args:
        ckpt_path: the checkpoint (a ``.ckpt`` file, or an FSDP2 distributed checkpoint's folder, loaded on the
            ranks of ``parts.trainer``, which need not be the run's).
        parts: the run rebuilt: its module, datamodule (with a ``GlobalOrderLoader``), Trainer settings and
            ``BatchWarmup`` (``RunParts``).
        config: the probe's settings (``ProbeConfig``); where to probe is the checkpoint's step, so its
            placement fields (``at_tokens``, ...) are not used. Or ``settings``: its fields as keywords.
        output_dir: a folder whose ``cbs_probe.jsonl`` the reading is appended to (None: only returned).

    Returns:
        The reading (``mode="checkpoint"``).

    Raises:
        LitCBSConfigError: the settings cannot probe this checkpoint (no ``GlobalOrderLoader``, no token
            count, fewer than two multipliers fit), or a setting is invalid, or both ``config`` and ``settings``.
        RuntimeError: the fit stopped before the probe could train (no reading).

    Examples:
        ``probe_checkpoint("run/checkpoints/step=608.ckpt", RunParts(MyModule(), MyData(), trainer={"precision":
        "bf16-mixed", "gradient_clip_val": 1.0}, callbacks=[BatchWarmup(...)]), multipliers=(1, 2, 4, 8),
        window_tokens=2_000_000, evaluate="heldout", search="bisect")``; a runnable one is in
        docs/guides/probe_jobs.md. What it refuses before it loads anything:

        >>> import lightning.pytorch as pl
        >>> probe_checkpoint("step=608.ckpt", RunParts(pl.LightningModule()), multipliers=[2, 4])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        lit_cbs.errors.LitCBSConfigError: multipliers=[2, 4] has no k = 1: ...
    """
    if config is not None and settings:
        raise LitCBSConfigError("probe_checkpoint: give a ProbeConfig or its fields as keywords, not both")
    config = config if config is not None else ProbeConfig(**settings)
    probe = CheckpointProbe(config)
    run_checkpoint_probe(ckpt_path, parts, probe)
    if probe.reading is None:
        raise RuntimeError("the checkpoint probe trained no branch (the fit stopped before its first hook)")
    if output_dir is not None and probe.reading is not None:
        append_reading(Path(output_dir), probe.reading)
    return probe.reading


def run_checkpoint_probe(ckpt_path: str | Path, parts: RunParts, probe: CheckpointProbe) -> pl.Trainer:
    """Fit ``parts`` from ``ckpt_path`` with ``probe`` among its callbacks: the probe trains at the fit's start and
    ends it; nothing is logged or checkpointed."""
    settings = {
        **parts.trainer,
        "enable_progress_bar": False,  # the probe trains no step of the run's: nothing to count
        "enable_model_summary": False,
        "callbacks": [*parts.callbacks, probe],
        "logger": False,
        "enable_checkpointing": False,
        "num_sanity_val_steps": 0,
        "max_epochs": -1,
        "max_steps": -1,
    }
    trainer = pl.Trainer(**settings)
    with warnings.catch_warnings():
        # The run's other callbacks (its probe, its checkpointing) are not needed to train branches.
        warnings.filterwarnings("ignore", message=".*callbacks used to create the checkpoint need to be provided")
        trainer.fit(parts.model, datamodule=parts.datamodule, ckpt_path=str(ckpt_path))
    return trainer


def append_reading(folder: Path, reading: ProbeReading) -> Path:
    """Append ``reading`` to ``folder``/cbs_probe.jsonl (created if missing); returns the file."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "cbs_probe.jsonl"
    with path.open("a") as out:
        out.write(json.dumps(dataclasses.asdict(reading)) + "\n")
    return path


def checkpoint_step(path: Path) -> int:
    """The optimizer step a checkpoint holds (its ``global_step``), read without loading its tensors (a
    distributed checkpoint's from Lightning's ``meta.pt`` in its folder)."""
    import torch

    source = path / "meta.pt" if path.is_dir() else path
    return int(torch.load(source, map_location="cpu", mmap=True, weights_only=False)["global_step"])


def checkpoints_in_order(folder: Path, steps: Callable[[Path], int]) -> list[Path]:
    """The complete checkpoints in ``folder`` (``*.ckpt`` files and distributed-checkpoint folders; ``last.ckpt``
    and Lightning's ``hpc_ckpt_*`` left out, as they repeat a step), by step (``steps(path)``)."""
    from lit_cbs.callbacks.checkpoint_files import checkpoint_candidates, unreadable

    found = [
        path
        for path in checkpoint_candidates([folder])
        if path.name != "last.ckpt" and not path.name.startswith("hpc_ckpt_") and unreadable(path) is None
    ]
    return sorted(found, key=steps)
