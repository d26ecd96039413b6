"""A CBS probe of an FSDP2 distributed checkpoint on another number of processes (tests/probe/test_from_checkpoint.py).

    python fsdp_probe.py OUT train                 # 2 processes: an in-process probe, a checkpoint (folder) every step
    python fsdp_probe.py OUT side                  # 2 processes: the same probe's branches as a side job on 1 process
    python fsdp_probe.py OUT probe CKPT PROCESSES  # lit_cbs.probe.probe_checkpoint of CKPT on PROCESSES processes

Lightning relaunches the script for the other ranks. Rank 0 saves OUT/train.pt (the in-process readings), OUT/side.pt
(the side job's) or OUT/probe.pt (the checkpoint's reading).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for toys.py
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp_warmup import FactoredRegression  # noqa: E402
from toys import GlobalOrderRegressionData, trainer_kwargs  # noqa: E402

from lit_cbs import BatchWarmup, CBSProbeCallback, ConstantBatch, FinalStateCheckpoint  # noqa: E402
from lit_cbs.probe import LocalLauncher, RunParts, SideJobs, probe_checkpoint  # noqa: E402

# Global batch 8 (4 tokens a sample): a probe of k = 1, 2 from 64 tokens (after step 2) over 64 tokens of data.
SETTINGS = dict(multipliers=(1, 2), window_tokens=64, evaluate="train_ema", search="grid")


def parts(processes: int) -> RunParts:
    strategy = ModelParallelStrategy(data_parallel_size=processes, tensor_parallel_size=1)
    return RunParts(
        FactoredRegression(),
        GlobalOrderRegressionData(n=96, batch_size=2),
        trainer_kwargs(devices=processes, strategy=strategy),
        [BatchWarmup(ConstantBatch(8), lr_rule="linear", seq_len=4)],
    )


def main(out: Path, what: str, ckpt: str | None, processes: int) -> None:
    pl.seed_everything(0, verbose=False)
    run = parts(processes)
    if what in ("train", "side"):
        jobs = SideJobs(LocalLauncher(threads=1), build="fsdp_probe:parts", build_args={"processes": 1})
        probe = CBSProbeCallback(at_tokens=[64], **SETTINGS, side_jobs=jobs if what == "side" else None, output_dir=out)
        checkpoints = FinalStateCheckpoint(
            dirpath=out / "checkpoints", every_n_train_steps=1, save_top_k=-1, filename="{step}"
        )
        callbacks = [*run.callbacks, probe, checkpoints]
        trainer = pl.Trainer(**{**run.trainer, "callbacks": callbacks, "max_steps": 6, "enable_checkpointing": True})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(run.model, run.datamodule)
        result, rank = {"readings": probe.history}, trainer.global_rank
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reading = probe_checkpoint(ckpt, run, **SETTINGS)
        result, rank = {"reading": reading}, torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 0:
        torch.save(result, out / f"{what}.pt")


if __name__ == "__main__":
    arguments = sys.argv[1:]
    main(
        Path(arguments[0]),
        arguments[1],
        arguments[2] if len(arguments) > 2 else None,
        int(arguments[3]) if len(arguments) > 3 else 2,
    )
