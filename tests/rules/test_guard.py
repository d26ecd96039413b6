"""BatchWarmup's guard and clip_rule on real Trainers: a loss that jumps after an increase is reverted
once, exactly (batch, LR, clipping, logged rows); a healthy run is left alone; resume is exact; the
hold is respected; CBSAdaptive's doubling is withdrawn; bad settings fail before training."""

from __future__ import annotations

import csv
import math

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from toys import GlobalOrderRegressionData, RegressionData, RegressionModule, mean_gradient, trainer_kwargs

from lit_cbs import (
    BatchWarmup,
    CBSAdaptive,
    ConstantBatch,
    LitCBSConfigError,
    PiecewiseBatch,
)
from lit_cbs._internals import should_accumulate
from lit_cbs.rules.guard import BatchGuard, RevertRestore

# 2 samples per step until 64 samples (32 steps), then 4: the guard fits the trend on samples (32, 64]
# (16 steps), and with min_steps=8 judges the increase after 8 steps of 4, at 96 samples.
SCHEDULE = PiecewiseBatch([2, 4], [0, 64], unit="samples")
NO_RETRY = {"hold": 100_000}  # samples: no second try within these runs


class SpikeAfterIncrease(RegressionModule):
    """Reports a loss ``jump`` nats higher while a step accumulates micro-batches (a batch above 2) and
    ``steps_left`` allows; the gradient is the regression's own."""

    def __init__(self, jump: float = 3.0, **kwargs):
        super().__init__(**kwargs)
        self.jump = jump
        self.clip_values: list[float] = []  # the Trainer's gradient_clip_val at each optimizer step

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss + self.jump if self.trainer.accumulate_grad_batches > 1 else loss

    def on_before_optimizer_step(self, optimizer):
        super().on_before_optimizer_step(optimizer)
        self.clip_values.append(self.trainer.gradient_clip_val)


def fit(warmup, *, module=None, n=96, epochs=3, ckpt_path=None, **trainer_args):
    pl.seed_everything(0, verbose=False)
    module = module or SpikeAfterIncrease()
    trainer = pl.Trainer(
        callbacks=[warmup, *trainer_args.pop("callbacks", [])], **trainer_kwargs(max_epochs=epochs, **trainer_args)
    )
    trainer.fit(module, RegressionData(n=n, batch_size=2), ckpt_path=ckpt_path)
    return trainer, module


def rows_of(path) -> dict[int, dict[str, float]]:
    rows: dict[int, dict[str, float]] = {}
    with open(path) as file:
        lines = list(csv.DictReader(file))
    for row in lines:
        rows.setdefault(int(row["step"]), {}).update({k: float(v) for k, v in row.items() if v and k != "step"})
    return rows


# ---------------------------------------------------------------- the rule itself
def test_trend_and_rise_of_points_on_a_line():
    guard = BatchGuard(watch_span=30, fit=40, min_steps=3)
    for t in (10, 20, 30, 40):
        guard.record(t, 3.0 - 0.5 * math.log(t))
    assert guard.watch(0, 40, 2, 4, RevertRestore(1.0, 1.0, 1.0, 1.0))
    for t in (50, 60, 70):
        guard.record(t, 3.0 - 0.5 * math.log(t) + 0.2)
    verdict = guard.judge(70, lambda losses: losses)
    trend = (verdict.rise, verdict.trend_intercept, verdict.trend_slope, verdict.residual_std)
    assert trend == pytest.approx((0.2, 3.0, -0.5, 0.0), abs=1e-12) and verdict.fit_steps == 4


