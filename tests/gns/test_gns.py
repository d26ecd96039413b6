"""GradientNoiseScale on a problem whose noise scale is known in closed form.

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
import math
import re
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from launch import DISTRIBUTED_VARIABLES
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from toys import trainer_kwargs

from lit_cbs import BatchWarmup, ConstantBatch, PiecewiseBatch
from lit_cbs._internals import should_accumulate
from lit_cbs.analysis.curves import read_metrics_csv
from lit_cbs.callbacks.accounting import BatchAccounting
from lit_cbs.gns.callback import GradientNoiseScale, block_groups, layer_stacks, two_batch_estimates
from lit_cbs.models.lm import CausalLM
from lit_cbs.recipes.run_report import group_noise_scale_figure, plot_run

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
        self.window: list[list[int]] = []  # sample indices of each micro-batch since the last optimizer step

    @property
    def weight(self) -> torch.Tensor:
        return torch.cat([self.first.weight[0], self.second.weight[0]]).detach()

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self.first(x[:, :2]) + self.second(x[:, 2:])

    def training_step(self, batch, batch_idx):
        self.window.append(batch["idx"].tolist())
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

    With ``outdir`` each rank also saves its records, since ddp_spawn returns no callback state.
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
                "micro_batches": pl_module.window,
                "num_updates": gns.num_updates,
                "measurement": None if not measured else {k: v.tolist() if torch.is_tensor(v) else v for k, v in vars(m).items()},
            }
        )
        pl_module.window = []

    def on_train_end(self, trainer, pl_module):
        if self.outdir is not None:
            gns = next(cb for cb in trainer.callbacks if isinstance(cb, GradientNoiseScale))
            records = {"steps": self.steps, "b_simple": gns.b_simple, "state": gns.state_dict(), "weight": pl_module.weight}
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


def test_two_batch_estimates_invert_the_expected_norms():
    grad_sq, trace_sigma, small, big = 3.0, 45.0, 4.0, 32.0
    estimated = two_batch_estimates(grad_sq + trace_sigma / small, grad_sq + trace_sigma / big, small, big)
    assert estimated == pytest.approx((grad_sq, trace_sigma))


def test_analytic_b_simple_matches_formula():
    delta_sq = sum(d * d for d in DELTA)
    assert analytic_b_simple() == pytest.approx(DIM + 1 + DIM * NOISE_STD**2 / delta_sq)


def test_accumulation_matches_analytic_noise_scale_per_group(tmp_path):
    # 400 steps of 8 micro-batches of 8 samples; the metrics reach a CSVLogger every 50 steps.
    gns = GradientNoiseScale(ema_decay=0.999, groups="param_groups")
    logger = CSVLogger(tmp_path, name="run", version=0)
    trainer, gns, recorder, data, module = fit(
        8 * 8 * 400, 8, gns=gns, two_groups=True, accumulate_grad_batches=8, logger=logger, log_every_n_steps=50
    )
    assert gns.num_updates == 400
    with open(tmp_path / "run" / "version_0" / "metrics.csv", newline="") as f:
        rows = [row for row in csv.DictReader(f) if row["gns/b_simple"]]
    assert [int(row["step"]) for row in rows] == list(range(49, 400, 50))  # the rows of steps 50, 100, ...
    metrics = rows[-1]
    assert {name: float(value) for name, value in metrics.items() if name.startswith("gns/")} == pytest.approx(gns.metrics())
    expected = analytic_b_simple()
    assert gns.b_simple == pytest.approx(expected, rel=TOLERANCE)
    assert float(metrics["gns/b_simple"]) == pytest.approx(gns.b_simple, rel=1e-5)
    grad_sq, trace_sigma = analytic_noise(list(range(DIM)))
    assert float(metrics["gns/grad_sq"]) == pytest.approx(grad_sq, rel=TOLERANCE)
    assert float(metrics["gns/trace_sigma"]) == pytest.approx(trace_sigma, rel=TOLERANCE)
    for name, coordinates in GROUPS.items():
        assert float(metrics[f"gns/{name}/b_simple"]) == pytest.approx(analytic_b_simple(coordinates), rel=TOLERANCE)
    print(
        f"accumulation: B_simple {gns.b_simple:.3f} vs analytic {expected:.3f}; per group "
        + ", ".join(f"{n} {float(metrics[f'gns/{n}/b_simple']):.3f} vs {analytic_b_simple(c):.3f}" for n, c in GROUPS.items())
    )
    measured = assert_exact_measurements(recorder.steps, data.dataset, module.weight, groups=list(GROUPS.values()))
    assert measured == 400


def logged_gns_rows(csv_path: Path) -> list[dict[str, float]]:
    """The CSVLogger rows that hold GradientNoiseScale's metrics, gns/* columns only."""
    with open(csv_path, newline="") as f:
        rows = [row for row in csv.DictReader(f) if row["gns/b_simple"]]
    return [{name: float(value) for name, value in row.items() if name.startswith("gns/")} for row in rows]


