"""CBSProbeCallback under DDP (Lightning's "ddp" strategy) on CPU, 2 processes over gloo, with a
fault forced on rank 1 only inside the probe's k = 4 branch.

Usage: ``python tests/scripts/probe_faults.py OUTDIR MODE`` with MODE "none" (no fault), "oom" (rank 1
runs out of memory) or "error" (rank 1 raises a ValueError). Lightning relaunches this script for
rank 1, so it must run as a script, not inside pytest. Every rank saves its probe readings and final
weights, or the exception it stopped with, to ``OUTDIR/rank{rank}.pt`` for
tests/probe/test_distributed.py to check.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for toys.py

from toys import RegressionData, RegressionModule, trainer_kwargs  # noqa: E402

from lit_cbs import BatchWarmup, CBSProbeCallback, ConstantBatch  # noqa: E402
from lit_cbs.callbacks.accounting import BatchAccounting  # noqa: E402

LR = 0.05


class FaultOnRank1(RegressionModule):
    """Raises on rank 1 in the k = 4 branch (LR x sqrt(4) = 2 LR under the "sqrt" rule)."""

    def __init__(self, mode: str):
        super().__init__(lr=LR, optimizer="adam")
        self.mode = mode

    def training_step(self, batch, batch_idx):
        in_k4_branch = (
            BatchAccounting.attach(self.trainer).in_branch and self.optimizers().param_groups[0]["lr"] > 1.9 * LR
        )
        if self.mode != "none" and in_k4_branch and self.global_rank == 1:
            if self.mode == "oom":
                raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes (forced)")
            raise ValueError("boom on rank 1 only")
        return super().training_step(batch, batch_idx)


class SaveRankResult(Callback):
    def __init__(self, outdir: Path):
        self.outdir = outdir

    def _save(self, trainer, result: dict) -> None:
        torch.save(result, self.outdir / f"rank{trainer.global_rank}.pt")

    def on_train_end(self, trainer, pl_module):
        probe = next(cb for cb in trainer.callbacks if isinstance(cb, CBSProbeCallback))
        self._save(trainer, {"history": probe.history, "weight": pl_module.layer.weight.detach().clone()})

    def on_exception(self, trainer, pl_module, exception):
        self._save(trainer, {"error": f"{type(exception).__name__}: {exception}"})


def main(outdir: Path, mode: str) -> None:
    outdir.mkdir(exist_ok=True)
    probe = CBSProbeCallback(every_tokens=256, multipliers=(1, 2, 4), window_tokens=128, search="grid")
    callbacks = [BatchWarmup(ConstantBatch(8), seq_len=4), probe, SaveRankResult(outdir)]
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        callbacks=callbacks, **trainer_kwargs(strategy="ddp", devices=2, max_epochs=2, default_root_dir=outdir)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(FaultOnRank1(mode), RegressionData(n=96, batch_size=2))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
