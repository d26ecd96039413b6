"""The GradientNoiseScale tests' workload: a problem whose noise scale is known in closed form.

Linear regression with Gaussian inputs and Gaussian label noise, evaluated at FIXED weights
(SGD with lr=0): x ~ N(0, I_d), y = x . w* + s * eps with eps ~ N(0, 1), weights w = w* + delta.
The per-sample loss is l = (x . w - y)^2 = r^2 with residual r = x . delta - s * eps, and the
per-sample gradient is g = 2 r x. With Isserlis' theorem, E[x_a x_b x_j^2] = 1 + 2 [a = b = j]
for a = b, so per coordinate j:

    G_j          = E[g_j]   = 2 E[x_j x . delta] = 2 delta_j
    E[g_j^2]     = 4 E[r^2 x_j^2] = 4 (|delta|^2 + 2 delta_j^2 + s^2)
    Sigma_jj     = E[g_j^2] - G_j^2 = 4 (|delta|^2 + delta_j^2 + s^2)

so |G|^2 = 4 |delta|^2, tr(Sigma) = 4 ((d + 1) |delta|^2 + d s^2) and
B_simple = tr(Sigma) / |G|^2 = d + 1 + d s^2 / |delta|^2 (McCandlish et al. 2018). Summing
over a subset of coordinates gives the same quantities for one parameter group.

The datasets are finite (a few 10^4 samples), so the estimates carry sampling noise of about
2-4% (checked by simulating the estimator); the tests allow 10%. Exactness of what the callback
measures is checked separately, step by step, against closed-form micro-batch gradients.
"""

from __future__ import annotations

import csv
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from toys import trainer_kwargs

from lit_cbs import BatchWarmup, ConstantBatch
from lit_cbs.gns import GradientNoiseScale
from lit_cbs.models.lm import CausalLM

DIM = 4
NOISE_STD = 1.0
DELTA = (1.0, 0.5, -0.5, 0.5)  # w - w*; coordinates 0-1 are the "first" parameter group, 2-3 the "second"
GROUPS = {"first": [0, 1], "second": [2, 3]}
HALVES = {"first": r"^first\.", "second": r"^second\."}  # the same two groups, by parameter name
TOLERANCE = 0.10  # relative, the bound


def analytic_noise(coordinates) -> tuple[float, float]:
    """(|G|^2, tr(Sigma)) restricted to ``coordinates``, from the derivation in the module docstring."""
    delta_sq = sum(d * d for d in DELTA)
    grad_sq = sum(4 * DELTA[j] ** 2 for j in coordinates)
    trace_sigma = sum(4 * (delta_sq + DELTA[j] ** 2 + NOISE_STD**2) for j in coordinates)
    return grad_sq, trace_sigma


def analytic_b_simple(coordinates: tuple[int, ...] = tuple(range(DIM))) -> float:
    grad_sq, trace_sigma = analytic_noise(coordinates)
    return trace_sigma / grad_sq


class GaussianRegression(Dataset):
    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, DIM, generator=g, dtype=torch.float64)
        self.w_true = torch.randn(DIM, generator=g, dtype=torch.float64)
        self.y = (self.x @ self.w_true + NOISE_STD * torch.randn(n, generator=g, dtype=torch.float64))[:, None]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return {"idx": i, "x": self.x[i], "y": self.y[i]}

    def micro_batch_gradient(self, indices: list[int], weight: torch.Tensor) -> torch.Tensor:
        """Gradient of the mean squared error over ``indices`` at ``weight`` (shape [DIM])."""
        x, y = self.x[indices], self.y[indices, 0]
        return 2 * ((x @ weight - y)[:, None] * x).mean(0)


class GaussianRegressionData(pl.LightningDataModule):
    """Micro-batches of ``batch_size`` samples, shuffled by a seeded DistributedSampler (sharded under DDP)."""

    def __init__(self, n: int, batch_size: int, seed: int = 0):
        super().__init__()
        self.dataset = GaussianRegression(n, seed)
        self.batch_size = batch_size
        self.seed = seed

    def train_dataloader(self):
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            sampler = DistributedSampler(self.dataset, shuffle=True, seed=self.seed, drop_last=True)
        else:
            sampler = DistributedSampler(self.dataset, num_replicas=1, rank=0, shuffle=True, seed=self.seed)
        return DataLoader(self.dataset, batch_size=self.batch_size, sampler=sampler)


class FixedRegression(pl.LightningModule):
    """y ~ x[:, :2] . first + x[:, 2:] . second at w* + DELTA, never updated (SGD, lr=0)."""

    def __init__(self, w_true: torch.Tensor, two_groups: bool = False):
        super().__init__()
        self.first = torch.nn.Linear(2, 1, bias=False, dtype=torch.float64)
        self.second = torch.nn.Linear(2, 1, bias=False, dtype=torch.float64)
        weight = w_true + torch.tensor(DELTA, dtype=torch.float64)
        with torch.no_grad():
            self.first.weight.copy_(weight[:2])
            self.second.weight.copy_(weight[2:])
        self.two_groups = two_groups
        self.micro_batches: list[list[int]] = []  # sample indices of each micro-batch since the last optimizer step

    @property
    def weight(self) -> torch.Tensor:
        return torch.cat([self.first.weight[0], self.second.weight[0]]).detach()

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self.first(x[:, :2]) + self.second(x[:, 2:])

    def training_step(self, batch, batch_idx):
        self.micro_batches.append(batch["idx"].tolist())
        return squared_error(self, batch)

    def configure_optimizers(self):
        if self.two_groups:
            groups = [
                {"params": self.first.parameters(), "name": "first"},
                {"params": self.second.parameters(), "name": "second"},
            ]
            return torch.optim.SGD(groups, lr=0.0)
        return torch.optim.SGD(self.parameters(), lr=0.0)