# ---------------------------------------------------------------- a forced spike
def test_a_loss_jump_after_the_increase_is_reverted_once_exactly(tmp_path):
    logger = CSVLogger(tmp_path, name="run", version=0)
    warmup = BatchWarmup(SCHEDULE, lr_rule="linear", guard={**NO_RETRY, "min_steps": 8})
    _, module = fit(warmup, logger=logger, log_every_n_steps=5)
    increase, revert = warmup.history
    assert (increase.old_global_batch, increase.new_global_batch, increase.cause) == (2, 4, "schedule")
    assert (revert.old_global_batch, revert.new_global_batch, revert.cause) == (4, 2, "guard")
    assert (revert.old_accumulate, revert.new_accumulate, revert.new_micro_batch_size) == (2, 1, 2)
    # Judged after 8 steps of 4 samples (64 -> 96 samples), reverted right there.
    assert (increase.samples_seen, revert.samples_seen, revert.step) == (64, 96, 40)
    (verdict,) = warmup.guard.verdicts
    assert verdict.reverted and verdict.watch_steps == 8 and verdict.fit_steps == 16
    # The same run without the jump trains alike up to the verdict: the jump is exactly what it adds.
    healthy = BatchWarmup(SCHEDULE, lr_rule="linear", guard={**NO_RETRY, "min_steps": 8})
    fit(healthy, module=SpikeAfterIncrease(jump=0.0))
    assert verdict.rise - healthy.guard.verdicts[0].rise == pytest.approx(3.0, abs=1e-9)
    assert not healthy.guard.verdicts[0].reverted and verdict.threshold == healthy.guard.verdicts[0].threshold
    # Every step after the revert trains 2 samples at the base LR, as before the increase.
    assert [len(s["indices"]) for s in module.steps] == [2] * 32 + [4] * 8 + [2] * (len(module.steps) - 40)
    assert [s["lr"] for s in module.steps] == [0.05] * 32 + [0.1] * 8 + [0.05] * (len(module.steps) - 40)
    assert revert.lr_factor == 0.5 and warmup.lr_factor == 1.0 and warmup.guard.reverts == 1
    assert warmup.guard.hold_until == 96 + 100_000
    rows = rows_of(tmp_path / "run" / "version_0" / "metrics.csv")
    # The decision's own row (step 39, the window's last step) holds the verdict although 39 % 5 != 4.
    assert rows[39]["batch/guard_rise"] == pytest.approx(verdict.rise) and rows[39][
        "batch/guard_threshold"
    ] == pytest.approx(verdict.threshold)
    assert [(rows[s]["batch/global_size"], rows[s]["batch/guard_reverts"]) for s in (34, 39, 44)] == [
        (4, 0),
        (4, 0),
        (2, 1),
    ]


class SpikeOnLargeMicroBatches(SpikeAfterIncrease):
    """Reports a loss ``jump`` nats higher on micro-batches above 2 samples (the gradient is the regression's)."""

    def training_step(self, batch, batch_idx):
        loss = RegressionModule.training_step(self, batch, batch_idx)
        return loss + self.jump if len(batch["idx"]) > 2 else loss


def test_a_revert_brings_the_micro_batch_back_mid_epoch():
    warmup = BatchWarmup(SCHEDULE, lr_rule="linear", guard={**NO_RETRY, "min_steps": 8}, max_micro_batch_size=4)
    module, data = SpikeOnLargeMicroBatches(), GlobalOrderRegressionData(n=96, batch_size=2)
    pl.seed_everything(0, verbose=False)
    pl.Trainer(callbacks=[warmup], **trainer_kwargs(max_epochs=2)).fit(module, data)
    increase, revert = warmup.history
    assert [(c.new_global_batch, c.new_micro_batch_size, c.new_accumulate, c.samples_seen) for c in warmup.history] == [
        (4, 4, 1, 64),
        (2, 2, 1, 96),
    ]
    assert revert.cause == "guard" and warmup.guard.verdicts[0].reverted
    # The micro-batch grew to 4 with the batch and went back to 2 with the revert, inside the first epoch.
    assert [len(micro_batch) for micro_batch in module.micro_batches[:42]] == [2] * 32 + [4] * 8 + [2] * 2
    seen = [i for micro_batch in module.micro_batches for i in micro_batch]
    assert seen == data.epoch_order(0) + data.epoch_order(1)
    for step in module.steps:
        torch.testing.assert_close(
            step["grad"], mean_gradient(data.dataset, step["indices"], step["weight"]), rtol=1e-10, atol=1e-12
        )


def test_a_healthy_increase_is_judged_and_kept():
    warmup = BatchWarmup(PiecewiseBatch([2, 4, 8], [0, 64, 160], unit="samples"), lr_rule="linear", guard=True)
    fit(warmup, module=SpikeAfterIncrease(jump=0.0), epochs=4)
    assert [(c.new_global_batch, c.cause) for c in warmup.history] == [(4, "schedule"), (8, "schedule")]
    assert [v.reverted for v in warmup.guard.verdicts] == [False, False]
    assert all(v.rise < v.threshold for v in warmup.guard.verdicts) and warmup.guard.reverts == 0


