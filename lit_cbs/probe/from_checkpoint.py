"""The CBS at a saved checkpoint (``probe_checkpoint``), and a side job's branches: trained as a resumed fit starts."""

from __future__ import annotations

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
from lit_cbs.callbacks.accounting import BatchAccounting, resizable_train_loader, trainer_callbacks
from lit_cbs.callbacks.module_state import logging_muted
from lit_cbs.callbacks.warmup import BatchWarmup
from lit_cbs.data.loader import GlobalOrderLoader
from lit_cbs.errors import LitCBSConfigError, require_automatic_optimization
from lit_cbs.probe.branch import BranchTrainer, RecordedWindow, TrainingSnapshot, known
from lit_cbs.probe.engine import BranchOutcome, ProbeConfig, ProbePoint, point_reading
from lit_cbs.probe.in_process import measure_window
from lit_cbs.probe.plan import ProbePlan, ProbeRun, ProbeSkip, plan_probe
from lit_cbs.probe.reading import BranchScore, ProbeReading

__all__ = ["CheckpointProbe", "RunParts", "probe_checkpoint"]

MODE = "checkpoint"  # ProbeReading.mode of a reading taken from a saved checkpoint


@dataclass
class RunParts:
    """What a probe of a saved checkpoint rebuilds the run from.

    Args:
        model: the run's LightningModule, freshly built (its weights come from the checkpoint).
        datamodule: the run's, with a ``GlobalOrderLoader`` train loader; its validation data gives held-out batches.
        trainer: ``lightning.Trainer`` keyword arguments as the run had them (``precision``, ``strategy``, ...).
        callbacks: the run's ``BatchWarmup`` (or ``BatchAccounting``), as made for the run.
        lightning_checkpoint: False where the checkpoint is another loop's, which ``callbacks`` restore at the fit's
            start (``lit_cbs.litgpt``): the fit then starts from no Lightning checkpoint.

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
    lightning_checkpoint: bool = True


class CheckpointProbe(Callback):
    """Trains a probe's branches as a resumed fit starts, then stops it; ``plan``, ``baseline``: a side job's."""

    def __init__(
        self,
        config: ProbeConfig,
        plan: ProbePlan | None = None,
        baseline: Callable[[], BranchScore | None] | None = None,
    ):
        self.config, self.plan, self.baseline = config, plan, baseline
        self.reading: ProbeReading | None = None
        self.outcome: BranchOutcome | None = None  # the branches' (the last look's)
        self.seconds = 0.0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Refuse a train loader that keeps no data position (before Lightning refuses it in its own words)."""
        loader = given_train_loader(trainer)
        if loader is None:
            # trainer.datamodule is set by Lightning's data connector, undeclared on Trainer
            loader = (trainer.datamodule or pl_module).train_dataloader()  # type: ignore[attr-defined]
        if not isinstance(loader, GlobalOrderLoader):
            raise LitCBSConfigError(
                "a CBS probe of a checkpoint reads the run's next window of data from the checkpoint's data position, "
                "which only a lit_cbs.GlobalOrderLoader train loader keeps: give the datamodule one"
            )

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
        warmup = next((c for c in trainer_callbacks(trainer) if isinstance(c, BatchWarmup)), None)
        run, world = ProbeRun(self.config, accounting, warmup), accounting.data_parallel_size
        batch = run.global_batch()  # from the checkpoint
        plan = self.plan or plan_probe(run)
        if isinstance(plan, ProbeSkip):
            raise LitCBSConfigError(f"this checkpoint cannot be probed with these settings: {plan.reason}")
        heldout = run.heldout(trainer)
        loader, samples = resizable_train_loader(trainer), plan.window_samples // world * self.config.replicates
        assert loader is not None, "on_fit_start refused a loader without a data position"
        count = -(-samples // known(accounting.micro_batch_size, "BatchAccounting.micro_batch_size"))
        while sum(map(extract_batch_size, batches := loader.peek(count))) < samples:  # this rank's next samples
            count += 1
        point = run.point(0, plan, trainer.global_step, None, "")  # the window's start, as a main run's probe
        with accounting.branching():
            start = TrainingSnapshot(trainer, pl_module, self.config.snapshot_device)
            window = RecordedWindow(point, world, start, batches, early_stop_samples=plan.early_stop_samples)
            branches = run.branch_trainer(trainer, pl_module, batch, heldout)
            try:
                with logging_muted(pl_module):
                    self._measure(point, window, branches)
            finally:
                window.start.restore(trainer, pl_module)
                accounting.gradient_sync.set(None)

    def _measure(self, point: ProbePoint, window: RecordedWindow, branches: BranchTrainer) -> None:
        """Train and score the branches; without a plan decide the reading, at each early look first."""
        per_rank = window.samples_per_rank
        stops = [*window.early_stop_samples, per_rank] if self.plan is None else [per_rank]
        trained: list[float] = []
        failed: list[float] = []
        for stop in stops:
            final = stop == per_rank
            window.recorded_samples = per_rank * window.point.replicates if final else stop
            prefetch = self.baseline is not None  # k = 1 may wait for the main run's window to end
            outcome = measure_window(self.config, window, branches, self.baseline, trained, failed, final, prefetch)
            self.outcome = outcome
            if self.plan is not None:
                return
            reading = point_reading(self.config, point, outcome, [], MODE, None)
            if final or reading.determined:
                self.reading = reading
                return


def probe_checkpoint(
    ckpt_path: str | Path, parts: RunParts, *, output_dir: str | Path | None = None, **settings: Any
) -> ProbeReading:
    """The CBS at a saved checkpoint (a ``.ckpt`` file or an FSDP2 checkpoint's folder), measured as the in-process
    probe measures it at that step, on the ranks of ``parts.trainer``. ``settings``: ``CBSProbeCallback``'s keywords
    (where to probe is the checkpoint's step). ``output_dir``: the reading is appended to its ``cbs_probe.jsonl``.

    Examples:
        ``probe_checkpoint("run/checkpoints/step=608.ckpt", RunParts(MyModule(), MyData(), trainer={"precision":
        "bf16-mixed"}, callbacks=[BatchWarmup(...)]), multipliers=(1, 2, 4, 8), window_tokens=2_000_000,
        evaluate="heldout", search="bisect")`` (docs/guides/probe_jobs.md runs one). It refuses settings before
        it loads anything:

        >>> import lightning.pytorch as pl
        >>> probe_checkpoint("step=608.ckpt", RunParts(pl.LightningModule()), multipliers=[2, 4])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        lit_cbs.errors.LitCBSConfigError: multipliers=[2, 4] has no k = 1: ...
    """
    probe = CheckpointProbe(ProbeConfig(**settings))
    run_checkpoint_probe(ckpt_path, parts, probe)
    if probe.reading is None:
        raise RuntimeError("the checkpoint probe trained no branch (the fit stopped before its first hook)")
    if output_dir is not None:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        with (Path(output_dir) / "cbs_probe.jsonl").open("a") as out:
            out.write(json.dumps(probe.reading.to_record()) + "\n")
    return probe.reading


def run_checkpoint_probe(ckpt_path: str | Path, parts: RunParts, probe: CheckpointProbe) -> pl.Trainer:
    """Fit ``parts`` from ``ckpt_path`` with ``probe``, which trains at the fit's start and ends it."""
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
        resume = str(ckpt_path) if parts.lightning_checkpoint else None
        trainer.fit(parts.model, datamodule=parts.datamodule, ckpt_path=resume)
    return trainer


def _checkpoint_meta(path: Path) -> dict[str, Any]:
    """A checkpoint's contents read without its tensors (``meta.pt`` of a distributed one)."""
    import torch

    source = path / "meta.pt" if path.is_dir() else path
    return dict(torch.load(source, map_location="cpu", mmap=True, weights_only=False))


def checkpoint_step(path: Path) -> int:
    """The ``global_step`` a checkpoint holds, read without its tensors (from ``meta.pt`` in a distributed one)."""
    return int(_checkpoint_meta(path)["global_step"])


def checkpoint_tokens(path: Path) -> int | None:
    """The tokens (all ranks) a run had trained when it saved ``path`` (BatchAccounting's), or None."""
    states = _checkpoint_meta(path).get("callbacks", {})
    seen = [state["tokens_seen"] for state in states.values() if isinstance(state, dict) and "tokens_seen" in state]
    return int(seen[0]) if seen else None


def checkpoints_in_order(folder: Path, steps: Callable[[Path], int]) -> list[Path]:
    """The complete checkpoints in ``folder`` by step, less ``last.ckpt`` and ``hpc_ckpt_*``."""
    from lit_cbs.callbacks.checkpoint import checkpoint_candidates, unreadable

    found = [
        path
        for path in checkpoint_candidates([folder])
        if path.name != "last.ckpt" and not path.name.startswith("hpc_ckpt_") and unreadable(path) is None
    ]
    return sorted(found, key=steps)
