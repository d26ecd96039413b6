"""BatchWarmup on a real Trainer: exact steps, no sample lost, LR after changes, resume, bad configuration
(single process)."""

from __future__ import annotations

import csv
import math
import warnings
from collections import Counter

import lightning.pytorch as pl
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lightning.pytorch.callbacks import GradientAccumulationScheduler, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from toys import (
    GlobalOrderRegressionData,
    IndexedRegression,
    RegressionData,
    RegressionModule,
    mean_gradient,
    megatron_reference,
    trainer_kwargs,
)

from lit_cbs import (
    BatchWarmup,
    CBSAdaptive,
    ConstantBatch,
    LinearRamp,
    PiecewiseBatch,
    TokenLRScheduler,
    WarmupStableDecay,
)
from lit_cbs.errors import LitCBSConfigError
from lit_cbs.rules import CosineSchedule, Seesaw
from lit_cbs.rules.batch_schedules import ExponentialRamp


def fit(schedule, *, n=96, micro=2, epochs=1, lr_rule="linear", callbacks=(), module=None, data=None, **kwargs):
    pl.seed_everything(0, verbose=False)
    data = data or RegressionData(n=n, batch_size=micro)
    module = module or RegressionModule()
    warmup = BatchWarmup(schedule, lr_rule=lr_rule, **kwargs)
    trainer = pl.Trainer(callbacks=[warmup, *callbacks], **trainer_kwargs(max_epochs=epochs))
    trainer.fit(module, data)
    return trainer, module, data, warmup


def size_in_effect(warmup: BatchWarmup, step: int) -> int:
    """Global batch the callback says it used for optimizer step ``step`` (0-based)."""
    size = warmup.history[0].old_global_batch if warmup.history else warmup.global_batch
    for change in warmup.history:
        if step >= change.step:
            size = change.new_global_batch
    return size


def assert_exact_steps(module, data, warmup):
    """Invariant 1: each full step averages exactly the scheduled samples, gradient included."""
    for number, step in enumerate(module.steps):
        expected = mean_gradient(data.dataset, step["indices"], step["weight"])
        size = size_in_effect(warmup, number)
        if len(step["indices"]) == size:
            torch.testing.assert_close(step["grad"], expected, rtol=1e-10, atol=1e-12)
        else:
            # Only the last, partial window of an epoch may be short (Lightning steps on the final batch).
            assert len(step["indices"]) < size
            assert number + 1 == len(module.steps) or module.steps[number + 1]["epoch"] > step["epoch"]
    assert all(len(s["indices"]) > 0 for s in module.steps)


def test_gradient_is_mean_over_exactly_the_scheduled_samples():
    schedule = PiecewiseBatch([2, 4, 8], [0, 10, 40], unit="samples")
    trainer, module, data, warmup = fit(schedule, epochs=2)
    sizes = [len(s["indices"]) for s in module.steps]
    # 96 samples/epoch: 2-sample steps until >= 10 samples, then 4 from the first even batch count, then 8.
    assert sizes[:6] == [2] * 6 and sizes[6] == 4
    assert set(sizes[-12:]) == {8}
    assert_exact_steps(module, data, warmup)
    assert [(c.old_global_batch, c.new_global_batch) for c in warmup.history] == [(2, 4), (4, 8)]
    assert warmup.accounting.samples_seen == 192 and trainer.global_step == len(module.steps)
    # Every step after a change uses the new size: counts match history exactly.
    for number, step in enumerate(module.steps):
        assert len(step["indices"]) == size_in_effect(warmup, number)


def test_increase_by_ratio_r_waits_at_most_r_minus_1_steps():
    # 2 -> 8 (ratio 4) asked for at 6 samples = after step 3; must land by step 3 + 3.
    schedule = PiecewiseBatch([2, 8], [0, 6], unit="samples")
    _, module, _, warmup = fit(schedule)
    (change,) = warmup.history
    requested_step = change.requested_at_samples // 2
    assert change.requested_at_samples == 6
    assert 0 <= change.step - requested_step <= 3
    assert change.step % 4 == 0  # micro-batches consumed divisible by the new accumulate


def test_change_happens_at_the_first_possible_step():
    schedule = PiecewiseBatch([2, 4], [0, 8], unit="samples")
    _, _, _, warmup = fit(schedule)
    (change,) = warmup.history
    assert (change.step, change.samples_seen, change.requested_at_samples) == (4, 8, 8)


SIZES = st.sampled_from([2, 4, 6, 8, 12, 16])


