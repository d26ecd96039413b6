"""The optimizer settings beside the LR that a batch change moves (weight decay, beta2), on real
Trainers with a real AdamW: at every change, in every probe branch, undone exactly by the guard,
restored exactly on resume, logged per step; refused before training where they cannot apply."""

from __future__ import annotations

import csv
import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from toys import GlobalOrderRegressionData, RegressionModule, trainer_kwargs

from lit_cbs import BatchWarmup, CBSProbeCallback, ConstantBatch, LitCBSConfigError, PiecewiseBatch
from lit_cbs.callbacks.accounting import BatchAccounting
from lit_cbs.rules.scaling import OptimizerRules

LR, WD, BETA2 = 0.01, 0.1, 0.99  # beta2 ** 4 = 0.9606 stays above the default floor, 0.95
SCHEDULE = PiecewiseBatch([2, 4], [0, 40], unit="samples")  # 20 steps of 2 samples, then 4
RULES = dict(lr_rule="sqrt", weight_decay_rule="timescale", beta2_rule="half_life")


class AdamWRegression(RegressionModule):
    """The toy regression under AdamW, with OLMo's two param groups (decay, and none for the bias);
    records each optimizer step's settings, the probe branches' steps apart."""

    def __init__(self, optimizer=None, **kwargs):
        super().__init__(**kwargs)
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
        self.make_optimizer = optimizer
        self.settings: list[tuple[float, float, float, float]] = []  # (lr, weight decay, no-decay group's, beta2)
        self.branch_settings: set[tuple[float, float, float]] = set()  # (lr, weight decay, beta2)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.mse_loss(self.layer(batch["x"]) + self.bias, batch["y"])

    def on_before_optimizer_step(self, optimizer):
        decay, no_decay = optimizer.param_groups
        if BatchAccounting.attach(self.trainer).in_branch:
            self.branch_settings.add((decay["lr"], decay["weight_decay"], decay["betas"][1]))
            return
        super().on_before_optimizer_step(optimizer)
        self.settings.append((decay["lr"], decay["weight_decay"], no_decay["weight_decay"], decay["betas"][1]))

    def configure_optimizers(self):
        groups = [{"params": [self.layer.weight]}, {"params": [self.bias], "weight_decay": 0.0}]
        if self.make_optimizer is not None:
            return self.make_optimizer(groups)
        return torch.optim.AdamW(groups, lr=LR, betas=(0.9, BETA2), weight_decay=WD)


def fit(warmup, *, module=None, callbacks=(), epochs=2, ckpt_path=None, warned=None, **trainer_args):
    """Train the toy under ``warmup``; the warnings' texts go to the list ``warned`` if one is given."""
    pl.seed_everything(0, verbose=False)
    module = module or AdamWRegression()
    trainer = pl.Trainer(callbacks=[warmup, *callbacks], **trainer_kwargs(max_epochs=epochs, **trainer_args))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, GlobalOrderRegressionData(n=48, batch_size=2), ckpt_path=ckpt_path)
    if warned is not None:
        warned.extend(str(warning.message) for warning in caught)
    return trainer, module


def test_a_doubling_moves_weight_decay_and_beta2_and_the_checkpoint_holds_them(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=1, filename="{step}")
    logger = CSVLogger(tmp_path, name="run", version=0)
    warmup = BatchWarmup(SCHEDULE, **RULES)
    trainer, module = fit(warmup, callbacks=[checkpoint], logger=logger, log_every_n_steps=1, enable_checkpointing=True)
    before, after = (LR, WD, 0.0, BETA2), (LR * math.sqrt(2), WD * 2 / math.sqrt(2), 0.0, BETA2**2)
    # 48 samples per epoch: 20 steps of 2, then 2 of 4 in epoch 0 and 12 of 4 in epoch 1.
    assert module.settings == [before] * 20 + [pytest.approx(after)] * 14
    groups = torch.load(tmp_path / "step=34.ckpt", weights_only=True)["optimizer_states"][0]["param_groups"]
    assert groups[0]["weight_decay"] == pytest.approx(0.1 * math.sqrt(2)) and groups[1]["weight_decay"] == 0.0
    assert groups[0]["betas"][1] == pytest.approx(BETA2**2) and groups[0]["betas"][0] == 0.9
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as file:
        rows = [row for row in csv.DictReader(file) if row["batch/global_size"]]
    assert [(float(r["batch/weight_decay"]), float(r["batch/beta2"])) for r in (rows[19], rows[20])] == [
        (WD, BETA2),
        pytest.approx((0.1 * math.sqrt(2), BETA2**2)),
    ]

    # Resumed before and after the change, the run goes on with the settings it would have had.
    for step in (10, 20, 25):
        resumed = AdamWRegression()
        fit(BatchWarmup(SCHEDULE, **RULES), module=resumed, ckpt_path=tmp_path / f"step={step}.ckpt")
        assert resumed.settings == module.settings[step:]
        assert torch.equal(resumed.layer.weight, module.layer.weight)


