"""A tiny regression workload whose exact full-batch gradient is known in closed form.

Module-level classes so ddp_spawn can pickle them. Every sample carries its dataset index, so a
test sees which samples each optimizer step averaged over.
"""

from __future__ import annotations

import csv
import json
import math
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lit_cbs import BatchWarmup, CBSProbeCallback, ConstantBatch, token_mean_loss
from lit_cbs.callbacks.accounting import BatchAccounting
from lit_cbs.data.loader import GlobalOrderLoader, epoch_order
from lit_cbs.probe.reading import BranchScore, ProbeReading

DIM = 4


class IndexedRegression(Dataset):
    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, DIM, generator=g, dtype=torch.float64)
        w_true = torch.randn(DIM, 1, generator=g, dtype=torch.float64)
        self.y = self.x @ w_true + 0.5 * torch.randn(n, 1, generator=g, dtype=torch.float64)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return {"idx": i, "x": self.x[i], "y": self.y[i]}


def mean_gradient(dataset: IndexedRegression, indices, weight: torch.Tensor) -> torch.Tensor:
    """d/dW of mean_i (x_i W^T - y_i)^2 over ``indices``: the exact full-batch gradient."""
    idx = torch.as_tensor(list(indices))
    x, y = dataset.x[idx], dataset.y[idx]
    residual = x @ weight.T - y
    return 2.0 * (residual * x).mean(dim=0, keepdim=True)


class RegressionData(pl.LightningDataModule):
    """Shuffled by a seeded DistributedSampler (per-epoch order, sharded across ranks)."""

    def __init__(self, n: int = 96, batch_size: int = 2, seed: int = 0):
        super().__init__()
        self.dataset = IndexedRegression(n)
        self.batch_size = batch_size
        self.seed = seed

    def sampler(self):
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return DistributedSampler(self.dataset, shuffle=True, seed=self.seed, drop_last=True)
        return DistributedSampler(self.dataset, num_replicas=1, rank=0, shuffle=True, seed=self.seed)

    def train_dataloader(self):
        return DataLoader(self.dataset, batch_size=self.batch_size, sampler=self.sampler(), drop_last=True)

    def epoch_order(self, epoch: int) -> list[int]:
        sampler = DistributedSampler(self.dataset, num_replicas=1, rank=0, shuffle=True, seed=self.seed)
        sampler.set_epoch(epoch)
        return list(sampler)


class GlobalOrderRegressionData(RegressionData):
    """The same data through a ``GlobalOrderLoader``: one seeded order per epoch for any number of ranks,
    whose micro-batch can change between optimizer steps."""

    def train_dataloader(self):
        return GlobalOrderLoader(self.dataset, batch_size=self.batch_size, seed=self.seed)

    def epoch_order(self, epoch: int) -> list[int]:
        return epoch_order(len(self.dataset), self.seed, epoch, shuffle=True).tolist()


class RegressionModule(pl.LightningModule):
    """Linear regression with SGD; records, per optimizer step, the samples and the gradient."""

    def __init__(
        self, lr: float = 0.05, scheduler_factory=None, optimizer: str = "sgd", scheduler_interval: str = "step"
    ):
        super().__init__()
        self.layer = torch.nn.Linear(DIM, 1, bias=False, dtype=torch.float64)
        with torch.no_grad():  # the same start in every test, whatever the global RNG did before
            self.layer.weight.copy_(
                torch.randn(1, DIM, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
            )
        self.lr = lr
        self.scheduler_factory, self.scheduler_interval = scheduler_factory, scheduler_interval
        self.optimizer_name = optimizer
        self.pending: list[int] = []
        self.steps: list[dict] = []  # one per optimizer step
        self.micro_batches: list[list[int]] = []

    def on_train_batch_start(self, batch, batch_idx):
        # Recorded here, not in training_step, which CBS probe branches also call.
        indices = batch["idx"].tolist()
        self.pending.extend(indices)
        self.micro_batches.append(indices)

    def training_step(self, batch, batch_idx):
        prediction = self.layer(batch["x"])
        return torch.nn.functional.mse_loss(prediction, batch["y"])

    def on_before_optimizer_step(self, optimizer):
        accounting = next((c for c in self.trainer.callbacks if isinstance(c, BatchAccounting)), None)
        if accounting is not None and accounting.in_branch:
            return  # a CBS probe branch's step (it runs the module's hooks too), not the run's
        self.steps.append(
            {
                "indices": list(self.pending),
                "grad": self.layer.weight.grad.detach().clone(),
                "weight": self.layer.weight.detach().clone(),
                "lr": optimizer.param_groups[0]["lr"],
                "epoch": self.current_epoch,
            }
        )
        self.pending = []

    def configure_optimizers(self):
        if self.optimizer_name == "adam":
            optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        else:
            optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        if self.scheduler_factory is None:
            return optimizer
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": self.scheduler_factory(optimizer), "interval": self.scheduler_interval},
        }