def random_schedule(sizes: list[int], gaps: list[int]) -> PiecewiseBatch:
    """``sizes[i]`` from the sum of the first i ``gaps`` samples on."""
    thresholds = [0]
    for gap in gaps[: len(sizes) - 1]:
        thresholds.append(thresholds[-1] + gap)
    return PiecewiseBatch(sizes, thresholds, unit="samples")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(SIZES, min_size=1, max_size=4),
    gaps=st.lists(st.integers(min_value=1, max_value=60), min_size=3, max_size=3),
    epochs=st.integers(min_value=1, max_value=2),
)
def test_random_schedules_lose_and_repeat_no_sample(sizes, gaps, epochs):
    schedule = random_schedule(sizes, gaps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, module, data, warmup = fit(schedule, n=60, micro=2, epochs=epochs)
    seen = [i for micro_batch in module.micro_batches for i in micro_batch]
    expected = [i for epoch in range(epochs) for i in data.epoch_order(epoch)]
    assert seen == expected  # invariant 2: same order as without any change, each sample once per epoch
    assert_exact_steps(module, data, warmup)
    for change in warmup.history:
        assert change.new_global_batch == schedule.batch_size(change.requested_at_samples)
        wait_bound = math.lcm(change.old_accumulate, change.new_accumulate) // change.old_accumulate - 1
        waited = (change.samples_seen - change.requested_at_samples) // change.old_global_batch
        assert waited <= wait_bound or change.samples_seen % 60 == 0  # or it landed at an epoch boundary


def test_linear_ramp_matches_megatron_formula_on_a_trainer():
    schedule = LinearRamp(start=2, increment=2, ramp=60, final=8, unit="samples")
    _, module, data, warmup = fit(schedule, n=120)
    assert [c.new_global_batch for c in warmup.history] == [4, 6, 8]
    for change in warmup.history:
        expected = megatron_reference(change.requested_at_samples, start=2, increment=2, ramp=60, final=8)
        assert change.new_global_batch == expected
    assert_exact_steps(module, data, warmup)


def test_exponential_ramp_in_tokens_with_seq_len_argument():
    schedule = ExponentialRamp(start=2, final=8, ramp=300, unit="tokens", multiple_of=2)
    _, module, data, warmup = fit(schedule, n=96, seq_len=4)
    assert warmup.accounting.tokens_seen == 96 * 4
    assert [c.new_global_batch for c in warmup.history] == [4, 6, 8]
    assert_exact_steps(module, data, warmup)


# ---------------------------------------------------------------- the micro-batch grows between any two steps
def epochs_read(module: RegressionModule) -> dict[int, list[int]]:
    """The sample indices the run trained on, per epoch, in order."""
    read: dict[int, list[int]] = {}
    for step in module.steps:
        read.setdefault(step["epoch"], []).extend(step["indices"])
    return read


def test_micro_batch_grows_mid_epoch_with_a_global_order_loader():
    schedule = PiecewiseBatch([2, 4, 8, 16], [0, 20, 50, 120], unit="samples")
    trainer, module, data, warmup = fit(
        schedule, epochs=2, data=GlobalOrderRegressionData(n=96, batch_size=2), max_micro_batch_size=8
    )
    # The micro-batch grows first (2 -> 4 -> 8 samples, inside the first epoch), then the accumulation.
    changes = [(c.step, c.new_global_batch, c.new_micro_batch_size, c.new_accumulate) for c in warmup.history]
    assert changes == [(10, 4, 4, 1), (19, 8, 8, 1), (28, 16, 8, 2)]
    assert [len(micro_batch) for micro_batch in module.micro_batches[:24]] == [2] * 10 + [4] * 9 + [8] * 5
    # A change waits for the samples of the epoch to be a multiple of the new batch: 8 asked at 52, applied at 56.
    assert [(c.requested_at_samples, c.samples_seen) for c in warmup.history] == [(20, 20), (52, 56), (120, 128)]
    # The loader's order of each epoch, every sample once.
    read = epochs_read(module)
    assert read[0] == data.epoch_order(0) and read[1] == data.epoch_order(1)
    assert_exact_steps(module, data, warmup)
    assert data.batch_size == 8 and warmup.micro_batch_size == 8


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(SIZES, min_size=1, max_size=4),
    gaps=st.lists(st.integers(min_value=1, max_value=60), min_size=3, max_size=3),
    max_micro=st.sampled_from([2, 4, 6]),
)
def test_random_schedules_with_micro_batch_changes_lose_and_repeat_no_sample(sizes, gaps, max_micro):
    schedule = random_schedule(sizes, gaps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, module, data, warmup = fit(
            schedule, epochs=2, data=GlobalOrderRegressionData(n=60, batch_size=2), max_micro_batch_size=max_micro
        )
    read = epochs_read(module)
    for epoch, indices in read.items():  # each epoch's order, every sample once
        assert indices == data.epoch_order(epoch)
    assert_exact_steps(module, data, warmup)
    for change in warmup.history:
        assert change.new_global_batch == schedule.batch_size(change.requested_at_samples)
        assert change.new_micro_batch_size == max(
            m for m in range(1, max_micro + 1) if change.new_global_batch % m == 0
        )
        this_epoch = change.samples_seen - sum(len(read[epoch]) for epoch in range(change.epoch))
        assert this_epoch % change.new_global_batch == 0 or this_epoch == len(
            read[change.epoch]
        )  # or at the epoch's end
        old, new = change.old_global_batch, change.new_global_batch
        waited = (change.samples_seen - change.requested_at_samples) // old
        assert waited <= new // math.gcd(old, new) - 1 or this_epoch in (
            0,
            len(read[change.epoch]),
        )  # or at an epoch boundary