def test_probe_branches_train_with_the_rules_of_their_batch_and_leave_the_run_alone():
    probe = CBSProbeCallback(every_tokens=80, multipliers=(1, 2, 4), window_tokens=64, **RULES)
    plain, probed = AdamWRegression(), AdamWRegression()
    fit(BatchWarmup(ConstantBatch(4), seq_len=4, **RULES), module=plain)
    fit(BatchWarmup(ConstantBatch(4), seq_len=4, **RULES), module=probed, callbacks=[probe])
    assert probe.history and probed.settings == plain.settings
    assert torch.equal(probed.layer.weight, plain.layer.weight)
    expected = {(LR * math.sqrt(k), WD * k / math.sqrt(k), BETA2**k) for k in (1, 2, 4)}
    assert {tuple(round(v, 12) for v in s) for s in probed.branch_settings} == {
        tuple(round(v, 12) for v in s) for s in expected
    }


def test_the_beta2_floor_holds_in_the_run_and_in_every_branch_and_is_said_once_by_each(tmp_path):
    floor = 0.985  # above BETA2 ** 2 = 0.9801
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=1, filename="{step}")
    probe = CBSProbeCallback(every_tokens=80, multipliers=(1, 2, 4), window_tokens=64, beta2_floor=floor, **RULES)
    warmup, warned = BatchWarmup(SCHEDULE, seq_len=4, beta2_floor=floor, **RULES), []
    _, module = fit(warmup, callbacks=[probe, checkpoint], enable_checkpointing=True, warned=warned)
    assert probe.history and [s[3] for s in module.settings] == [BETA2] * 20 + [floor] * 14
    # k = 2, 4 from BETA2 stop at the floor, as every k from the floor after the change does.
    assert {s[2] for s in module.branch_settings} == {BETA2, floor}
    groups = torch.load(tmp_path / "step=34.ckpt", weights_only=True)["optimizer_states"][0]["param_groups"]
    assert [group["betas"][1] for group in groups] == [floor, floor]
    held = "would take beta2 from 0.99 to 0.9801 (0.99 ** 2), below beta2_floor=0.985, so it stays at 0.985"
    fix = "set beta2_floor lower (or None) to let it fall"
    assert sorted(text for text in warned if "beta2_floor" in text) == [
        f"BatchWarmup: beta2_rule='half_life' {held}; {fix}",
        f"CBSProbeCallback, branch k=2: beta2_rule='half_life' {held}; {fix}",
    ]


@pytest.mark.parametrize("beta2_floor", [0.95, 0.985])  # the default, and a floor that holds at the increase
def test_the_guards_revert_restores_weight_decay_and_beta2_exactly(beta2_floor):
    class SpikeAfterIncrease(AdamWRegression):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss + 3.0 if self.trainer.accumulate_grad_batches > 1 else loss

    guard = {"hold": 100_000, "min_steps": 4, "threshold": 1.0}
    warmup = BatchWarmup(SCHEDULE, guard=guard, beta2_floor=beta2_floor, **RULES)
    _, module = fit(warmup, module=SpikeAfterIncrease(), epochs=3)
    increase, revert = warmup.history
    assert revert.cause == "guard" and revert.new_global_batch == 2
    assert module.settings[increase.step][3] == max(BETA2**2, beta2_floor)
    reverted_at = revert.step
    assert module.settings[reverted_at:] == [(LR, WD, 0.0, BETA2)] * (len(module.settings) - reverted_at)  # bitwise


