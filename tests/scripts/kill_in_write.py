"""A run that writes a checkpoint every step, SIGKILLed in the middle of one of its checkpoint writes, then resumed
from the newest complete checkpoint (tests/callbacks/test_checkpoint_files.py).

    python kill_in_write.py OUT                          # the uninterrupted run; OUT/writes.txt lists its writes
    python kill_in_write.py OUT --kill-at "WRITE" N      # SIGKILL every process of the run before the N-th WRITE
    python kill_in_write.py OUT --resume-newest          # resume from the newest complete checkpoint in OUT
    python kill_in_write.py OUT --fsdp ...               # FSDP2 on 2 processes: distributed checkpoints (folders)

A "write" is an operation on a path under OUT/checkpoints that Python's audit hooks announce before it happens
(opening a file for writing, a rename, a removal, a copy), listed as "EVENT PATH" (e.g. "os.rename last.ckpt",
"open .last.ckpt.partial/.metadata.tmp"), PATH relative to OUT/checkpoints: the kill lands between two of them, inside
Lightning's or torch.distributed.checkpoint's writing, or inside lit_cbs's move into place. The single-process
run trains a regression through BatchWarmup and a CBS probe (last.ckpt is replaced at the probe window's start);
the FSDP2 run trains tests/scripts/fsdp_warmup.py's factored regression. OUT/result.pt holds the final weights,
optimizer state, step and readings (rank 0).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for toys.py
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp_warmup import FactoredRegression  # noqa: E402
from toys import GlobalOrderRegressionData, RegressionModule, trainer_kwargs  # noqa: E402

from lit_cbs import BatchWarmup, CBSProbeCallback, PiecewiseBatch  # noqa: E402
from lit_cbs.callbacks.checkpoint import FinalStateCheckpoint, newest_complete  # noqa: E402


def written_path(event: str, args: tuple) -> str | None:
    """The path a write operation acts on, None for anything else (reads included)."""
    if event == "open":
        path, mode, flags = args
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
        )
        return str(path) if writing and isinstance(path, (str, bytes, os.PathLike)) else None
    if event in ("os.rename", "shutil.copyfile", "shutil.copytree"):  # os.replace too: named by what it writes
        return str(args[1])
    if event in ("os.remove", "shutil.rmtree") and args:
        return str(args[0])
    return None


def watch_writes(folder: Path, kill_at: tuple[str, int] | None, log: Path) -> None:
    """List the writes under ``folder`` in ``log``; SIGKILL every process of the run before the ``kill_at[1]``-th
    write ``kill_at[0]`` (the run is its own process group: the test starts it in a new session)."""
    seen: dict[str, int] = {}
    root = str(folder.resolve())

    def hook(event: str, args: tuple) -> None:
        path = written_path(event, args)
        if path is None or not os.path.abspath(path).startswith(root):
            return
        write = f"{event} {os.path.relpath(path, root)}"
        seen[write] = seen.get(write, 0) + 1
        with open(log, "a") as out:
            out.write(write + "\n")
        if kill_at is not None and (write, seen[write]) == kill_at:
            os.killpg(os.getpgid(0), signal.SIGKILL)

    sys.addaudithook(hook)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--kill-at", nargs=2, metavar=("WRITE", "N"))
    parser.add_argument("--resume-newest", action="store_true")
    parser.add_argument("--fsdp", action="store_true")
    args = parser.parse_args()
    checkpoints = args.out / "checkpoints"
    ckpt_path = newest_complete([checkpoints]) if args.resume_newest else None
    rank = int(os.environ.get("LOCAL_RANK", 0))
    if rank == 0:
        kill_at = (args.kill_at[0], int(args.kill_at[1])) if args.kill_at else None
        watch_writes(checkpoints, kill_at, args.out / "writes.txt")
    pl.seed_everything(0, verbose=False)
    checkpoint = FinalStateCheckpoint(
        dirpath=checkpoints, every_n_train_steps=1, save_top_k=-1, filename="{step}", save_last=True
    )
    if args.fsdp:
        module = FactoredRegression()
        schedule = PiecewiseBatch([4, 8], [0, 40], unit="samples")
        warmup, probe = BatchWarmup(schedule, lr_rule="sqrt", max_micro_batch_size=2), None
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        extra = {"devices": 2, "strategy": strategy, "max_steps": 10}
    else:
        module = RegressionModule(lr=0.05, optimizer="adam")
        warmup = BatchWarmup(
            PiecewiseBatch([4, 8], [0, 40], unit="samples"), lr_rule="sqrt", max_micro_batch_size=4, seq_len=4
        )
        probe = CBSProbeCallback(at_tokens=[48], multipliers=(1, 2), window_tokens=64)
        extra = {"max_steps": 14}
    callbacks = [warmup, checkpoint] + ([probe] if probe is not None else [])
    trainer = pl.Trainer(**trainer_kwargs(enable_checkpointing=True, callbacks=callbacks, max_epochs=-1, **extra))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=GlobalOrderRegressionData(n=48, batch_size=2), ckpt_path=ckpt_path)
    # Gathering a DTensor is a collective: every rank gathers, rank 0 saves.
    weights = {name: gathered(p) for name, p in module.named_parameters()}
    optimizer = [
        {key: gathered(value) for key, value in state.items()} for state in trainer.optimizers[0].state.values()
    ]
    if trainer.global_rank == 0:
        result = {
            "resumed_from": str(ckpt_path) if ckpt_path else None,
            "weights": weights,
            "optimizer": optimizer,
            "step": trainer.global_step,
            "readings": [(r.tokens, r.step, r.losses) for r in probe.history] if probe is not None else [],
        }
        torch.save(result, args.out / "result.pt")


def gathered(value):
    """A tensor's whole value (a DTensor's gathered from its shards), detached; anything else as it is."""
    if not isinstance(value, torch.Tensor):
        return value
    return (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()


if __name__ == "__main__":
    main()