def test_every_sample_trains_once_per_epoch_however_the_micro_batch_ends_it():
    # 100 samples, global batch 4 -> 8 -> 24 in micro-batches up to 8, 3 epochs: each epoch's samples run out
    # mid-step with a micro-batch that is not full, which trains too.
    schedule = PiecewiseBatch([4, 8, 24], [0, 40, 120], unit="samples")
    data = GlobalOrderRegressionData(n=100, batch_size=4)
    trainer, module, data, warmup = fit(schedule, epochs=3, data=data, max_micro_batch_size=8)
    assert [(c.new_global_batch, c.new_micro_batch_size, c.new_accumulate) for c in warmup.history] == [
        (8, 8, 1),
        (24, 8, 3),
    ]
    read = epochs_read(module)
    assert [read[epoch] for epoch in range(3)] == [data.epoch_order(epoch) for epoch in range(3)]
    assert Counter(i for indices in read.values() for i in indices) == Counter(list(range(100)) * 3)
    assert warmup.accounting.samples_seen == 300 and warmup.accounting.samples_seen == 300
    last_steps = [[s for s in module.steps if s["epoch"] == epoch][-1] for epoch in range(3)]
    assert [len(s["indices"]) for s in last_steps] == [4, 4, 4]  # 100 = 4 x 24 + 4: one micro-batch of 4
    assert [len(m) for m in module.micro_batches[-2:]] == [8, 4]
    # Lightning divides each micro-batch's mean loss by the accumulation (3), also in this step.
    step = last_steps[-1]
    torch.testing.assert_close(step["grad"], mean_gradient(data.dataset, step["indices"], step["weight"]) / 3)
    assert_exact_steps(module, data, warmup)


def test_the_logged_row_of_an_epochs_short_last_step_says_what_it_trained_on(tmp_path):
    # 100 samples: micro-batch 2 -> 4 after 20 samples, then batch 8 (accumulate 2) after 50; the
    # epoch's samples run out with one micro-batch of 4 left for the last step.
    warmup = BatchWarmup(PiecewiseBatch([2, 4, 8], [0, 20, 50], unit="samples"), lr_rule="sqrt", max_micro_batch_size=4)
    logger = CSVLogger(tmp_path, name="", version="")
    trainer = pl.Trainer(**trainer_kwargs(callbacks=[warmup], logger=logger, log_every_n_steps=1))
    trainer.fit(RegressionModule(), GlobalOrderRegressionData(n=100, batch_size=2))
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = [row for row in csv.DictReader(f) if row.get("batch/global_size")]
    logged = [
        (float(row["batch/global_size"]), float(row["batch/micro_batch_size"]), float(row["batch/accumulate"]))
        for row in rows
    ]
    assert logged[-2:] == [(8, 4, 2), (4, 4, 1)] and warmup.global_batch == 8
    assert sum(size for size, _, _ in logged) == float(rows[-1]["samples_seen"]) == 100


def test_resume_from_every_checkpoint_across_micro_batch_changes_is_bitwise(tmp_path):
    # 2 -> 4 samples by the micro-batch (2 -> 4), then 8 and 16 by accumulation (2, 4): each of the
    # two epochs of 100 samples ends in a short step (one micro-batch of 4 where the step wants 2 and 4).
    schedule = PiecewiseBatch([2, 4, 8, 16], [0, 20, 50, 120], unit="samples")
    scheduler = SCHEDULERS["lambda"]

    def run(callbacks=(), ckpt_path=None):
        pl.seed_everything(0, verbose=False)
        module, warmup = (
            RegressionModule(scheduler_factory=scheduler),
            BatchWarmup(schedule, lr_rule="sqrt", max_micro_batch_size=4),
        )
        trainer = pl.Trainer(
            callbacks=[warmup, *callbacks], **trainer_kwargs(max_epochs=2, enable_checkpointing=bool(callbacks))
        )
        trainer.fit(module, GlobalOrderRegressionData(n=100, batch_size=2), ckpt_path=ckpt_path)
        return module, warmup

    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1, filename="{step}")
    full, full_warmup = run([checkpoint])
    assert [(c.step, c.new_micro_batch_size, c.new_accumulate) for c in full_warmup.history] == [
        (10, 4, 1),
        (19, 4, 2),
        (29, 4, 4),
    ]
    assert [len(s["indices"]) for s in full.steps if s["epoch"] == 0][-2:] == [8, 4]  # epoch 0's short last step
    full_order = [i for micro_batch in full.micro_batches for i in micro_batch]
    paths = sorted(tmp_path.glob("step=*.ckpt"), key=lambda path: int(path.stem.split("=")[1]))
    assert [int(path.stem.split("=")[1]) for path in paths] == list(
        range(3, 34, 3)
    )  # before, between and after the changes
    for path in paths:
        resumed, resumed_warmup = run(ckpt_path=path)
        assert torch.equal(resumed.layer.weight, full.layer.weight), path.name
        order = [i for micro_batch in resumed.micro_batches for i in micro_batch]
        assert order == full_order[len(full_order) - len(order) :]
        assert [s["lr"] for s in resumed.steps] == [s["lr"] for s in full.steps[len(full.steps) - len(resumed.steps) :]]
        assert resumed_warmup.history == full_warmup.history