def test_regex_groups_equal_optimizer_groups_and_add_up_to_the_whole_model(tmp_path):
    # The same two halves of the weight, once as two optimizer groups and once as regexes over the
    # parameter names of a single optimizer group: the same numbers, and they add up to the model's.
    _, by_optimizer, _, _, _ = fit(
        8 * 4 * 50, 8, gns=GradientNoiseScale(groups="param_groups"), two_groups=True, accumulate_grad_batches=4
    )
    logger = CSVLogger(tmp_path, name="run", version=0)
    _, by_name, recorder, data, module = fit(
        8 * 4 * 50, 8, gns=GradientNoiseScale(groups=HALVES), accumulate_grad_batches=4, logger=logger, log_every_n_steps=10
    )
    assert by_name.group_names == by_optimizer.group_names == ["first", "second"]
    metrics = by_name.metrics()
    assert metrics == by_optimizer.metrics()
    for metric in ("grad_sq", "trace_sigma"):
        assert metrics[f"gns/first/{metric}"] + metrics[f"gns/second/{metric}"] == pytest.approx(
            metrics[f"gns/{metric}"], rel=1e-6
        )
    rows = logged_gns_rows(tmp_path / "run" / "version_0" / "metrics.csv")
    assert len(rows) == 5 and rows[-1] == pytest.approx(metrics)
    assert set(rows[-1]) == {
        f"gns/{group}{metric}" for group in ("", "first/", "second/") for metric in ("b_simple", "grad_sq", "trace_sigma")
    }
    assert assert_exact_measurements(recorder.steps, data.dataset, module.weight, groups=list(GROUPS.values())) == 50


def test_one_group_of_everything_is_the_whole_model_and_unmatched_parameters_stay_in_it():
    _, everything, _, _, _ = fit(8 * 4 * 30, 8, gns=GradientNoiseScale(groups={"all": ".*"}), accumulate_grad_batches=4)
    metrics = everything.metrics()
    assert everything.group_names == ["all"]
    assert [metrics[f"gns/all/{m}"] for m in ("b_simple", "grad_sq", "trace_sigma")] == [
        metrics[f"gns/{m}"] for m in ("b_simple", "grad_sq", "trace_sigma")
    ]
    _, first_only, recorder, data, module = fit(
        8 * 4 * 30, 8, gns=GradientNoiseScale(groups={"first": r"^first\."}), accumulate_grad_batches=4
    )
    assert first_only.group_names == ["first", None]  # second.weight: in no group, still in the whole model
    partial = first_only.metrics()
    assert set(partial) == {f"gns/{group}{m}" for group in ("", "first/") for m in ("b_simple", "grad_sq", "trace_sigma")}
    assert partial["gns/b_simple"] == pytest.approx(metrics["gns/b_simple"], rel=1e-6)
    assert assert_exact_measurements(recorder.steps, data.dataset, module.weight, groups=list(GROUPS.values())) == 30


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
        vocab_size=64, d_model=32, n_layers=2, n_heads=2, mlp_hidden=64, context_length=16, tie_embeddings=tie_embeddings
    )
    module = CausalLM(config, activation_checkpointing=activation_checkpointing, compile=compile)
    gns = GradientNoiseScale(groups=groups)
    logger = CSVLogger(tmp_path, name="run", version=0)
    callbacks = [BatchWarmup(ConstantBatch(8), lr_rule="none"), gns]
    trainer = pl.Trainer(callbacks=callbacks, **trainer_kwargs(max_steps=8, logger=logger, log_every_n_steps=1))
    trainer.fit(module, RandomTokens(64, 16, 64, batch_size=4))
    return gns, tmp_path / "run" / "version_0" / "metrics.csv"


