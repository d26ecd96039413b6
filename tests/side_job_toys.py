"""The toy run of tests/probe/test_side_jobs.py as its side jobs rebuild it (``SideJobs(build="side_job_toys:parts")``,
with tests/ on the job's PYTHONPATH): the regression through a ``GlobalOrderLoader``, with held-out
batches, at global batch 4 (2 micro-batches of 2). ``SIDE_JOB_TOYS_FAIL=N`` makes the first N jobs fail (each job
counts itself in ``SIDE_JOB_TOYS_COUNT``, a file), for the retry test."""

from __future__ import annotations

import os
from pathlib import Path

from torch.utils.data import DataLoader
from toys import SEQ, GlobalOrderRegressionData, RegressionModule, trainer_kwargs

from lit_cbs import BatchWarmup, ConstantBatch
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
        if count <= int(os.environ.get("SIDE_JOB_TOYS_FAIL", "0")):
            raise RuntimeError(f"side job {count} fails on purpose")
    return RunParts(module(), Data(n=96, batch_size=2), trainer_kwargs(limit_val_batches=0), [warmup()])