def squared_error(module: FixedRegression, batch) -> torch.Tensor:
    """The training loss: mean over the batch's samples (also GradientNoiseScale's per_example_loss)."""
    return torch.nn.functional.mse_loss(module.predict(batch["x"]), batch["y"])


class RecordSteps(Callback):
    """After GradientNoiseScale: per optimizer step, its measurement and the micro-batches it saw.

    With ``outdir`` each rank also saves its records: the ranks run in child processes, which return no callback
    state.
    """

    def __init__(self, outdir: Path | None = None):
        self.outdir = outdir
        self.steps: list[dict] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        gns = next(cb for cb in trainer.callbacks if isinstance(cb, GradientNoiseScale))
        m = gns.last_measurement
        measured = m is not None and gns.num_updates > (self.steps[-1]["num_updates"] if self.steps else 0)
        self.steps.append(
            {
                "micro_batches": pl_module.micro_batches,
                "num_updates": gns.num_updates,
                "measurement": None
                if not measured
                else {k: v.tolist() if torch.is_tensor(v) else v for k, v in vars(m).items()},
            }
        )
        pl_module.micro_batches = []

    def on_train_end(self, trainer, pl_module):
        if self.outdir is not None:
            gns = next(cb for cb in trainer.callbacks if isinstance(cb, GradientNoiseScale))
            records = {
                "steps": self.steps,
                "b_simple": gns.b_simple,
                "state": gns.state_dict(),
                "weight": pl_module.weight,
            }
            torch.save(records, self.outdir / f"rank{trainer.global_rank}.pt")


def fit(n, micro, *, gns=None, callbacks=(), two_groups=False, ckpt_path=None, **trainer_overrides):
    pl.seed_everything(0, verbose=False)
    data = GaussianRegressionData(n, micro)
    module = FixedRegression(data.dataset.w_true, two_groups=two_groups)
    gns = gns or GradientNoiseScale(ema_decay=0.999)
    recorder = RecordSteps()
    trainer = pl.Trainer(callbacks=[*callbacks, gns, recorder], **trainer_kwargs(**trainer_overrides))
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return trainer, gns, recorder, data, module


def assert_exact_measurements(steps: list[dict], dataset: GaussianRegression, weight: torch.Tensor, groups=None):
    """Every measured step's small and big squared norms equal the closed-form micro-batch gradients."""
    groups = groups or [list(range(DIM))]
    measured = 0
    for step in steps:
        if step["measurement"] is None:
            continue
        measured += 1
        grads = torch.stack([dataset.micro_batch_gradient(indices, weight) for indices in step["micro_batches"]])
        sizes = torch.tensor([len(indices) for indices in step["micro_batches"]], dtype=torch.float64)
        small = [float((grads[:, g] ** 2).sum(1).mean()) for g in groups]
        big = [float((grads.mean(0)[g] ** 2).sum()) for g in groups]
        m = step["measurement"]
        assert m["small_grad_sq"] == pytest.approx(small, rel=1e-5)
        assert m["big_grad_sq"] == pytest.approx(big, rel=1e-5)
        assert m["small_batch_size"] == pytest.approx(float(len(sizes) / (1 / sizes).sum()), rel=1e-6)
        assert m["big_batch_size"] == pytest.approx(float(len(sizes) ** 2 / (1 / sizes).sum()), rel=1e-6)
    return measured


def logged_gns_rows(csv_path: Path) -> list[dict[str, float]]:
    """The CSVLogger rows that hold GradientNoiseScale's metrics, gns/* columns only."""
    with open(csv_path, newline="") as f:
        rows = [row for row in csv.DictReader(f) if row["gns/b_simple"]]
    return [{name: float(value) for name, value in row.items() if name.startswith("gns/")} for row in rows]


class RandomTokens(pl.LightningDataModule):
    """Random token sequences [samples, seq_len + 1] in micro-batches of ``batch_size`` (BatchWarmup reads it)."""

    def __init__(self, samples: int, seq_len: int, vocab_size: int, batch_size: int):
        super().__init__()
        self.tokens = torch.randint(0, vocab_size, (samples, seq_len + 1), generator=torch.Generator().manual_seed(0))
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(self.tokens, batch_size=self.batch_size)


def fit_tiny_olmo(
    tmp_path: Path, groups, tie_embeddings: bool = False, activation_checkpointing: bool = False, compile: bool = False
):
    """8 steps of 2 micro-batches of 4 sequences of 16 tokens on a 2-block OLMo, every step logged to CSV."""
    pl.seed_everything(0, verbose=False)
    config = dict(
        vocab_size=64,
        d_model=32,
        n_layers=2,
        n_heads=2,
        mlp_hidden=64,
        context_length=16,
        tie_embeddings=tie_embeddings,
    )
    module = CausalLM(config, activation_checkpointing=activation_checkpointing, compile=compile)
    gns = GradientNoiseScale(groups=groups)
    logger = CSVLogger(tmp_path, name="run", version=0)
    callbacks = [BatchWarmup(ConstantBatch(8), lr_rule="none"), gns]
    trainer = pl.Trainer(callbacks=callbacks, **trainer_kwargs(max_steps=8, logger=logger, log_every_n_steps=1))
    trainer.fit(module, RandomTokens(64, 16, 64, batch_size=4))
    return gns, tmp_path / "run" / "version_0" / "metrics.csv"