@pytest.mark.parametrize("tie_embeddings, activation_checkpointing", [(False, False), (True, True)])
def test_blocks_on_a_tiny_olmo(tmp_path, tie_embeddings, activation_checkpointing):
    gns, metrics_csv = fit_tiny_olmo(tmp_path, "blocks", tie_embeddings, activation_checkpointing)
    assert gns.group_names == ["embedding", "block0", "block1"] + ([] if tie_embeddings else ["lm_head"])
    rows = logged_gns_rows(metrics_csv)
    assert len(rows) == gns.num_updates == 8
    for row in rows:
        for metric in ("grad_sq", "trace_sigma"):
            groups_sum = sum(row[f"gns/{group}/{metric}"] for group in gns.group_names)
            assert groups_sum == pytest.approx(row[f"gns/{metric}"], rel=1e-5, abs=1e-9)
        for group in gns.group_names:
            assert row[f"gns/{group}/b_simple"] == pytest.approx(
                row[f"gns/{group}/trace_sigma"] / row[f"gns/{group}/grad_sq"], rel=1e-5
            )


@pytest.mark.slow
def test_compiled_blocks_measure_the_noise_scale_of_the_eager_model(tmp_path):
    eager, _ = fit_tiny_olmo(tmp_path / "eager", "blocks", activation_checkpointing=True)
    compiled, _ = fit_tiny_olmo(tmp_path / "compiled", "blocks", activation_checkpointing=True, compile=True)
    assert compiled.group_names == eager.group_names and compiled.num_updates == eager.num_updates == 8
    # The same gradients to rounding: inductor's kernels sum in another order than eager's.
    assert compiled.b_simple == pytest.approx(eager.b_simple, rel=1e-3)


def test_blocks_of_two_stacks_stay_apart():
    def stack(blocks: int) -> torch.nn.Module:
        module = torch.nn.Module()
        module.blocks = torch.nn.ModuleList(torch.nn.Linear(2, 2, bias=False) for _ in range(blocks))
        return module

    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(4, 2)
    model.encoder, model.decoder = stack(2), stack(1)
    model.decoder.norm = torch.nn.LayerNorm(2, bias=False)
    names = [name for name, _ in model.named_parameters()]
    assert layer_stacks(model) == ["encoder.blocks", "decoder.blocks"]
    assert block_groups(names, layer_stacks(model)) == {
        "embed": ["embed.weight"],
        "block0": ["encoder.blocks.0.weight"],
        "block1": ["encoder.blocks.1.weight"],
        "decoder.block0": ["decoder.blocks.0.weight"],
        "decoder.norm": ["decoder.norm.weight"],
    }


def test_run_report_plots_b_simple_per_group(tmp_path):
    gns, metrics_csv = fit_tiny_olmo(tmp_path, "blocks")
    written = plot_run(metrics_csv, tmp_path / "plots")
    assert [path.name for path in written] == ["loss_vs_tokens.png", "batch_lr_vs_tokens.png", "gns_groups_vs_tokens.png"]
    figure = group_noise_scale_figure(read_metrics_csv(metrics_csv))
    (ax,) = figure.axes
    lines = {line.get_label(): line.get_ydata() for line in ax.get_lines()}
    assert gns.group_names == ["embedding", "block0", "block1", "lm_head"]
    assert list(lines) == ["block0", "block1", "embedding", "lm_head", "whole model"]
    rows = logged_gns_rows(metrics_csv)
    np.testing.assert_allclose(lines["block1"], [row["gns/block1/b_simple"] for row in rows])
    # Without groups there is nothing to draw per group.
    _, plain_csv = fit_tiny_olmo(tmp_path / "plain", None)
    assert "gns_groups_vs_tokens.png" not in [path.name for path in plot_run(plain_csv, tmp_path / "plain_plots")]


@pytest.mark.parametrize(
    "groups, message",
    [
        (
            {"first": r"^first\.", "third": r"^third\."},
            r"groups['third']='^third\\.' matches none of the trained parameters (first.weight, second.weight)",
        ),
        ({"weights": "weight", "first": r"^first\."}, "parameter 'first.weight' is matched by groups ['weights', 'first']"),
        ("blocks", "groups='blocks' looks for the model's stack of transformer blocks (an nn.ModuleList of modules of one class"),
    ],
)
def test_groups_that_match_nothing_or_overlap_are_refused_before_training(groups, message):
    gns = GradientNoiseScale(groups=groups)
    with pytest.raises(ValueError, match=re.escape(message)):
        fit(64, 8, gns=gns, accumulate_grad_batches=2)
    assert gns.num_updates == 0 and gns.last_measurement is None