class SaveAfterMicroBatch(pl.Callback):
    """Saves ``path`` after micro-batch ``batch_idx`` of epoch 0, wherever that falls in an optimizer step."""

    def __init__(self, path, batch_idx: int):
        self.path, self.batch_idx = path, batch_idx

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.current_epoch == 0 and batch_idx == self.batch_idx:
            trainer.save_checkpoint(self.path)


def test_resume_right_before_and_inside_an_epochs_short_last_step(tmp_path):
    # 110 samples at batch 24 (micro-batch 8 x 3): each epoch ends in a step of 14 samples, micro-batches of 8 and 6.
    def run(callbacks=(), ckpt_path=None):
        pl.seed_everything(0, verbose=False)
        module, warmup = RegressionModule(optimizer="adam"), BatchWarmup(ConstantBatch(24), max_micro_batch_size=8)
        kwargs = trainer_kwargs(max_epochs=2, enable_checkpointing=bool(callbacks))
        trainer = pl.Trainer(callbacks=[warmup, *callbacks], **kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a checkpoint inside an accumulation window is warned about
            trainer.fit(module, GlobalOrderRegressionData(n=110, batch_size=8), ckpt_path=ckpt_path)
        return module, warmup

    every_step = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    full, full_warmup = run([every_step, SaveAfterMicroBatch(tmp_path / "inside.ckpt", batch_idx=12)])
    assert [len(m) for m in full.micro_batches[:14]] == [8] * 13 + [6] and len(full.steps[4]["indices"]) == 14
    # Right before it: bit for bit, the same samples in every step.
    before, before_warmup = run(ckpt_path=tmp_path / "step=4.ckpt")
    assert before.micro_batches == full.micro_batches[12:] and torch.equal(before.layer.weight, full.layer.weight)
    assert before_warmup.accounting.samples_seen == full_warmup.accounting.samples_seen == 220
    # Inside it, after its micro-batch of 8: the data goes on with the micro-batch of 6 (the half-accumulated
    # gradient is not in a checkpoint), then the next epoch; every sample of both epochs read once.
    inside, inside_warmup = run(ckpt_path=tmp_path / "inside.ckpt")
    assert inside.micro_batches == full.micro_batches[13:] and inside_warmup.accounting.samples_seen == 220
    read = full.micro_batches[:13] + inside.micro_batches
    assert Counter(i for micro_batch in read for i in micro_batch) == Counter(list(range(110)) * 2)


def test_max_tokens_stops_training():
    trainer, module, _, warmup = fit(ConstantBatch(4), n=96, epochs=5, max_tokens=100, seq_len=4)
    # 4 samples x 4 tokens = 16 tokens per step: stops after the step that reaches 100 tokens.
    assert warmup.accounting.tokens_seen == 112 and trainer.global_step == 7


# ---------------------------------------------------------------- invariant 3: LR after changes
SCHEDULERS = {
    "none": None,
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.05 * s)),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=40, eta_min=0.01),
    "sequential": lambda opt: torch.optim.lr_scheduler.SequentialLR(
        opt,
        [
            torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=5),
            torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=30, eta_min=0.001),
        ],
        milestones=[5],
    ),
    "tokens": lambda opt: TokenLRScheduler(
        opt, WarmupStableDecay(warmup_tokens=40, total_tokens=384, decay_tokens=200)
    ),
}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
@pytest.mark.parametrize("rule", ["sqrt", "linear"])
def test_lr_after_each_change_is_rule_times_user_schedule(name, rule):
    """LR at each step = the user's schedule (from a constant-batch run) x product of rule factors."""
    factory = SCHEDULERS[name]
    schedule = PiecewiseBatch([2, 4, 8], [0, 20, 60], unit="samples")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, module, _, warmup = fit(
            schedule, lr_rule=rule, module=RegressionModule(scheduler_factory=factory), seq_len=4
        )
    assert len(warmup.history) == 2
    # The same scheduler, stepped once per optimizer step, on a constant batch, with the token
    # count the warmup run had at each step.
    reference = RegressionModule(scheduler_factory=factory)
    optimizer = torch.optim.SGD(reference.parameters(), lr=reference.lr)
    scheduler = factory(optimizer) if factory else None
    tokens = 0
    for number, step in enumerate(module.steps):
        factor = math.prod(c.lr_factor for c in warmup.history if number >= c.step)
        expected_factor = math.prod(
            (c.new_global_batch / c.old_global_batch) ** (0.5 if rule == "sqrt" else 1.0)
            for c in warmup.history
            if number >= c.step
        )
        assert factor == pytest.approx(expected_factor)
        assert step["lr"] == pytest.approx(optimizer.param_groups[0]["lr"] * factor, rel=1e-9)
        tokens += len(step["indices"]) * 4
        if scheduler is not None:
            if isinstance(scheduler, TokenLRScheduler):
                scheduler.tokens_seen = tokens
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                scheduler.step()