def test_without_a_guard_the_jump_stays():
    warmup = BatchWarmup(SCHEDULE, lr_rule="linear")
    fit(warmup)
    assert [c.new_global_batch for c in warmup.history] == [4] and warmup.guard is None


# ---------------------------------------------------------------- hold, and one increase judged at a time
def test_the_next_increase_waits_for_the_window_and_the_hold():
    # 8 is scheduled from 80 samples, inside 4's window: it waits for the verdict; the verdict reverts
    # to 2, and nothing grows until 96 + hold = 136 samples; then 2 -> 8 directly (the schedule's size).
    warmup = BatchWarmup(
        PiecewiseBatch([2, 4, 8], [0, 64, 80], unit="samples"), lr_rule="linear", guard={"hold": 40, "min_steps": 8}
    )
    fit(warmup, epochs=3)
    sizes = [(c.old_global_batch, c.new_global_batch, c.cause, c.samples_seen) for c in warmup.history]
    assert sizes[:3] == [(2, 4, "schedule", 64), (4, 2, "guard", 96), (2, 8, "schedule", 136)]
    # The jump comes back with accumulation, so 2 -> 8 is reverted too, and the hold doubles as set.
    assert sizes[3][:3] == (8, 2, "guard") and warmup.guard.hold_until == sizes[3][3] + 40


def test_a_schedule_decrease_inside_a_window_ends_it_without_a_verdict():
    warmup = BatchWarmup(PiecewiseBatch([2, 4, 2], [0, 64, 80], unit="samples"), lr_rule="linear", guard=True)
    fit(warmup)
    assert [(c.new_global_batch, c.cause) for c in warmup.history] == [(4, "schedule"), (2, "schedule")]
    assert warmup.guard.verdicts == [] and not warmup.guard.watching


# ---------------------------------------------------------------- resume
@pytest.mark.parametrize("epoch", [0, 1])  # 96 samples: inside the window (64 to 128); 192: inside the hold
def test_a_run_resumed_around_a_revert_continues_bit_for_bit(tmp_path, epoch):
    def warmup():
        return BatchWarmup(SCHEDULE, lr_rule="sqrt", clip_rule="sqrt", guard={"watch_span": 64, "hold": 100})

    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    full = warmup()
    _, full_module = fit(full, epochs=4, callbacks=[checkpoint], enable_checkpointing=True, gradient_clip_val=0.5)
    assert [(c.cause, c.samples_seen) for c in full.history][:3] == [
        ("schedule", 64),
        ("guard", 128),
        ("schedule", 228),
    ]
    resumed = warmup()
    _, resumed_module = fit(resumed, epochs=4, ckpt_path=tmp_path / f"epoch={epoch}.ckpt", gradient_clip_val=0.5)
    assert torch.equal(resumed_module.layer.weight, full_module.layer.weight)
    assert resumed.history == full.history and resumed.guard.verdicts == full.guard.verdicts
    resumed_steps = len(resumed_module.steps)
    assert [s["lr"] for s in resumed_module.steps] == [s["lr"] for s in full_module.steps[-resumed_steps:]]
    assert resumed_module.clip_values == full_module.clip_values[-resumed_steps:]


# ---------------------------------------------------------------- clip_rule
def test_clip_rule_scales_gradient_clipping_and_a_revert_restores_it(tmp_path):
    logger = CSVLogger(tmp_path, name="run", version=0)
    kept = BatchWarmup(PiecewiseBatch([2, 4, 8], [0, 32, 96], unit="samples"), clip_rule="sqrt")
    _, module = fit(
        kept, module=SpikeAfterIncrease(jump=0.0), gradient_clip_val=0.5, logger=logger, log_every_n_steps=1
    )
    first, second = (c.step for c in kept.history)
    expected = (
        [0.5] * first
        + [0.5 * math.sqrt(2)] * (second - first)
        + [0.5 * math.sqrt(2) * math.sqrt(2)] * (len(module.steps) - second)
    )
    assert module.clip_values == pytest.approx(expected, rel=1e-15)
    assert [c.clip_factor for c in kept.history] == pytest.approx([math.sqrt(2)] * 2)
    rows = rows_of(tmp_path / "run" / "version_0" / "metrics.csv")
    assert [rows[s]["batch/gradient_clip_val"] for s in sorted(rows)] == pytest.approx(expected, rel=1e-7)

    reverted = BatchWarmup(SCHEDULE, clip_rule=lambda ratio: 3.0, guard=NO_RETRY)
    _, module = fit(reverted, gradient_clip_val=0.5)
    assert module.clip_values == [0.5] * 32 + [1.5] * 8 + [0.5] * (len(module.steps) - 40)