def test_batch_warmup_changing_accumulation_mid_run():
    # Global batch 32 (accumulate 4) for 6400 samples, then 64 (accumulate 8). The dataset ends with a
    # short window: one full micro-batch of 8 and one of 5 samples, so sizes differ within that step.
    n = 6400 + 64 * 200 + 8 + 5
    warmup = BatchWarmup(PiecewiseBatch([32, 64], [0, 6400], unit="samples"), lr_rule="none")
    trainer, gns, recorder, data, module = fit(n, 8, callbacks=[warmup])
    assert [(c.old_accumulate, c.new_accumulate, c.step) for c in warmup.history] == [(4, 8, 200)]
    sizes = [step["measurement"]["big_batch_size"] for step in recorder.steps]
    assert sizes[:200] == [32.0] * 200 and sizes[200:400] == [64.0] * 200
    assert sizes[-1] == pytest.approx(4 / (1 / 8 + 1 / 5))  # the short last step: M^2 / sum(1/b)
    assert gns.num_updates == 401
    assert assert_exact_measurements(recorder.steps, data.dataset, module.weight) == 401
    expected = analytic_b_simple()
    print(f"BatchWarmup 32 -> 64: B_simple {gns.b_simple:.3f} vs analytic {expected:.3f}")
    assert gns.b_simple == pytest.approx(expected, rel=TOLERANCE)


def test_per_example_mode_without_accumulation():
    gns = GradientNoiseScale(ema_decay=0.999, per_example_loss=squared_error, per_example_chunk_size=8, groups=HALVES)
    trainer, gns, recorder, data, module = fit(16 * 300, 16, gns=gns)
    assert gns.num_updates == 300
    weight = module.weight
    for step in recorder.steps[:20]:
        (indices,) = step["micro_batches"]
        per_sample = torch.stack([data.dataset.micro_batch_gradient([i], weight) for i in indices])
        m = step["measurement"]
        groups = GROUPS.values()
        assert m["small_grad_sq"] == pytest.approx([float((per_sample[:, g] ** 2).sum(1).mean()) for g in groups], rel=1e-5)
        assert m["big_grad_sq"] == pytest.approx([float((per_sample.mean(0)[g] ** 2).sum()) for g in groups], rel=1e-5)
        assert (m["small_batch_size"], m["big_batch_size"]) == (1.0, 16.0)
    expected = analytic_b_simple()
    print(f"per-example: B_simple {gns.b_simple:.3f} vs analytic {expected:.3f}")
    assert gns.b_simple == pytest.approx(expected, rel=TOLERANCE)


def test_per_example_mode_leaves_training_rng_untouched():
    def draw_after_one_step(gns_callbacks):
        pl.seed_everything(0, verbose=False)
        data = GaussianRegressionData(32, 16)
        module = FixedRegression(data.dataset.w_true)
        trainer = pl.Trainer(callbacks=gns_callbacks, **trainer_kwargs(max_steps=1, accumulate_grad_batches=2))
        trainer.fit(module, data)
        return torch.rand(3)

    with_gns = draw_after_one_step([GradientNoiseScale(per_example_loss=squared_error)])
    torch.testing.assert_close(with_gns, draw_after_one_step([]))


@pytest.mark.parametrize("groups", [None, HALVES])
def test_resumed_run_continues_the_averages_exactly(tmp_path, groups):
    n, micro = 8 * 4 * 20, 8

    def run(epochs, ckpt_path=None, checkpoint_dir=None):
        pl.seed_everything(0, verbose=False)
        data = GaussianRegressionData(n, micro)
        module = FixedRegression(data.dataset.w_true)
        gns = GradientNoiseScale(ema_decay=0.9, groups=groups)
        callbacks = [gns] + ([ModelCheckpoint(dirpath=checkpoint_dir, save_last=True)] if checkpoint_dir else [])
        kwargs = trainer_kwargs(max_epochs=epochs, accumulate_grad_batches=4, enable_checkpointing=checkpoint_dir is not None)
        pl.Trainer(callbacks=callbacks, **kwargs).fit(module, data, ckpt_path=ckpt_path)
        return gns

    uninterrupted = run(2)
    run(1, checkpoint_dir=tmp_path / "first")
    resumed = run(2, ckpt_path=tmp_path / "first" / "last.ckpt", checkpoint_dir=tmp_path / "resumed")
    assert resumed.num_updates == uninterrupted.num_updates == 40
    assert resumed.state_dict()["group_names"] == (["first", "second"] if groups else [None])
    for key in ("ema_grad_sq", "ema_trace_sigma"):
        torch.testing.assert_close(resumed.state_dict()[key], uninterrupted.state_dict()[key], rtol=0, atol=0)