def test_step_indexed_scheduler_with_changing_batch_warns():
    module = RegressionModule(scheduler_factory=SCHEDULERS["cosine"])
    with pytest.warns(UserWarning, match="TokenLRScheduler"):
        fit(PiecewiseBatch([2, 4], [0, 20], unit="samples"), module=module)


def test_adam_sde_rule_rescales_betas_and_eps():
    module = RegressionModule(optimizer="adam", lr=0.01)
    schedule = PiecewiseBatch([2, 4], [0, 20], unit="samples")
    trainer, _, _, warmup = fit(schedule, lr_rule="adam_sde", module=module)
    group = trainer.optimizers[0].param_groups[0]
    assert group["lr"] == pytest.approx(0.01 * math.sqrt(2))
    assert group["betas"] == pytest.approx((1 - 2 * 0.1, 1 - 2 * 0.001))
    assert group["eps"] == pytest.approx(1e-8 / math.sqrt(2))


# ---------------------------------------------------------------- invariant 4: resume
def test_resume_mid_warmup_matches_uninterrupted_run_bitwise(tmp_path):
    """Checkpoint at each epoch end while the warmup is under way; resume from each one."""
    schedule = PiecewiseBatch([2, 4, 8], [0, 50, 140], unit="samples")
    scheduler = SCHEDULERS["sequential"]
    full_module = RegressionModule(scheduler_factory=scheduler)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1, filename="{epoch}")
    pl.seed_everything(0, verbose=False)
    full_warmup = BatchWarmup(schedule, lr_rule="sqrt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(
            callbacks=[full_warmup, checkpoint], **trainer_kwargs(max_epochs=4, enable_checkpointing=True)
        )
        trainer.fit(full_module, RegressionData(n=40, batch_size=2))
    assert [c.new_global_batch for c in full_warmup.history] == [4, 8]
    # Epoch 1 ends at 80 samples: after the first change, before the second.
    for epoch in (0, 1, 2):
        resumed_module = RegressionModule(scheduler_factory=scheduler)
        resumed_warmup = BatchWarmup(schedule, lr_rule="sqrt")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = pl.Trainer(callbacks=[resumed_warmup], **trainer_kwargs(max_epochs=4))
            trainer.fit(resumed_module, RegressionData(n=40, batch_size=2), ckpt_path=tmp_path / f"epoch={epoch}.ckpt")
        assert torch.equal(resumed_module.layer.weight, full_module.layer.weight)
        assert [s["lr"] for s in resumed_module.steps] == [
            s["lr"] for s in full_module.steps[-len(resumed_module.steps) :]
        ]
        assert resumed_warmup.history == full_warmup.history  # no change applied twice
        assert resumed_warmup.accounting.samples_seen == full_warmup.accounting.samples_seen