# ---------------------------------------------------------------- CBSAdaptive
class DoubleWhenTold(Callback):
    """Tells a CBSAdaptive schedule, at the given samples, that the CBS is far above the batch (as
    CBSProbeCallback does after a probe)."""

    feeds_cbs_adaptive = True  # what BatchWarmup looks for beside a CBSAdaptive schedule

    def __init__(self, at_samples):
        self.at_samples = list(at_samples)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        warmup = next(cb for cb in trainer.callbacks if isinstance(cb, BatchWarmup))
        if self.at_samples and warmup.accounting.samples_seen >= self.at_samples[0] and not should_accumulate(trainer):
            self.at_samples.pop(0)
            warmup.schedule.observe(warmup.consumed, cbs=1_000.0)


def test_a_reverted_cbs_adaptive_doubling_is_withdrawn():
    # Told at 64 samples: 2 -> 4 (at the next aligned step, 68), reverted after its window; the schedule
    # forgets the doubling, so the batch stays 2 after the hold ends (164). Told again at 200: 2 -> 4
    # again, reverted again (the jump comes back), and that doubling is forgotten too.
    schedule = CBSAdaptive(start=2, final=8, unit="samples")
    warmup = BatchWarmup(schedule, lr_rule="linear", guard={"hold": 64})
    fit(warmup, callbacks=[DoubleWhenTold([64, 200])], epochs=3)
    increase, revert, again = warmup.history[:3]
    assert [(c.new_global_batch, c.cause) for c in (increase, revert, again)] == [
        (4, "schedule"),
        (2, "guard"),
        (4, "schedule"),
    ]
    assert revert.samples_seen + 64 < 200 <= again.requested_at_samples
    assert [c.cause for c in warmup.history] == ["schedule", "guard"] * 2
    assert schedule.decisions == [] and warmup.global_batch == 2


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "guard, match",
    [
        ({"watch_span": 0}, r"guard.watch_span=0 must be a positive int or None \(samples or tokens"),
        ({"watch_span": -5}, r"guard.watch_span=-5"),
        ({"threshold": 0.0}, r"guard.threshold=0.0 must be a finite number > 0 or None \(nats"),
        ({"threshold": -0.1}, r"guard.threshold=-0.1"),
        ({"min_steps": 2}, r"guard.min_steps=2 must be >= 3"),
        ({"windw": 100, "hold": 5}, r"unknown setting\(s\) windw; the settings are watch_span, fit, hold"),
        ("yes", r"guard='yes' must be true, false, null, a dict"),
    ],
)
def test_bad_guard_settings_fail_at_construction(guard, match):
    with pytest.raises(LitCBSConfigError, match=match):
        BatchWarmup(SCHEDULE, guard=guard)


def settings(guard: BatchGuard) -> tuple:
    return guard.watch_span, guard.fit, guard.hold, guard.threshold, guard.noise_multiple, guard.min_threshold


def test_guard_settings_read_from_a_dict_and_defaults():
    assert BatchGuard.from_setting(None) is None and BatchGuard.from_setting(False) is None
    defaults = BatchGuard.from_setting(True)
    assert settings(defaults) == (None, None, None, None, 2.0, 0.05) and defaults.min_steps == 8
    from_dict = BatchGuard.from_setting({"watch_span": 1_000, "threshold": 0.1})
    assert settings(from_dict) == settings(BatchGuard(watch_span=1_000, threshold=0.1))