class SummedRegressionModule(RegressionModule):
    """The toy with ``lit_cbs.token_mean_loss`` over its samples (one "token" each): every step's gradient
    is the mean over the samples the step holds, however they are split, a micro-batch of none included."""

    def training_step(self, batch, batch_idx):
        squared_errors = (self.layer(batch["x"]) - batch["y"]).square().sum()
        return token_mean_loss(self, squared_errors, len(batch["x"]))


class TwoOptimizers(RegressionModule):
    """The toy with two optimizers over its weight (SGD, Adam), which automatic optimization cannot step."""

    def configure_optimizers(self):
        return [torch.optim.SGD([self.layer.weight], lr=self.lr), torch.optim.Adam([self.layer.weight], lr=self.lr)]


def trainer_kwargs(**overrides):
    kwargs = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        max_epochs=1,
    )
    kwargs.update(overrides)
    return kwargs


def quiet_fit(trainer: pl.Trainer, *args, **kwargs) -> None:
    """``trainer.fit(*args, **kwargs)`` with warnings silenced: Lightning's notes on workers and logging
    intervals, which the toy workloads trigger by design."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(*args, **kwargs)


class PaddedSequences(Dataset):
    """Token sequences of ``seq_len + 1`` ids in [1, vocab), each padded with id 0 after a random
    length (from 2 tokens to full), so micro-batches hold different numbers of counted targets."""

    def __init__(self, n: int = 32, seq_len: int = 8, vocab: int = 32, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(1, vocab, (n, seq_len + 1), generator=g)
        lengths = torch.randint(2, seq_len + 2, (n,), generator=g)
        for row, length in zip(self.tokens, lengths):
            row[length:] = 0

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i]


class SaveFirstStepGradients(pl.Callback):
    """Saves the weights at the start and the gradients the first optimizer step takes (after
    BatchAccounting, first among the callbacks, rescaled them) to ``path`` on rank 0."""

    def __init__(self, path):
        self.path = path
        self.initial = None

    def on_train_start(self, trainer, pl_module):
        self.initial = {name: p.detach().clone() for name, p in pl_module.named_parameters()}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == 0 and trainer.global_rank == 0:
            grads = {name: p.grad.detach().clone() for name, p in pl_module.named_parameters() if p.grad is not None}
            torch.save({"initial": self.initial, "grads": grads}, self.path)


class PaddedData(pl.LightningDataModule):
    """``PaddedSequences`` in order; on ``ranks`` processes rank r reads samples r, r + ranks, ..."""

    def __init__(self, batch_size: int, n: int = 32):
        super().__init__()
        self.batch_size, self.n = batch_size, n

    def train_dataloader(self):
        dataset = PaddedSequences(self.n)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return DataLoader(dataset, batch_size=self.batch_size, sampler=DistributedSampler(dataset, shuffle=False))
        return DataLoader(dataset, batch_size=self.batch_size)


class RecordShardedModules(pl.Callback):
    """Writes to ``path`` (JSON, rank 0) when the fit starts (after sharding, before any forward pass,
    which leaves the modules FSDP2 does not reshard after forward unsharded): the paths of the LightningModule's
    modules that FSDP2 sharded, the class of each block of ``pl_module.model.blocks``, and the
    parameters that are not sharded DTensors. Added to a recipe run as ``+callbacks.<name>._target_``."""

    def __init__(self, path: str):
        self.path = path

    def on_fit_start(self, trainer, pl_module):
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        if trainer.global_rank == 0:
            record = {
                "sharded": [name for name, module in pl_module.named_modules() if isinstance(module, FSDPModule)],
                "block_classes": [type(block).__name__ for block in pl_module.model.blocks],
                "not_dtensors": [name for name, p in pl_module.named_parameters() if not isinstance(p, DTensor)],
            }
            Path(self.path).write_text(json.dumps(record))


def megatron_reference(consumed, start, increment, ramp, final):
    """Megatron-LM's RampupBatchsizeNumMicroBatches arithmetic, written out from Megatron-LM's
    num_microbatches_calculator."""
    if consumed > ramp:
        return final
    per_increment = ramp / ((final - start) // increment)
    return start + int(consumed / per_increment) * increment


# ---------------------------------------------------------------------------- CBS probe fits (tests/probe)
SEQ = 4  # the toy's "tokens per sample", given to BatchWarmup (its x is float, not token ids)


class RegressionDataWithVal(RegressionData):
    """The toy data with a validation loader (``val_batch_size`` samples a batch): the held-out batches
    of ``evaluate="heldout"``."""

    def __init__(self, n: int = 96, batch_size: int = 2, seed: int = 0, val_batch_size: int = 8):
        super().__init__(n, batch_size, seed)
        self.val_batch_size = val_batch_size

    def val_dataloader(self):
        return DataLoader(self.dataset, batch_size=self.val_batch_size)


def fit_quietly(trainer: pl.Trainer, module: pl.LightningModule, **data) -> pl.Trainer:
    """``trainer.fit`` without the toys' warnings (few workers, small epochs)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, **data)
    return trainer