def test_fp16_grad_scaler_is_divided_out_and_overflow_steps_are_skipped():
    # A GradScaler multiplies every micro-batch gradient by its scale (1024 here) until unscale_;
    # one infinite label makes one step overflow, which the optimizer and the averages skip.
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    pl.seed_everything(0, verbose=False)
    data = GaussianRegressionData(8 * 8 * 100, 8)
    data.dataset.y[123] = math.inf
    module = FixedRegression(data.dataset.w_true)
    gns, recorder = GradientNoiseScale(ema_decay=0.999), RecordSteps()
    trainer = pl.Trainer(callbacks=[gns, recorder], plugins=[plugin], **trainer_kwargs(accumulate_grad_batches=8))
    trainer.fit(module, data)
    overflowed = [i for i, step in enumerate(recorder.steps) if any(123 in mb for mb in step["micro_batches"])]
    assert len(overflowed) == 1 and recorder.steps[overflowed[0]]["measurement"] is None
    assert gns.num_updates == 99 and math.isfinite(gns.b_simple)
    assert plugin.scaler.get_scale() == 512.0  # halved once, by the overflow
    assert assert_exact_measurements(recorder.steps, data.dataset, module.weight) == 99


# ---------------------------------------------------------------------- 2-process DDP
WORLD_SIZE = 2
DDP_MICRO = 8
# Global batch 16 (accumulate 1: each rank's batch is the small one, measured in the comm hook) for
# 80 steps (1280 samples; 80 micro-batches per rank, divisible by 4 so the change is immediate),
# then 64 (accumulate 4: three micro-batches under no_sync, the last in the hook) for 400 steps.
# Simulating the estimator on this schedule gives a relative standard deviation of about 2.4%.
DDP_SCHEDULE = PiecewiseBatch([16, 64], [0, 1280], unit="samples")
DDP_SAMPLES = 1280 + 64 * 400


@pytest.mark.slow
def test_ddp_matches_analytic_noise_scale(tmp_path):
    pl.seed_everything(0, verbose=False)
    data = GaussianRegressionData(DDP_SAMPLES, DDP_MICRO)
    module = FixedRegression(data.dataset.w_true)
    # lr_rule="sqrt" (math.sqrt) pickles for ddp_spawn; with lr=0 every rule leaves the weights fixed.
    gns = GradientNoiseScale(ema_decay=0.999, groups=HALVES)  # per group through the comm hook too
    callbacks = [BatchWarmup(DDP_SCHEDULE, lr_rule="sqrt"), gns, RecordSteps(tmp_path)]
    trainer = pl.Trainer(callbacks=callbacks, **trainer_kwargs(strategy="ddp_spawn", devices=WORLD_SIZE))
    trainer.fit(module, data)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD_SIZE)]
    assert ranks[0]["b_simple"] == ranks[1]["b_simple"]  # the estimate is reduced, so identical on both ranks
    steps = [
        {"micro_batches": a["micro_batches"] + b["micro_batches"], "measurement": a["measurement"]}
        for a, b in zip(ranks[0]["steps"], ranks[1]["steps"])
    ]
    assert [len(step["micro_batches"]) for step in steps] == [2] * 80 + [8] * 400
    assert assert_exact_measurements(steps, data.dataset, ranks[0]["weight"], groups=list(GROUPS.values())) == 480
    expected = analytic_b_simple()
    print(f"DDP x2 (accumulate 1 -> 4): B_simple {ranks[0]['b_simple']:.3f} vs analytic {expected:.3f}")
    assert ranks[0]["b_simple"] == pytest.approx(expected, rel=TOLERANCE)
    state = ranks[0]["state"]  # bias correction cancels in a group's ratio of EMAs
    for i, coordinates in enumerate(GROUPS.values()):
        group_b_simple = float(state["ema_trace_sigma"][i] / state["ema_grad_sq"][i])
        assert group_b_simple == pytest.approx(analytic_b_simple(coordinates), rel=TOLERANCE)