# ---------------------------------------------------------------- invariant 6: bad configuration
class ManualModule(RegressionModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()


class NoBatchSizeData(pl.LightningDataModule):
    def __init__(self):
        super().__init__()
        self.inner = RegressionData(n=16, batch_size=2)

    def train_dataloader(self):
        return self.inner.train_dataloader()


def _fit_expecting(error, match, schedule=None, module=None, data=None, trainer_args=None, callbacks=(), **kwargs):
    module = module or RegressionModule()
    warmup = BatchWarmup(schedule or PiecewiseBatch([2, 4], [0, 8], unit="samples"), **kwargs)
    trainer = pl.Trainer(callbacks=[warmup, *callbacks], **trainer_kwargs(**(trainer_args or {})))
    with pytest.raises(error, match=match):
        trainer.fit(module, data or RegressionData(n=16, batch_size=2))
    assert not module.steps  # failed before the first optimizer step


def test_batch_not_multiple_of_micro_batch_names_nearest_valid_sizes():
    _fit_expecting(
        ValueError,
        r"scheduled global batch 6 is not a multiple of .* = 4 samples; nearest valid sizes: 4 or 8",
        schedule=PiecewiseBatch([4, 6], [0, 8], unit="samples"),
        data=RegressionData(n=16, batch_size=4),
    )


def test_manual_optimization_is_refused():
    _fit_expecting(ValueError, "automatic optimization", module=ManualModule())


def test_conflicting_trainer_accumulation_is_refused():
    _fit_expecting(ValueError, r"accumulate_grad_batches=3\) conflicts", trainer_args={"accumulate_grad_batches": 3})


def test_gradient_accumulation_scheduler_is_refused():
    _fit_expecting(ValueError, "GradientAccumulationScheduler", callbacks=[GradientAccumulationScheduler({0: 2})])


def test_missing_micro_batch_size_is_refused():
    _fit_expecting(ValueError, "batch_size", data=NoBatchSizeData())


@pytest.mark.parametrize("kwargs", [dict(schedule=PiecewiseBatch([2, 4], [0, 64], unit="tokens")), dict(max_tokens=64)])
def test_token_settings_on_data_without_tokens_are_refused(kwargs):
    # x is a float [batch, 4] feature tensor: 4 is no sequence length.
    _fit_expecting(ValueError, "hold no token ids", **kwargs)


def test_max_micro_batch_below_micro_batch_is_refused():
    _fit_expecting(ValueError, "max_micro_batch_size=1", max_micro_batch_size=1)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(lr_rule="cubic"), ValueError, "lr_rule='cubic' is unknown"),
        (dict(max_tokens=0), ValueError, "max_tokens=0"),
        (dict(seq_len=-4), ValueError, "seq_len=-4"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        BatchWarmup(ConstantBatch(2), **kwargs)


def test_schedule_must_be_a_schedule():
    with pytest.raises(TypeError, match="lit_cbs.rules.batch_schedules"):
        BatchWarmup([2, 4])


def one_cycle(optimizer):
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=100)


def test_unsupported_scheduler_is_refused_before_training():
    _fit_expecting(
        TypeError, r"^BatchWarmup\(lr_rule='sqrt'\): OneCycleLR", module=RegressionModule(scheduler_factory=one_cycle)
    )


def test_adam_sde_beyond_the_betas_limit_is_refused_before_training():
    # Adam's default beta1 = 0.9 allows the batch to grow 10x in all: 2 -> 32 is 16x.
    _fit_expecting(
        ValueError,
        r"^BatchWarmup\(lr_rule='adam_sde'\): the batch grows 16x over its changes is above 10",
        schedule=PiecewiseBatch([2, 8, 32], [0, 8, 16], unit="samples"),
        lr_rule="adam_sde",
        module=RegressionModule(optimizer="adam"),
        data=RegressionData(n=64, batch_size=2),
    )


def test_constant_schedule_trains_one_cycle_lr_as_without_batch_warmup():
    # A constant schedule never changes the batch, so no LR is rescaled and OneCycleLR's absolute LRs stay right.
    _, module, _, warmup = fit(ConstantBatch(4), module=RegressionModule(scheduler_factory=one_cycle))
    pl.seed_everything(0, verbose=False)
    plain = RegressionModule(scheduler_factory=one_cycle)
    pl.Trainer(**trainer_kwargs(accumulate_grad_batches=2)).fit(plain, RegressionData(n=96, batch_size=2))
    assert warmup.history == [] and len(module.steps) == 24
    assert [step["lr"] for step in module.steps] == [step["lr"] for step in plain.steps]


def test_constant_schedule_resumed_at_another_batch_checks_that_change(tmp_path):
    # The checkpoint trained at 2 samples per step; resumed with ConstantBatch(4), the batch changes once,
    # which would rescale OneCycleLR's LR: refused before the resumed run's first step.
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, filename="last")
    first = pl.Trainer(
        callbacks=[BatchWarmup(ConstantBatch(2)), checkpoint], **trainer_kwargs(enable_checkpointing=True)
    )
    first.fit(RegressionModule(scheduler_factory=one_cycle), RegressionData(n=16, batch_size=2))
    resumed = RegressionModule(scheduler_factory=one_cycle)
    trainer = pl.Trainer(callbacks=[BatchWarmup(ConstantBatch(4))], **trainer_kwargs(max_epochs=2))
    with pytest.raises(TypeError, match=r"^BatchWarmup\(lr_rule='sqrt'\): OneCycleLR writes absolute LR values"):
        trainer.fit(resumed, RegressionData(n=16, batch_size=2), ckpt_path=tmp_path / "last.ckpt")
    assert not resumed.steps


