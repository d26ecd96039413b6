"""The toy run of tests/probe/test_side_jobs.py as its side jobs rebuild it (``SideJobs(build="side_job_toys:parts")``,
with tests/ on the job's PYTHONPATH): the regression through a ``GlobalOrderLoader``, with held-out
batches, at global batch 4 (2 micro-batches of 2). ``SIDE_JOB_TOYS_FAIL="2,3"`` makes the builds of those numbers fail
(each build counts itself in ``SIDE_JOB_TOYS_COUNT``, a file: the main run's dry build is the first, then one per job),
with a message that names the build's number, or the same message each time with ``SIDE_JOB_TOYS_SAME=1``."""

from __future__ import annotations

import os
import time
from pathlib import Path

import lightning.pytorch as pl
from torch.utils.data import DataLoader
from toys import SEQ, GlobalOrderRegressionData, RegressionModule, trainer_kwargs

from lit_cbs import BatchWarmup, CBSAdaptive, CBSProbeCallback, ConstantBatch
from lit_cbs.probe import RunParts


class Data(GlobalOrderRegressionData):
    def val_dataloader(self):
        return DataLoader(self.dataset, batch_size=8)


def module() -> RegressionModule:
    return RegressionModule(lr=0.05, optimizer="adam")


def warmup() -> BatchWarmup:
    return BatchWarmup(ConstantBatch(4), lr_rule="sqrt", seq_len=SEQ)


def parts() -> RunParts:
    counter = os.environ.get("SIDE_JOB_TOYS_COUNT")
    if counter is not None:
        path = Path(counter)
        count = int(path.read_text()) + 1 if path.exists() else 1
        path.write_text(str(count))
        if str(count) in os.environ.get("SIDE_JOB_TOYS_FAIL", "").split(","):
            raise RuntimeError(
                "the build fails on purpose" if os.environ.get("SIDE_JOB_TOYS_SAME") else f"build {count} fails"
            )
    return RunParts(module(), Data(n=96, batch_size=2), trainer_kwargs(limit_val_batches=0), [warmup()])


def adaptive_warmup() -> BatchWarmup:
    """A CBSAdaptive run of the toy: batch 4, doubled to 8 by a determined reading of CBS >= 8, with the guard."""
    return BatchWarmup(CBSAdaptive(start=4, final=8), lr_rule="sqrt", seq_len=SEQ, guard=True)


def adaptive_parts() -> RunParts:
    """The CBSAdaptive toy run as a user's own build gives it to its side jobs: its BatchWarmup, no probe."""
    return RunParts(module(), Data(n=96, batch_size=2), trainer_kwargs(limit_val_batches=0), [adaptive_warmup()])


class WaitForSideJobs(pl.Callback):
    """After main-run optimizer step ``step``, waits until every side job the run's probe started has ended (up to
    ``timeout`` seconds): a reading then arrives at the next step, however slowly the jobs' processes started."""

    def __init__(self, step: int, timeout: float = 300.0):
        self.step, self.timeout = step, timeout

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.step or not trainer.is_global_zero:
            return
        probe = next(c for c in trainer.callbacks if isinstance(c, CBSProbeCallback))
        side = probe._side
        if side is None:  # in process: nothing to wait for
            return
        started = time.monotonic()
        while time.monotonic() - started < self.timeout:
            if all(
                point.handle is None or not side.settings.launcher.state(point.handle).running
                for point in side.pending.values()
            ):
                return
            time.sleep(0.2)
        raise TimeoutError(f"side jobs still running {self.timeout:g} s after step {self.step}")


class PauseAfter(pl.Callback):
    """Sleeps ``seconds`` after each main-run optimizer step in ``steps``: a side job's time limit then runs out
    before the run's next step, however fast its steps are."""

    def __init__(self, steps: list[int], seconds: float):
        self.steps, self.seconds = list(steps), seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step in self.steps:
            time.sleep(self.seconds)