@pytest.mark.parametrize(
    "settings, match",
    [
        (
            {"watch_span": 0},
            r"^guard.watch_span=0 must be a positive int or None \(samples or tokens, the schedule's unit\)$",
        ),
        ({"fit": 2.5}, r"^guard.fit=2.5 must be a positive int or None"),
        ({"hold": -1}, r"^guard.hold=-1 must be a positive int or None"),
        (
            {"threshold": float("nan")},
            r"^guard.threshold=nan must be a finite number > 0 or None \(nats of training loss\)$",
        ),
        ({"noise_multiple": 0}, r"^guard.noise_multiple=0 must be a finite number > 0 \(standard deviations"),
        ({"min_threshold": -0.1}, r"^guard.min_threshold=-0.1 must be a finite number > 0 \(nats"),
        ({"min_steps": 2}, r"^guard.min_steps=2 must be >= 3 \(a line through 2 points has no residual spread\)$"),
    ],
)
def test_the_guard_names_the_setting_it_refuses(settings, match):
    with pytest.raises(LitCBSConfigError, match=match):
        BatchGuard(**settings)


@pytest.mark.parametrize("guard", [BatchGuard(), 0.5], ids=["a BatchGuard", "a number"])
def test_guard_takes_true_or_a_dict_only(guard):
    with pytest.raises(LitCBSConfigError, match=r"must be true, false, null, a dict of the settings watch_span, fit"):
        BatchWarmup(SCHEDULE, guard=guard)


def watched_guard() -> BatchGuard:
    """A pure guard that watched an increase at 16 (of 8 steps on a falling trend before it) and has
    just judged it, 8 steps of a loss 1 nat above the trend later: a revert is due."""
    guard = BatchGuard(min_steps=4, watch_span=8)
    for consumed in range(1, 17):
        guard.record(consumed, 3.0 - 0.5 * math.log(consumed))
    restore = RevertRestore(1.0, 1.0, 2.0, 1.5, [[{"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}]])
    assert guard.watch(0, 16, old_global_batch=2, new_global_batch=4, restore=restore)
    for consumed in range(17, 25):
        guard.record(consumed, 4.0 - 0.5 * math.log(consumed))
    verdict = guard.judge(24, lambda values: values)
    assert verdict.reverted and guard.revert_to == 2
    return guard


def test_the_restore_of_a_watched_increase_round_trips_through_the_checkpoint(tmp_path):
    # A real run stopped while the guard watches 2 -> 4 (applied at 64 samples, watched until 128).
    warmup = BatchWarmup(SCHEDULE, lr_rule="sqrt", guard={"watch_span": 64, **NO_RETRY})
    fit(warmup, epochs=1)
    assert warmup.guard.watching
    torch.save(warmup.guard.state_dict(), tmp_path / "guard.pt")
    loaded = BatchGuard(watch_span=64)
    loaded.load_state_dict(torch.load(tmp_path / "guard.pt", weights_only=True))  # plain data: no pickled classes
    assert loaded.state_dict() == warmup.guard.state_dict()
    restore = loaded._watch.restore
    assert isinstance(restore, RevertRestore) and restore == warmup.guard._watch.restore
    assert (restore.lr_factor, restore.lr_factor_of_change, restore.clip_factor_of_change) == (
        1.0,
        pytest.approx(2**0.5),
        1.0,
    )
    assert restore.optimizer_settings == [[{"weight_decay": 0}]]  # the toy's SGD: one optimizer, one param group


def test_a_watch_saved_before_the_watch_span_was_named_loads():
    # The first guards kept the watch's restore without optimizer settings.
    state = watched_guard().state_dict()
    del state["revert"]["restore"]["optimizer_settings"]
    guard = BatchGuard(min_steps=4)
    guard.load_state_dict(state)
    assert guard.revert_to == 2 and guard.mark_reverted(24) == RevertRestore(1.0, 1.0, 2.0, 1.5, None)


@pytest.mark.parametrize(
    "clip_rule, match", [("cubic", r"clip_rule='cubic' is unknown"), (3, r"clip_rule must be one of")]
)
def test_unknown_clip_rule_fails_at_construction(clip_rule, match):
    with pytest.raises(LitCBSConfigError, match=match):
        BatchWarmup(SCHEDULE, clip_rule=clip_rule)


def test_clip_rule_without_gradient_clipping_fails_before_training():
    module = SpikeAfterIncrease()
    with pytest.raises(
        LitCBSConfigError, match=r"clip_rule='sqrt'.*gradient_clip_val=None\) sets none: set gradient_clip_val"
    ):
        fit(BatchWarmup(SCHEDULE, clip_rule="sqrt"), module=module)
    assert not module.steps
    fit(BatchWarmup(ConstantBatch(2), clip_rule="none"), module=module, epochs=1)  # "none": no threshold needed
    assert module.steps
