"""GradientNoiseScale: each measuring mode against the closed-form noise scale (regression.py), step by step."""

from __future__ import annotations

import csv
import math
import pickle
import re

import lightning.pytorch as pl
import pytest
import torch
from gns.regression import (
    DIM,
    GROUPS,
    HALVES,
    TOLERANCE,
    FixedRegression,
    GaussianRegressionData,
    RecordSteps,
    analytic_b_simple,
    analytic_noise,
    assert_exact_measurements,
    fit,
    squared_error,
)
from launch import in_process_ddp
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from toys import trainer_kwargs

from lit_cbs import BatchWarmup, PiecewiseBatch
from lit_cbs._internals import should_accumulate
from lit_cbs.analysis.curves import read_metrics_csv
from lit_cbs.callbacks.accounting import BatchAccounting
from lit_cbs.gns import GradientNoiseScale


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
    assert {name: float(value) for name, value in metrics.items() if name.startswith("gns/")} == pytest.approx(
        gns.metrics()
    )
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
        + ", ".join(
            f"{n} {float(metrics[f'gns/{n}/b_simple']):.3f} vs {analytic_b_simple(c):.3f}" for n, c in GROUPS.items()
        )
    )
    measured = assert_exact_measurements(recorder.steps, data.dataset, module.weight, groups=list(GROUPS.values()))
    assert measured == 400


def test_batch_warmup_changing_accumulation_mid_run():
    # Global batch 32 (accumulate 4) for 6400 samples, then 64 (accumulate 8). The dataset ends with a
    # short step: one full micro-batch of 8 and one of 5 samples, so sizes differ within that step.
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
        assert m["small_grad_sq"] == pytest.approx(
            [float((per_sample[:, g] ** 2).sum(1).mean()) for g in groups], rel=1e-5
        )
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
        kwargs = trainer_kwargs(
            max_epochs=epochs, accumulate_grad_batches=4, enable_checkpointing=checkpoint_dir is not None
        )
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
    # With lr=0 every rule leaves the weights fixed.
    gns = GradientNoiseScale(ema_decay=0.999, groups=HALVES)  # per group through the comm hook too
    callbacks = [BatchWarmup(DDP_SCHEDULE, lr_rule="sqrt"), gns, RecordSteps(tmp_path)]
    trainer = pl.Trainer(callbacks=callbacks, **trainer_kwargs(strategy=in_process_ddp(), devices=WORLD_SIZE))
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


def test_the_noise_scale_pickles_for_ddp_spawn():
    """ddp_spawn pickles the Trainer and its callbacks into every child process (the fits here fork instead)."""
    gns = GradientNoiseScale(ema_decay=0.999, groups=HALVES)
    copy = pickle.loads(pickle.dumps(gns))
    assert (copy.ema_decay, copy.groups, copy.per_example_loss) == (0.999, HALVES, None)


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
        strategy, optimizer, micro_batches = trainer.strategy, trainer.optimizers[0], pl_module.micro_batches
        with BatchAccounting.attach(trainer).branching():
            for i in range(2):
                strategy.backward(strategy.training_step(batch, i) * 1000.0, optimizer)
            strategy.optimizer_step(optimizer, closure=lambda: None)
            optimizer.zero_grad()
        pl_module.micro_batches = micro_batches  # the branch's training_step calls are not the main run's micro-batches


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
    logged = {
        name: (steps.tolist(), values.tolist()) for name, (steps, values) in metrics.items() if name.startswith("gns/")
    }
    assert logged["gns/b_simple"][0] == [0, 1, 2, 3]
    return logged


def test_probe_branches_are_not_measured(tmp_path):
    expected = logged_noise_scale(tmp_path / "plain", [])
    assert logged_noise_scale(tmp_path / "branched", [BranchLikeWork(step=2)]) == expected


@pytest.mark.slow
def test_probe_branches_are_not_measured_under_ddp(tmp_path):
    # The branch's backward all-reduces through GradientNoiseScale's DDP communication hook too.
    ddp = {"strategy": in_process_ddp(), "devices": WORLD_SIZE}
    expected = logged_noise_scale(tmp_path / "plain", [], **ddp)
    assert logged_noise_scale(tmp_path / "branched", [BranchLikeWork(step=2)], **ddp) == expected


# ---------------------------------------------------------------------- bad configurations
def test_one_batch_size_is_refused():
    with pytest.raises(
        ValueError, match="needs two batch sizes.*accumulate_grad_batches=1 on 1 process.*per_example_loss"
    ):
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
def process_group_cleanup():
    """In-process strategies below initialise a 1-process group; later tests expect none (and a port of their own:
    tests/conftest.py's forget_rendezvous)."""
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
    trainer = pl.Trainer(
        callbacks=[GradientNoiseScale()], **trainer_kwargs(strategy=strategy, accumulate_grad_batches=2)
    )
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


def test_resume_with_other_groups_is_refused(tmp_path):
    first = {"first": r"^first\."}
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    fit(
        64,
        8,
        gns=GradientNoiseScale(groups=HALVES),
        callbacks=[checkpoint],
        accumulate_grad_batches=2,
        enable_checkpointing=True,
    )
    expected = (
        "the checkpoint's GradientNoiseScale measured the groups ['first', 'second'] "
        f"but groups={first!r} gives ['first', None]"
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        fit(128, 8, gns=GradientNoiseScale(groups=first), accumulate_grad_batches=2, ckpt_path=tmp_path / "last.ckpt")