# ---------------------------------------------------------------- refused before training
class FailingFirstStep(Callback):
    def on_train_batch_start(self, *args):
        raise AssertionError("training started")


@pytest.mark.parametrize(
    "optimizer, rules, message",
    [
        (
            lambda groups: torch.optim.SGD(groups, lr=LR, weight_decay=WD),
            {"beta2_rule": "half_life"},
            r"^BatchWarmup\(lr_rule='sqrt', beta2_rule='half_life', beta2_floor=0.95\): param group 0 of SGD has no",
        ),
        (
            lambda groups: torch.optim.AdamW(groups, lr=LR, weight_decay=0.0),
            {"weight_decay_rule": "timescale"},
            r"every param group of AdamW has weight_decay=0, so the rule would change nothing",
        ),
        (
            lambda groups: torch.optim.Adam(groups, lr=LR, weight_decay=WD),
            {"weight_decay_rule": "timescale"},
            r"Adam's weight_decay is an L2 penalty .* use torch.optim.AdamW",
        ),
    ],
)
def test_rules_that_do_not_apply_to_the_optimizer_are_refused_before_training(optimizer, rules, message):
    with pytest.raises(LitCBSConfigError, match=message):
        fit(BatchWarmup(SCHEDULE, **rules), module=AdamWRegression(optimizer=optimizer), callbacks=[FailingFirstStep()])


def test_conflicting_or_unknown_rules_are_refused_at_construction():
    with pytest.raises(LitCBSConfigError, match=r"lr_rule='adam_sde' already moves beta2"):
        BatchWarmup(SCHEDULE, lr_rule="adam_sde", beta2_rule="half_life")
    with pytest.raises(LitCBSConfigError, match=r"weight_decay_rule='linear' is unknown; use one of \['timescale'\]"):
        BatchWarmup(SCHEDULE, weight_decay_rule="linear")
    assert OptimizerRules.build("sqrt", "none", None).settings == []


def test_a_probe_whose_rules_differ_from_the_warmups_is_refused():
    probe = CBSProbeCallback(every_tokens=80, multipliers=(1, 2), window_tokens=64, lr_rule="sqrt")
    with pytest.raises(
        LitCBSConfigError,
        match=r"CBSProbeCallback\(lr_rule='sqrt'\) and BatchWarmup\(lr_rule='sqrt', "
        r"weight_decay_rule='timescale', beta2_rule='half_life', beta2_floor=0.95\) move the optimizer differently",
    ):
        fit(BatchWarmup(SCHEDULE, seq_len=4, **RULES), callbacks=[probe, FailingFirstStep()])


def test_another_writer_of_a_ruled_setting_is_caught_at_its_step():
    class WeightDecaySchedule(Callback):
        def on_train_batch_start(self, trainer, *args):
            if trainer.global_step == 3:
                trainer.optimizers[0].param_groups[0]["weight_decay"] = 0.05

    with pytest.raises(
        LitCBSConfigError,
        match=r"BatchWarmup\(weight_decay_rule='timescale'\) set weight_decay=0.1 in param "
        r"group 0, but at step 3 it is 0.05: something else writes it",
    ):
        fit(BatchWarmup(SCHEDULE, **RULES), callbacks=[WeightDecaySchedule()])


def test_rules_beside_a_schedule_that_never_changes_the_batch_are_said_to_do_nothing():
    with pytest.warns(
        UserWarning,
        match=r"ConstantBatch\(size=2, unit='samples'\) never changes the batch from 2, so "
        r"weight_decay_rule and beta2_rule never act",
    ):
        pl.seed_everything(0, verbose=False)
        pl.Trainer(callbacks=[BatchWarmup(ConstantBatch(2), **RULES)], **trainer_kwargs(max_steps=1)).fit(
            AdamWRegression(), GlobalOrderRegressionData(n=8, batch_size=2)
        )
