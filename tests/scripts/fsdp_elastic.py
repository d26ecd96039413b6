"""BatchWarmup under FSDP2 on CPU, checkpointed on some number of processes and resumed on another.

Usage: ``python tests/scripts/fsdp_elastic.py OUTDIR PROCESSES [CKPT]``. Lightning relaunches this
script for the other ranks. The run trains tests/scripts/fsdp_warmup.py's factored regression on a
``GlobalOrderLoader`` (the schedule of tests/callbacks/test_warmup_distributed.py's elastic test), writes a
distributed checkpoint (one folder, one shard per process) every 3 steps to OUTDIR/checkpoints, and
every rank saves the samples of its steps to OUTDIR/rank{rank}.pt. With CKPT it resumes from there:
the distributed checkpoint is resharded onto the processes of this run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for toys.py
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fsdp_warmup import FactoredRegression  # noqa: E402
from toys import GlobalOrderRegressionData, trainer_kwargs  # noqa: E402

from lit_cbs import BatchWarmup, PiecewiseBatch  # noqa: E402

SCHEDULE = PiecewiseBatch([4, 8, 16], [0, 40, 120], unit="samples")


def main(outdir: Path, processes: int, ckpt_path: str | None) -> None:
    pl.seed_everything(0, verbose=False)
    module = FactoredRegression()
    warmup = BatchWarmup(SCHEDULE, lr_rule="sqrt", max_micro_batch_size=4)
    checkpoint = ModelCheckpoint(
        dirpath=outdir / "checkpoints", every_n_train_steps=3, save_top_k=-1, filename="{step}"
    )
    strategy = ModelParallelStrategy(data_parallel_size=processes, tensor_parallel_size=1)
    trainer = pl.Trainer(
        callbacks=[warmup, checkpoint],
        **trainer_kwargs(devices=processes, strategy=strategy, max_epochs=2, enable_checkpointing=True),
    )
    trainer.fit(module, GlobalOrderRegressionData(n=96, batch_size=2), ckpt_path=ckpt_path)
    steps = [{"indices": step["indices"], "lr": step["lr"], "weights": step["weights"]} for step in module.steps]
    torch.save({"steps": steps, "history": warmup.state_dict()["history"]}, outdir / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None)