# ---------------------------------------------------------------------- CBS probe branches
class BranchLikeWork(Callback):
    """Stands in for a CBS probe: after optimizer step ``step``, what a branch does through the Trainer's
    strategy, inside ``BatchAccounting.branching()``: forward and backward of two micro-batches with 1000x
    the main run's gradients (Lightning's backward hooks and, under DDP, the all-reduce run), an optimizer
    step (Lightning's on_before_optimizer_step runs; lr=0 keeps the weights), then zeroed gradients."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.step or should_accumulate(trainer):
            return
        strategy, optimizer, window = trainer.strategy, trainer.optimizers[0], pl_module.window
        with BatchAccounting.attach(trainer).branching():
            for i in range(2):
                strategy.backward(strategy.training_step(batch, i) * 1000.0, optimizer)
            strategy.optimizer_step(optimizer, closure=lambda: None)
            optimizer.zero_grad()
        pl_module.window = window  # the branch's training_step calls are not the main run's micro-batches


def logged_noise_scale(tmp_path, callbacks, **trainer_overrides) -> dict[str, tuple[list, list]]:
    """The gns/* metrics a run of 4 optimizer steps (accumulate 2) logs: name -> (steps, values)."""
    pl.seed_everything(0, verbose=False)
    data = GaussianRegressionData(8 * 2 * 4 * trainer_overrides.get("devices", 1), 8)
    logger = CSVLogger(tmp_path, name="run")
    trainer = pl.Trainer(
        callbacks=[*callbacks, GradientNoiseScale(ema_decay=0.5, groups=HALVES)],
        **trainer_kwargs(accumulate_grad_batches=2, logger=logger, log_every_n_steps=1, **trainer_overrides),
    )
    trainer.fit(FixedRegression(data.dataset.w_true), data)
    metrics = read_metrics_csv(next(tmp_path.rglob("metrics.csv")))
    logged = {name: (steps.tolist(), values.tolist()) for name, (steps, values) in metrics.items() if name.startswith("gns/")}
    assert logged["gns/b_simple"][0] == [0, 1, 2, 3]
    return logged


def test_probe_branches_are_not_measured(tmp_path):
    expected = logged_noise_scale(tmp_path / "plain", [])
    assert logged_noise_scale(tmp_path / "branched", [BranchLikeWork(step=2)]) == expected


def forget_rendezvous(monkeypatch) -> None:
    """Lightning exports MASTER_PORT (and the rest) into this process; a later multi-process test would
    reuse that port while this process may still hold its store open. Dropped after the test."""
    for name in DISTRIBUTED_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.slow
def test_probe_branches_are_not_measured_under_ddp(tmp_path, monkeypatch):
    forget_rendezvous(monkeypatch)
    # The branch's backward all-reduces through GradientNoiseScale's DDP communication hook too.
    # Forked children start as copies of this process and need not import it again (a second, not 20 as
    # spawned), but a process that initialised CUDA cannot fork.
    strategy = "ddp_spawn" if torch.cuda.is_initialized() else "ddp_fork"
    ddp = {"strategy": strategy, "devices": WORLD_SIZE}
    expected = logged_noise_scale(tmp_path / "plain", [], **ddp)
    assert logged_noise_scale(tmp_path / "branched", [BranchLikeWork(step=2)], **ddp) == expected


# ---------------------------------------------------------------------- bad configurations
def test_one_batch_size_is_refused():
    with pytest.raises(ValueError, match="needs two batch sizes.*accumulate_grad_batches=1 on 1 process.*per_example_loss"):
        fit(64, 8)


def test_a_step_of_one_micro_batch_on_one_process_is_said_once_and_not_measured():
    # 16 samples in 2 micro-batches of 8, then (from 64 samples) 8 samples in one micro-batch.
    warmup = BatchWarmup(PiecewiseBatch([16, 8], [0, 64], unit="samples"), lr_rule="none")
    with pytest.warns(
        UserWarning,
        match=r"^GradientNoiseScale: step 5 is one micro-batch on one process.*not measured "
        r"\(the micro-batch is the whole batch: cap BatchWarmup's max_micro_batch_size",
    ):
        _, gns, recorder, _, _ = fit(96, 8, callbacks=[warmup])
    assert [step["measurement"] is not None for step in recorder.steps] == [True] * 4 + [False] * 4
    assert gns.num_updates == 4


def test_batch_warmup_that_raises_accumulation_later_is_accepted():
    warmup = BatchWarmup(PiecewiseBatch([8, 16], [0, 32], unit="samples"), lr_rule="none")
    _, gns, recorder, _, _ = fit(64, 8, callbacks=[warmup])
    # 4 steps at accumulate 1 are not measured; then 2 steps at accumulate 2 are.
    assert [step["measurement"] is not None for step in recorder.steps] == [False] * 4 + [True] * 2
    assert gns.num_updates == 2


@pytest.fixture
def process_group_cleanup(monkeypatch):
    """In-process strategies below initialise a 1-process group; later tests expect none, and a port of their own."""
    forget_rendezvous(monkeypatch)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


class RegisterCommHook(Callback):
    """Stands in for DDPStrategy(ddp_comm_hook=...), which Lightning registers on CUDA only."""

    def on_fit_start(self, trainer, pl_module):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        trainer.strategy.model.register_comm_hook(None, allreduce_hook)


def test_existing_ddp_comm_hook_is_refused(process_group_cleanup):
    data = GaussianRegressionData(64, 8)
    callbacks = [RegisterCommHook(), GradientNoiseScale()]
    trainer = pl.Trainer(callbacks=callbacks, **trainer_kwargs(strategy=DDPStrategy(), accumulate_grad_batches=2))
    with pytest.raises(ValueError, match="already registered: remove DDPStrategy\\(ddp_comm_hook=...\\)"):
        trainer.fit(FixedRegression(data.dataset.w_true), data)


def test_sharded_strategy_is_refused(process_group_cleanup):
    data = GaussianRegressionData(64, 8)
    strategy = ModelParallelStrategy()
    trainer = pl.Trainer(callbacks=[GradientNoiseScale()], **trainer_kwargs(strategy=strategy, accumulate_grad_batches=2))
    with pytest.raises(ValueError, match="supports single-device and DDP strategies, got ModelParallelStrategy"):
        trainer.fit(FixedRegression(data.dataset.w_true), data)


def test_manual_optimization_is_refused():
    class Manual(FixedRegression):
        def __init__(self, w_true):
            super().__init__(w_true)
            self.automatic_optimization = False

    data = GaussianRegressionData(64, 8)
    trainer = pl.Trainer(callbacks=[GradientNoiseScale()], **trainer_kwargs())
    with pytest.raises(ValueError, match="automatic optimization"):
        trainer.fit(Manual(data.dataset.w_true), data)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"ema_decay": 1.0}, ValueError, r"ema_decay=1.0 must be a float in \[0, 1\)"),
        ({"ema_decay": -0.1}, ValueError, "ema_decay"),
        ({"per_example_loss": "mse"}, TypeError, "per_example_loss must be a callable"),
        ({"per_example_chunk_size": 4}, ValueError, "also pass per_example_loss"),
        ({"per_example_loss": squared_error, "per_example_chunk_size": 0}, ValueError, "positive int"),
        ({"groups": "layers"}, ValueError, r"groups='layers' is not supported; use None, one of \('param_groups', 'blocks'\)"),
        ({"groups": {}}, ValueError, "a non-empty dict of group name -> regex"),
        ({"groups": {"attention": "("}}, ValueError, r"groups\['attention'\]='\(' is not a valid regex"),
        ({"groups": {"attention": 3}}, TypeError, "must be a regex string over parameter names"),
        ({"groups": {"": "weight"}}, ValueError, "group names must be non-empty strings"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        GradientNoiseScale(**kwargs)


def test_resume_with_other_groups_is_refused(tmp_path):
    first = {"first": r"^first\."}
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    fit(
        64, 8, gns=GradientNoiseScale(groups=HALVES), callbacks=[checkpoint], accumulate_grad_batches=2, enable_checkpointing=True
    )
    expected = (
        f"the checkpoint's GradientNoiseScale measured the groups ['first', 'second'] but groups={first!r} gives ['first', None]"
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        fit(128, 8, gns=GradientNoiseScale(groups=first), accumulate_grad_batches=2, ckpt_path=tmp_path / "last.ckpt")
