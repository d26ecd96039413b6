"""BatchWarmup under FSDP2 (Lightning's ModelParallelStrategy) on CPU, 2 processes over gloo.

Usage: ``python tests/scripts/fsdp_warmup.py OUTDIR``. Lightning relaunches this script for rank 1
(so it must run as a script, not inside pytest); after ``fit`` every rank saves what it recorded to
``OUTDIR/rank{rank}.pt`` for tests/callbacks/test_warmup_distributed.py to check.

The model is a linear regression factored into two bias-free float64 Linear layers, each sharded by
``fully_shard`` over the data-parallel mesh, so the exact mean gradient over any set of samples is
plain autograd on the gathered weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for toys.py

from toys import DIM, RegressionData, trainer_kwargs  # noqa: E402

from lit_cbs import BatchWarmup, PiecewiseBatch  # noqa: E402

HIDDEN = 8
SAMPLES = 96  # per epoch, both ranks together
MICRO_BATCH_SIZE = 2  # samples per rank
EPOCHS = 2
# Global batch 4 -> 8 -> 16 samples: accumulate 1 -> 2 -> 4 with micro-batch 2 on 2 ranks.
SCHEDULE = PiecewiseBatch([4, 8, 16], [0, 40, 120], unit="samples")
SEQ_LEN = 4  # tokens per sample, for the tokens_seen count


class FactoredRegression(pl.LightningModule):
    """x -> x W1^T W2^T, W1: HIDDEN x DIM, W2: 1 x HIDDEN, SGD on the mean squared error.

    Records per micro-batch whether its backward reduce-scattered gradients (a sharded ``.grad``
    exists only after a synced backward, since Lightning zeroes gradients to None) and per
    optimizer step the sample indices of this rank, the gathered gradients and weights, and the LR.
    """

    def __init__(self, lr: float = 0.05):
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(DIM, HIDDEN, bias=False, dtype=torch.float64),
            torch.nn.Linear(HIDDEN, 1, bias=False, dtype=torch.float64),
        )
        self.lr = lr
        self.pending: list[int] = []
        self.steps: list[dict] = []
        self.micro_batch_synced: list[bool] = []

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for layer in self.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.layers, mesh=mesh)

    def training_step(self, batch, batch_idx):
        self.pending.extend(batch["idx"].tolist())
        return torch.nn.functional.mse_loss(self.layers(batch["x"]), batch["y"])

    def on_after_backward(self):
        self.micro_batch_synced.append(all(p.grad is not None for p in self.parameters()))

    def on_before_optimizer_step(self, optimizer):
        self.steps.append(
            {
                "indices": list(self.pending),
                "grads": [p.grad.full_tensor().detach().clone() for p in self.parameters()],
                "weights": [p.full_tensor().detach().clone() for p in self.parameters()],
                "lr": optimizer.param_groups[0]["lr"],
            }
        )
        self.pending = []

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def main(outdir: Path) -> None:
    pl.seed_everything(0, verbose=False)  # same initial weights on both ranks before sharding
    module = FactoredRegression()
    warmup = BatchWarmup(SCHEDULE, lr_rule="linear", seq_len=SEQ_LEN)
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    trainer = pl.Trainer(
        callbacks=[warmup],
        **trainer_kwargs(devices=2, strategy=strategy, max_epochs=EPOCHS),
    )
    trainer.fit(module, RegressionData(n=SAMPLES, batch_size=MICRO_BATCH_SIZE))
    torch.save(
        {
            "steps": module.steps,
            "micro_batch_synced": module.micro_batch_synced,
            "history": warmup.state_dict()["history"],
            "samples_seen": warmup.accounting.samples_seen,
            "tokens_seen": warmup.accounting.tokens_seen,
            "global_step": trainer.global_step,
        },
        outdir / f"rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