def test_metrics_reach_the_logger_at_its_interval(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    pl.seed_everything(0, verbose=False)
    warmup = BatchWarmup(PiecewiseBatch([2, 4], [0, 40], unit="samples"), lr_rule="linear", seq_len=4)
    logger = CSVLogger(tmp_path, name="run", version=0)
    trainer = pl.Trainer(callbacks=[warmup], **trainer_kwargs(logger=logger, log_every_n_steps=5))
    trainer.fit(RegressionModule(), RegressionData(n=96, batch_size=2))
    import csv

    rows = [
        r
        for r in csv.DictReader((tmp_path / "run" / "version_0" / "metrics.csv").read_text().splitlines())
        if r["tokens_seen"]
    ]
    assert [int(r["step"]) for r in rows] == list(range(4, trainer.global_step, 5))
    for row in rows:
        step = int(row["step"])
        # Row s describes optimizer step s (0-based): its batch and LR, the counts including it.
        size = 4 if step >= warmup.history[0].step else 2
        assert float(row["batch/global_size"]) == size and float(row["batch/accumulate"]) == size // 2
        assert float(row["lr"]) == pytest.approx(0.05 * size / 2)
    assert float(rows[-1]["tokens_seen"]) == 4 * float(rows[-1]["samples_seen"])


def test_an_adaptive_schedule_without_a_probe_is_refused_before_the_first_step():
    # CBSAdaptive moves only on the probe's readings: without one the batch would stay 4 all run.
    module = RegressionModule()
    trainer = pl.Trainer(**trainer_kwargs(callbacks=[BatchWarmup(CBSAdaptive(4, 16, unit="samples"))]))
    with pytest.raises(
        LitCBSConfigError,
        match=r"CBSAdaptive\(start=4, final=16\).*no CBSProbeCallback.*would stay 4 for the whole run",
    ):
        trainer.fit(module, RegressionData(n=96, batch_size=2))
    assert not module.steps and trainer.global_step == 0
    # At its final batch already, there is nothing for a probe to decide.
    pl.Trainer(**trainer_kwargs(callbacks=[BatchWarmup(CBSAdaptive(4, 4, unit="samples"))])).fit(
        RegressionModule(), RegressionData(n=96, batch_size=2)
    )


def never_trains(schedule: PiecewiseBatch, data=None, **trainer_args) -> list[str]:
    """The warnings of a short run about the schedule's batches it ends before."""
    warmup = BatchWarmup(schedule, **({"seq_len": trainer_args.pop("seq_len")} if "seq_len" in trainer_args else {}))
    trainer = pl.Trainer(**trainer_kwargs(callbacks=[warmup], **trainer_args))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(RegressionModule(), data or RegressionData(n=96, batch_size=2))
    return [str(w.message) for w in caught if "never train" in str(w.message)]


def test_a_schedule_phase_the_run_ends_before_is_said_before_the_first_step():
    # One epoch of 96 samples: batch 16 from 400 samples never comes.
    (said,) = never_trains(PiecewiseBatch([4, 8, 16], [0, 40, 400], unit="samples"), max_epochs=1)
    assert said == (
        "BatchWarmup: the run ends by Trainer(max_epochs=1) (96 samples per epoch) at 96 samples, before the "
        "schedule's global batch 16 (from 400 samples): it never trains in this fit. Raise the limit, or move the "
        "schedule's thresholds (a run stopped here to resume elsewhere goes on with them)"
    )
    # 20 steps: 10 at 4, then 10 at 8 end at 120 samples, before batch 16 at 150.
    (said,) = never_trains(PiecewiseBatch([4, 8, 16], [0, 40, 150], unit="samples"), max_epochs=-1, max_steps=20)
    assert (
        "ends by Trainer(max_steps=20) at 120 samples, before the schedule's global batch 16 (from 150 samples)" in said
    )
    assert never_trains(PiecewiseBatch([4, 8], [0, 40], unit="samples"), max_epochs=1) == []  # every phase trains
    # Thresholds written in tokens for a schedule in samples: 3,072 tokens in the epoch, 2,000 "samples" never come.
    (said,) = never_trains(PiecewiseBatch([4, 8], [0, 2000], unit="samples"), max_epochs=1, seq_len=32)
    assert "at 96 samples / 3,072 tokens" in said and said.endswith(
        "read as tokens they fall inside the run: did you mean unit='tokens'?"
    )


class PlateauRegression(RegressionModule):
    """The regression with ReduceLROnPlateau on its training loss, stepped every optimizer step."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=2)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": plateau, "interval": "step", "monitor": "train_loss"},
        }


def test_a_plateau_scheduler_is_not_warned_about_as_indexed_by_steps():
    warmup = BatchWarmup(PiecewiseBatch([4, 8], [0, 40], unit="samples"), lr_rule="linear")
    trainer = pl.Trainer(**trainer_kwargs(callbacks=[warmup]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(PlateauRegression(), RegressionData(n=96, batch_size=2))
    assert [c.new_global_batch for c in warmup.history] == [8]
    assert not [w for w in caught if "indexed by optimizer steps" in str(w.message)]


def test_a_batch_decrease_is_said_like_an_increase(caplog):
    warmup = BatchWarmup(PiecewiseBatch([8, 4], [0, 40], unit="samples"), lr_rule="sqrt")
    with caplog.at_level("INFO"):
        pl.Trainer(**trainer_kwargs(callbacks=[warmup])).fit(RegressionModule(), RegressionData(n=96, batch_size=2))
    assert [(c.old_global_batch, c.new_global_batch) for c in warmup.history] == [(8, 4)]
    assert (
        "BatchWarmup: global batch 8 -> 4 samples (micro 2 -> 2, accumulate 4 -> 2) after step 5, 40 samples"
        in caplog.text
    )
    assert "LR x0.7071" in caplog.text


def test_a_loader_given_to_fit_sets_the_micro_batch_and_is_resized_only_if_it_can_be():
    from torch.utils.data import DataLoader

    from lit_cbs import GlobalOrderLoader

    schedule = PiecewiseBatch([4, 8], [0, 40], unit="samples")
    # A DataLoader of 2 samples per batch, no datamodule and no batch_size on the module: accumulation 2, then 4.
    module, warmup = RegressionModule(), BatchWarmup(schedule)
    pl.Trainer(**trainer_kwargs(callbacks=[warmup])).fit(
        module, train_dataloaders=DataLoader(IndexedRegression(96), batch_size=2)
    )
    assert [len(step["indices"]) for step in module.steps] == [4] * 10 + [8] * 7 and warmup.micro_batch_size == 2
    # Growing the micro-batch needs a loader that can change it: a DataLoader is refused before the first step ...
    module = RegressionModule()
    with pytest.raises(
        LitCBSConfigError,
        match=r"was built with batch_size=2, which a DataLoader cannot change: pass a lit_cbs.GlobalOrderLoader",
    ):
        pl.Trainer(
            **trainer_kwargs(
                callbacks=[BatchWarmup(PiecewiseBatch([4, 8], [0, 40], unit="samples"), max_micro_batch_size=4)]
            )
        ).fit(module, train_dataloaders=DataLoader(IndexedRegression(96), batch_size=2))
    assert not module.steps
    # ... and a GlobalOrderLoader given the same way grows it: micro-batch 4, then 8.
    module, warmup = RegressionModule(), BatchWarmup(schedule, max_micro_batch_size=8)
    pl.Trainer(**trainer_kwargs(callbacks=[warmup])).fit(
        module, train_dataloaders=GlobalOrderLoader(IndexedRegression(96), batch_size=2)
    )
    assert [len(step["indices"]) for step in module.steps] == [4] * 10 + [8] * 7 and warmup.micro_batch_size == 8
    assert {len(batch) for batch in module.micro_batches} == {4, 8}


# ---------------------------------------------------------------- Seesaw
SEESAW_LR = CosineSchedule(warmup_tokens=0, total_tokens=576, min_lr_ratio=0.0)  # 3 epochs of 48 samples x 4 tokens


def seesaw_fit(ckpt_path=None, callbacks=()):
    pl.seed_everything(0, verbose=False)
    module = RegressionModule(optimizer="adam", scheduler_factory=lambda opt: TokenLRScheduler(opt, SEESAW_LR))
    warmup = BatchWarmup(Seesaw(SEESAW_LR, start=2, max_batch_size=8), lr_rule="sqrt", seq_len=4)
    trainer = pl.Trainer(
        callbacks=[warmup, *callbacks], **trainer_kwargs(max_epochs=3, enable_checkpointing=bool(callbacks))
    )
    trainer.fit(module, GlobalOrderRegressionData(n=48, batch_size=2), ckpt_path=ckpt_path)
    return module, warmup


def test_seesaw_doubles_the_batch_where_the_lr_would_halve_and_resumes_exactly(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=1, filename="{step}")
    module, warmup = seesaw_fit(callbacks=[checkpoint])
    thresholds = Seesaw(SEESAW_LR, start=2, max_batch_size=8).thresholds  # where the cosine reaches 1/2 and 1/4
    assert [(c.old_global_batch, c.new_global_batch) for c in warmup.history] == [(2, 4), (4, 8)]
    for change, threshold in zip(warmup.history, thresholds[1:]):
        # Asked for at the first step past the threshold, applied within one more step of the old batch.
        step_tokens = change.old_global_batch * 4
        assert threshold <= change.requested_at_tokens < threshold + step_tokens
        assert change.tokens_seen - change.requested_at_tokens <= step_tokens
    # Every step's LR is the cosine's at the tokens before it, times sqrt(2) per doubling so far:
    # where the schedule alone halves the LR, the batch doubles and the LR falls by 1/sqrt(2) only.
    tokens = 0
    for step in module.steps:
        batch = len(step["indices"])
        if SEESAW_LR(tokens) > 0:
            assert step["lr"] == pytest.approx(0.05 * SEESAW_LR(tokens) * math.sqrt(batch / 2), rel=1e-12)
        tokens += batch * 4
    assert tokens == 576 and [len(s["indices"]) for s in module.steps][-1] == 8
    for step in (5, warmup.history[0].step + 1, warmup.history[1].step + 1):
        resumed, _ = seesaw_fit(ckpt_path=tmp_path / f"step={step}.ckpt")
        assert torch.equal(resumed.layer.weight, module.layer.weight)
        assert [s["lr"] for s in resumed.steps] == [s["lr"] for s in module.steps[step:]]
