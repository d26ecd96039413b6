"""Callbacks the SLURM tests give recipes/train.py (``+callbacks.NAME={_target_: cluster_callbacks.CLASS, ...}``,
with tests/ on PYTHONPATH): what each rank trained on, and markers that tell a test where a job is."""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning.pytorch as pl
from torch.utils.data import Dataset

from lit_cbs.callbacks.accounting import BatchAccounting, resizable_train_loader


class _Recording(Dataset):
    """The dataset the train loader reads, noting every sample index it is asked for."""

    def __init__(self, dataset: Dataset, seen: list[int]):
        self.dataset, self.seen = dataset, seen

    def __getitem__(self, index: int):
        self.seen.append(int(index))
        return self.dataset[index]

    def __len__(self) -> int:
        return len(self.dataset)


class RecordSamples(pl.Callback):
    """Writes ``folder/samples-<job>-<SLURM job id>-rank<r>.json``: the sample indices this rank's train loader read,
    by epoch."""

    def __init__(self, folder: str, job: str):
        self.folder, self.job = Path(folder), job
        self.seen: dict[int, list[int]] = {}

    def on_train_start(self, trainer, pl_module):  # a run resumed inside an epoch does not start the epoch again
        self.on_train_epoch_start(trainer, pl_module)

    def on_train_epoch_start(self, trainer, pl_module):
        loader = resizable_train_loader(trainer)
        seen = self.seen.setdefault(trainer.current_epoch, [])
        dataset = loader.dataset.dataset if isinstance(loader.dataset, _Recording) else loader.dataset
        loader.dataset = _Recording(dataset, seen)

    def on_train_end(self, trainer, pl_module):
        self.folder.mkdir(parents=True, exist_ok=True)
        job_id = os.environ.get("SLURM_JOB_ID", "local")
        path = self.folder / f"samples-{self.job}-{job_id}-rank{trainer.global_rank}.json"
        path.write_text(json.dumps({str(epoch): seen for epoch, seen in self.seen.items()}))


class Markers(pl.Callback):
    """After main-run step ``step`` of ``steps`` (the first time a job reaches it), writes ``folder/step<step>``; from
    the first marker on, each main-run step takes ``seconds`` longer, so a signal sent on seeing a marker lands a
    step or two after it."""

    def __init__(self, folder: str, steps: list[int], seconds: float = 0.5):
        self.folder, self.steps, self.seconds = Path(folder), list(steps), seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if BatchAccounting.attach(trainer).in_branch or not trainer.is_global_zero:
            return
        step = trainer.global_step
        if step in self.steps and not (self.folder / f"step{step}").exists():
            self.folder.mkdir(parents=True, exist_ok=True)
            (self.folder / f"step{step}").write_text(str(step))
        if any((self.folder / f"step{marked}").exists() for marked in self.steps):
            import time

            time.sleep(self.seconds)
