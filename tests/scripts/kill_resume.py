"""A map-style dataset through GlobalOrderLoader, BatchWarmup growing the micro-batch, a CBS probe and a
checkpoint every 3 steps (none inside the probe window); SIGKILL mid-epoch and resume from the last
checkpoint (tests/data/test_loader.py).

    python kill_resume.py OUT                  # the uninterrupted run
    python kill_resume.py OUT --kill-at N      # SIGKILL itself after its N-th micro-batch
    python kill_resume.py OUT --resume CKPT    # resume from CKPT

Writes OUT/result.pt: the final weights, the Adam state, the step, each step's sample ids, the readings.
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
from lightning.pytorch.callbacks import Callback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from toys import IndexedRegression, RegressionModule, trainer_kwargs  # noqa: E402

from lit_cbs import BatchWarmup, CBSProbeCallback, GlobalOrderLoader, PiecewiseBatch  # noqa: E402
from lit_cbs.callbacks.checkpoint import FinalStateCheckpoint  # noqa: E402


class Data(pl.LightningDataModule):
    """100 samples, read by index (a map-style dataset), in one seeded order per epoch."""

    def __init__(self):
        super().__init__()
        self.batch_size = 2

    def train_dataloader(self):
        return GlobalOrderLoader(IndexedRegression(100), batch_size=self.batch_size, seed=3)


class KillAt(Callback):
    def __init__(self, micro_batch: int):
        self.micro_batch, self.seen = micro_batch, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen += 1
        if self.seen == self.micro_batch:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--resume", type=Path)
    args = parser.parse_args()
    pl.seed_everything(0, verbose=False)
    warmup = BatchWarmup(
        PiecewiseBatch([4, 8, 16], [0, 40, 120], unit="samples"), lr_rule="sqrt", max_micro_batch_size=4, seq_len=4
    )
    probe = CBSProbeCallback(at_tokens=[200], multipliers=(1, 2), window_tokens=128)
    checkpoint = FinalStateCheckpoint(
        dirpath=args.out / "checkpoints", every_n_train_steps=3, save_top_k=-1, filename="{step}"
    )
    callbacks = [warmup, probe, checkpoint] + ([KillAt(args.kill_at)] if args.kill_at else [])
    trainer = pl.Trainer(**trainer_kwargs(max_epochs=2, enable_checkpointing=True, callbacks=callbacks))
    module = RegressionModule(lr=0.05, optimizer="adam")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=Data(), ckpt_path=args.resume)
    optimizer = trainer.optimizers[0]
    torch.save(
        {
            "weight": module.layer.weight.detach().clone(),
            "adam": [{k: v.clone() for k, v in state.items()} for state in optimizer.state.values()],
            "step": trainer.global_step,
            "steps": [step["indices"] for step in module.steps],
            "readings": [(r.tokens, r.step, r.losses) for r in probe.history],
        },
        args.out / "result.pt",
    )


if __name__ == "__main__":
    main()