def toy_probe(**kwargs):
    """A CBSProbeCallback every 160 tokens over k = 1, 2, 4 with 128-token windows, or as ``kwargs`` say."""
    defaults = dict(every_tokens=160, multipliers=(1, 2, 4), window_tokens=128, epsilon=0.01)
    defaults.update(kwargs)
    return CBSProbeCallback(**defaults)


def fit_regression(
    *, probe=None, schedule=None, epochs=2, n=96, micro=2, module=None, callbacks=(), max_tokens=None, ckpt=None, **fit
):
    """Fit the toy with global batch 4 (2 micro-batches of 2), or ``schedule``, under BatchWarmup;
    returns (trainer, module, warmup)."""
    pl.seed_everything(0, verbose=False)
    module = module or RegressionModule(lr=0.05, optimizer="adam")
    data = RegressionData(n=n, batch_size=micro)
    warmup = BatchWarmup(schedule or ConstantBatch(4), lr_rule="sqrt", seq_len=SEQ, max_tokens=max_tokens)
    cbs = [warmup] + ([probe] if probe is not None else []) + list(callbacks)
    trainer = pl.Trainer(callbacks=cbs, **trainer_kwargs(max_epochs=epochs, **fit))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, data, ckpt_path=ckpt)
    return trainer, module, warmup


def fit_regression_with_val(module=None, probe=None, callbacks=(), epochs=2, data=None, **trainer_overrides):
    """Fit the toy with global batch 4 under BatchWarmup (``warmup=`` to give another) on data with a
    validation loader, validation off; returns (trainer, module)."""
    pl.seed_everything(0, verbose=False)
    module = module or RegressionModule(lr=0.05, optimizer="adam")
    warmup = trainer_overrides.pop("warmup", None) or BatchWarmup(ConstantBatch(4), seq_len=SEQ)
    cbs = [warmup] + ([probe] if probe is not None else []) + list(callbacks)
    kwargs = trainer_kwargs(max_epochs=epochs, limit_val_batches=0)
    kwargs.update(trainer_overrides)
    trainer = pl.Trainer(callbacks=cbs, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, data or RegressionDataWithVal(n=96, batch_size=2))
    return trainer, module


def optimizer_state(trainer):
    opt = trainer.optimizers[0]
    return {k: v.clone() if torch.is_tensor(v) else v for state in opt.state.values() for k, v in state.items()}


def assert_same_main_run(a, b):
    """Two ``fit_regression`` results trained the same main run: weights, optimizer state, data order, LRs, steps."""
    (trainer_a, module_a, warmup_a), (trainer_b, module_b, warmup_b) = a, b
    assert torch.equal(module_a.layer.weight, module_b.layer.weight)
    state_a, state_b = optimizer_state(trainer_a), optimizer_state(trainer_b)
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        assert torch.equal(torch.as_tensor(state_a[key]), torch.as_tensor(state_b[key])), key
    assert module_a.micro_batches == module_b.micro_batches  # data order
    assert [s["lr"] for s in module_a.steps] == [s["lr"] for s in module_b.steps]
    assert [len(s["indices"]) for s in module_a.steps] == [len(s["indices"]) for s in module_b.steps]
    assert trainer_a.global_step == trainer_b.global_step
    assert warmup_a.accounting.tokens_seen == warmup_b.accounting.tokens_seen


def read_csv(path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def heldout_score(mean: float, spread: float, n: int = 16, seed: int = 0) -> BranchScore:
    """A BranchScore of per-batch held-out losses: a shared batch difficulty (paired across branches)
    plus branch noise."""
    g = torch.Generator().manual_seed(seed)
    difficulty = torch.linspace(-0.5, 0.5, n, dtype=torch.float64)
    noise = spread * torch.randn(n, generator=g, dtype=torch.float64)
    return BranchScore.heldout((mean + difficulty + noise - noise.mean()).tolist())


def probe_reading(tokens: float, lower: float, upper: float | None, batch_size: int = 16, **fields) -> ProbeReading:
    """A grid probe's reading at ``tokens`` with the CBS in [``lower``, ``upper``] samples (None: beyond the grid)
    at batch ``batch_size``, over k = 1, 2, 4, ... up to the upper end (128-token samples, 8,192-token windows, the
    losses all 3.0 nats); ``fields`` set any other field."""
    top = (upper if upper is not None else lower) / batch_size
    ks = [float(2**n) for n in range(int(math.log2(max(top, 1))) + 1)]
    reading = dict(
        tokens=tokens, step=0, batch_size=batch_size, seq_len=128, window_tokens=8192, search="grid",
        evaluate="train_ema", losses={f"{k:g}": 3.0 for k in ks}, main_loss=3.0, branches_trained=ks, failed=[],
        k_star=lower / batch_size, cbs_upper=upper, tokens_spent=8192 * len(ks),
        overhead=0.1, epsilon=0.01,
    )  # fmt: skip
    return ProbeReading(**{**reading, **fields})
