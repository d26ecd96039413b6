"""Probe branches (lit_cbs.probe.branch) on a real Trainer: they train through the module's hooks,
leave the main run untouched, fail alone (divergence, out of memory, an exception, SIGTERM) and
regroup, cool down and check the LR as the run's steps would."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, OnExceptionCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torchmetrics import MeanMetric
from toys import (
    SEQ,
    GlobalOrderRegressionData,
    RegressionModule,
    assert_same_main_run,
    fit_regression,
    fit_regression_with_val,
    read_csv,
    toy_probe,
    trainer_kwargs,
)

from lit_cbs import BatchWarmup, CBSProbeCallback, PiecewiseBatch
from lit_cbs.callbacks.accounting import BatchAccounting
from lit_cbs.errors import LitCBSConfigError
from lit_cbs.probe.branch import ProbeUnusable, cooldown_factor, lr_scaled_for_step
from lit_cbs.probe.reading import read_readings


def test_probe_leaves_main_run_untouched_and_k1_branch_reproduces_it(tmp_path):
    plain = fit_regression()
    rng_plain = torch.get_rng_state()
    probe = toy_probe(output_dir=tmp_path)
    probed = fit_regression(probe=probe)
    assert torch.equal(torch.get_rng_state(), rng_plain)
    assert_same_main_run(plain, probed)
    assert len(probe.history) >= 3
    for record in probe.history:
        # The k=1 branch trains from the snapshot on the recorded window: it repeats the main run's
        # computation exactly (the losses differ at most in float64 rounding of the bookkeeping).
        assert record.losses["1"] == pytest.approx(record.main_loss, rel=1e-12)
        assert record.branches_trained == [1.0, 2.0, 4.0]
        assert record.tokens_spent == 3 * record.window_tokens
        assert (record.batch_size, record.seq_len) == (4, SEQ)
    lines = (tmp_path / "cbs_probe.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [r.to_record() for r in probe.history]
    assert read_readings(tmp_path / "cbs_probe.jsonl") == probe.history
    assert (tmp_path / "cbs_curve.png").stat().st_size > 10_000
    assert probe.tokens_spent == sum(r.tokens_spent for r in probe.history)


class MetricInTrainingStep(RegressionModule):
    """Updates a torchmetrics metric in training_step, which branches also call."""

    def __init__(self):
        super().__init__(lr=0.05, optimizer="adam")
        self.train_loss = MeanMetric()
        self.logged: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.train_loss.update(loss.detach())
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if not self.trainer.fit_loop.epoch_loop._should_accumulate():
            self.logged.append(float(self.train_loss.compute()))
            self.train_loss.reset()


def test_metric_state_updated_by_branches_is_restored():
    plain = fit_regression(module=MetricInTrainingStep())
    probe = toy_probe()
    probed = fit_regression(probe=probe, module=MetricInTrainingStep())
    assert probe.history
    assert probed[1].logged == plain[1].logged


def test_diverging_branches_are_recorded_as_failed_and_main_goes_on():
    explode = lambda ratio: 1.0 if ratio < 4 else 1e200  # noqa: E731 - an LR rule that blows up k >= 4
    plain = fit_regression()
    probe = toy_probe(lr_rule=explode)
    probed = fit_regression(probe=probe)
    assert_same_main_run(plain, probed)
    for record in probe.history:
        assert record.failed == [4.0]
        assert record.losses["4"] is None
        assert record.k_star in (1.0, 2.0)


class OutOfMemoryInBranches(RegressionModule):
    """Every branch asks the CPU allocator for 16 TiB, which it refuses."""

    def training_step(self, batch, batch_idx):
        if in_branch(self):
            torch.empty(2**44, dtype=torch.uint8)
        return super().training_step(batch, batch_idx)


def test_branches_out_of_memory_are_recorded_as_failed_and_main_goes_on():
    plain = fit_regression()
    probe = toy_probe()
    probed = fit_regression(probe=probe, module=OutOfMemoryInBranches(lr=0.05, optimizer="adam"))
    assert_same_main_run(plain, probed)
    assert probe.history
    for record in probe.history:
        assert record.failed == [1.0, 2.0, 4.0] and set(record.losses.values()) == {None}
        assert record.k_star == 1.0  # every branch failed: the smallest k


def in_branch(module) -> bool:
    return BatchAccounting.attach(module.trainer).in_branch


class RaisingInBranch(RegressionModule):
    def training_step(self, batch, batch_idx):
        if in_branch(self):
            raise RuntimeError("boom inside a branch")
        return super().training_step(batch, batch_idx)


def test_exception_inside_a_branch_restores_main_state_before_saving(tmp_path):
    module = RaisingInBranch(lr=0.05, optimizer="adam")
    probe = toy_probe()
    on_exception = OnExceptionCheckpoint(dirpath=tmp_path, filename="on_exception")
    with pytest.raises(RuntimeError, match="boom inside a branch"):
        fit_regression(probe=probe, module=module, callbacks=[on_exception], enable_checkpointing=True)
    steps_done = len(module.steps)
    # The checkpoint written on the exception holds the main run's state at that step, not a branch's.
    reference = fit_regression(max_tokens=steps_done * 4 * SEQ)
    saved = torch.load(tmp_path / "on_exception.ckpt", weights_only=False)
    assert torch.equal(saved["state_dict"]["layer.weight"], reference[1].layer.weight)
    assert torch.equal(module.layer.weight, reference[1].layer.weight)
    assert saved["global_step"] == steps_done


def test_sigterm_during_a_probe_restores_main_state(tmp_path):
    class SigtermInBranch(RegressionModule):
        def training_step(self, batch, batch_idx):
            if in_branch(self):
                self.trainer._signal_connector.received_sigterm = True  # what Lightning's SIGTERM handler sets
            return super().training_step(batch, batch_idx)

    module = SigtermInBranch(lr=0.05, optimizer="adam")
    probe = toy_probe()
    with pytest.raises(SystemExit):
        fit_regression(probe=probe, module=module)
    reference = fit_regression(max_tokens=len(module.steps) * 4 * SEQ)
    assert torch.equal(module.layer.weight, reference[1].layer.weight)
    assert not probe.history  # the aborted probe is not recorded


class RecordsBranchBatches(RegressionModule):
    """Records the sample indices of every micro-batch a probe branch trains on."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.branch_micro_batches: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        if in_branch(self):
            self.branch_micro_batches.append(batch["idx"].tolist())
        return super().training_step(batch, batch_idx)


def test_branches_regroup_the_window_when_the_micro_batch_changes_inside_it():
    # Batch 4 (micro 4) until 48 samples, then 8 (micro 8); the window covers samples 32-64: the main run
    # trains micro-batches of 4, 4, 4, 4, 8, 8 there.
    module, data = RecordsBranchBatches(lr=0.05, optimizer="adam"), GlobalOrderRegressionData(n=96, batch_size=4)
    warmup = BatchWarmup(PiecewiseBatch([4, 8], [0, 48], unit="samples"), seq_len=SEQ, max_micro_batch_size=8)
    probe = CBSProbeCallback(at_tokens=[32 * SEQ], multipliers=(1, 2), window_tokens=32 * SEQ, search="grid")
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(callbacks=[warmup, probe], **trainer_kwargs(max_epochs=1))
    trainer.fit(module, data)
    (reading,) = probe.history
    assert reading.branches_trained == [1.0, 2.0] and reading.window_tokens == 32 * SEQ
    window = data.epoch_order(0)[32:64]
    assert [len(m) for m in module.micro_batches if set(m) <= set(window)] == [4, 4, 4, 4, 8, 8]
    # Each branch trains the window's samples in order, in the micro-batches BatchWarmup gives its batch.
    k1, k2 = module.branch_micro_batches[:8], module.branch_micro_batches[8:]
    assert [len(m) for m in k1] == [4] * 8 and [len(m) for m in k2] == [8] * 4
    assert [i for m in k1 for i in m] == [i for m in k2 for i in m] == window


class LogsAMeanMetric(RegressionModule):
    """Logs a torchmetrics MeanMetric of its training loss every step, updated in training_step."""

    def __init__(self):
        super().__init__(lr=0.05, optimizer="adam")
        self.train_mean = MeanMetric()

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.train_mean.update(loss.detach())
        self.log("train_step_loss", loss.detach(), on_step=True, on_epoch=False)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.log("train_mean", self.train_mean.compute(), on_step=True, on_epoch=False)
        self.train_mean.reset()


def test_heldout_probe_leaves_every_logged_series_of_the_main_run_unchanged(tmp_path):
    series = {}
    for name, callback in (("plain", None), ("probed", toy_probe(evaluate="heldout", heldout_batches=3))):
        logger = CSVLogger(tmp_path, name=name)
        fit_regression_with_val(LogsAMeanMetric(), callback, logger=logger, log_every_n_steps=1)
        rows = read_csv(f"{logger.log_dir}/metrics.csv")
        series[name] = {
            key: [(row["step"], row[key]) for row in rows if row.get(key)]
            for key in rows[0]
            if key not in ("step", "fit_seconds") and not key.startswith(("cbs/", "probe/"))
        }  # fit_seconds is the wall clock: the probe's branches take time, and only time
        if callback is not None:
            assert len(callback.history) >= 3
    assert series["probed"] == series["plain"]
    assert len(series["plain"]["train_mean"]) == 48  # every main step, nothing more


class CustomTraining(RegressionModule):
    """Overrides every hook of a training step with something that changes the training."""

    def __init__(self):
        super().__init__(lr=0.05, optimizer="adam")
        self.calls = {"optimizer_step": 0, "backward": 0, "configure_gradient_clipping": 0, "lr_scheduler_step": 0}

    def backward(self, loss, *args, **kwargs):
        self.calls["backward"] += 1
        (loss * 3.0).backward()  # a module whose backward rescales its loss

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.calls["configure_gradient_clipping"] += 1
        self.clip_gradients(optimizer, gradient_clip_val=0.01, gradient_clip_algorithm="value")

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        self.calls["optimizer_step"] += 1
        optimizer.step(closure=optimizer_closure)
        with torch.no_grad():
            self.layer.weight.mul_(0.99)  # a decay applied after every step

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 3, 0.5), "interval": "step"},
        }

    def lr_scheduler_step(self, scheduler, metric):
        self.calls["lr_scheduler_step"] += 1
        scheduler.step()


class CountsHooks(Callback):
    def __init__(self):
        self.counts = {
            "on_before_backward": 0,
            "on_after_backward": 0,
            "on_before_optimizer_step": 0,
            "on_before_zero_grad": 0,
            "on_train_batch_end": 0,
        }

    def on_before_backward(self, trainer, pl_module, loss):
        self.counts["on_before_backward"] += 1

    def on_after_backward(self, trainer, pl_module):
        self.counts["on_after_backward"] += 1

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.counts["on_before_optimizer_step"] += 1

    def on_before_zero_grad(self, trainer, pl_module, optimizer):
        self.counts["on_before_zero_grad"] += 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.counts["on_train_batch_end"] += 1


def test_branches_train_through_the_modules_hooks_and_callbacks_never_see_them(tmp_path):
    counts, lr_rows = {}, {}
    for name, callback in (("plain", None), ("probed", toy_probe(search="grid"))):
        counter, logger = CountsHooks(), CSVLogger(tmp_path, name=name)
        trainer, module = fit_regression_with_val(
            CustomTraining(), callback, [counter, LearningRateMonitor("step")], logger=logger, log_every_n_steps=1
        )
        counts[name] = (counter.counts, module)
        lr_rows[name] = [
            (row["step"], row["lr-Adam"]) for row in read_csv(f"{logger.log_dir}/metrics.csv") if row.get("lr-Adam")
        ]
        if callback is not None:
            grid = callback
    (plain_counts, plain), (probed_counts, module) = counts["plain"], counts["probed"]
    assert grid.history
    # The k = 1 branch trains exactly as the main run did over the window: through the module's
    # backward, clipping, optimizer_step (with its decay) and lr_scheduler_step.
    for reading in grid.history:
        assert reading.losses["1"] == reading.main_loss
    assert torch.equal(module.layer.weight, plain.layer.weight)  # the main run is untouched
    assert module.calls["optimizer_step"] > plain.calls["optimizer_step"] == trainer.global_step
    assert module.calls["lr_scheduler_step"] > plain.calls["lr_scheduler_step"]
    assert module.calls["configure_gradient_clipping"] > plain.calls["configure_gradient_clipping"]
    # No callback saw a branch: the same hook counts and LR rows as without the probe.
    assert probed_counts == plain_counts and probed_counts["on_before_optimizer_step"] == trainer.global_step
    assert lr_rows["probed"] == lr_rows["plain"] and lr_rows["plain"]


class RecordsBranchLRs(RegressionModule):
    def __init__(self):
        super().__init__(lr=0.05, optimizer="adam")
        self.branch_lrs: list[float] = []

    def on_before_optimizer_step(self, optimizer):
        if BatchAccounting.attach(self.trainer).in_branch:
            self.branch_lrs.append(optimizer.param_groups[0]["lr"])
        super().on_before_optimizer_step(optimizer)


def test_cooldown_decays_every_branch_lr_and_trains_k1_as_a_branch():
    module = RecordsBranchLRs()
    cooled = toy_probe(search="bisect", multipliers=(1, 2), window_tokens=128, every_tokens=160, cooldown_fraction=0.5)
    trainer, _ = fit_regression_with_val(module, cooled, epochs=1)
    first = cooled.history[0]
    assert first.branches_trained[0] == 1.0 and first.cooldown_fraction == 0.5
    # k = 1: 8 steps of batch 4 at LR 0.05, the last 4 decayed linearly towards 0.
    assert module.branch_lrs[:8] == pytest.approx([0.05] * 4 + [0.05 * f for f in (0.8, 0.6, 0.4, 0.2)])
    # The main run kept its LR.
    assert all(step["lr"] == 0.05 for step in module.steps)


class WritesTheLR(RegressionModule):
    """Lightning's documented manual-warmup pattern, from step ``from_step`` on."""

    def __init__(self, from_step: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.from_step = from_step

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        optimizer.step(closure=optimizer_closure)
        if self.trainer.global_step >= self.from_step:
            for group in optimizer.param_groups:
                group["lr"] = self.lr * min(1.0, (self.trainer.global_step + 1) / 100)


class KeepsTheLR(RegressionModule):
    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        optimizer.step(closure=optimizer_closure)


def test_an_optimizer_step_that_writes_the_lr_is_found_by_a_trial_before_the_first_step():
    module = WritesTheLR(lr=0.05, optimizer="adam")
    with pytest.raises(
        LitCBSConfigError,
        match=r"optimizer_step sets the learning rate itself \(0.0005 where it was given 0.025, tried "
        r"once on a copy of the run's state\)",
    ):
        fit_regression_with_val(module, toy_probe())
    assert not module.steps
    # An override that leaves the LR alone passes the trial, which changes nothing: the same run as without it.
    callback, plain_probe = toy_probe(), toy_probe()
    trainer, kept = fit_regression_with_val(KeepsTheLR(lr=0.05, optimizer="adam"), callback)
    _, plain = fit_regression_with_val(RegressionModule(lr=0.05, optimizer="adam"), plain_probe)
    assert torch.equal(kept.layer.weight, plain.layer.weight) and [s["lr"] for s in kept.steps] == [
        s["lr"] for s in plain.steps
    ]
    assert [r.losses for r in callback.history] == [r.losses for r in plain_probe.history] and callback.history


def test_an_optimizer_step_that_writes_the_lr_later_fails_its_probe_and_the_run_goes_on():
    callback = toy_probe()
    trainer, module = fit_regression_with_val(
        WritesTheLR(from_step=5, lr=0.05, optimizer="adam"), callback
    )  # passes the trial at step 0
    # The first probe (at 160 tokens, step 10) finds it and is recorded as failed; no reading, no later probe.
    assert [(f["tokens"], f["step"]) for f in callback.failures] == [(160, 10)] and not callback.history
    assert "optimizer_step set the learning rate inside a probe branch" in callback.failures[0]["reason"]
    assert trainer.global_step == len(module.steps) == 48  # the whole run: 2 epochs of 96 samples at batch 4
    plain = fit_regression_with_val(WritesTheLR(from_step=5, lr=0.05, optimizer="adam"), None)[1]
    assert torch.equal(module.layer.weight, plain.layer.weight)  # the main run as if no probe had run


def test_the_cooldown_decays_the_last_steps_linearly_towards_zero():
    assert [cooldown_factor(step, 4, 0) for step in range(4)] == [1.0] * 4
    assert [cooldown_factor(step, 4, 2) for step in range(4)] == pytest.approx([1.0, 1.0, 2 / 3, 1 / 3])


def test_a_step_runs_at_the_scaled_lr_and_one_that_writes_the_lr_is_refused():
    parameter = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([parameter], lr=0.1)
    with lr_scaled_for_step([optimizer], 0.5, k=2.0):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    assert optimizer.param_groups[0]["lr"] == 0.1  # the run's LR again
    refused = pytest.raises(ProbeUnusable, match=r"inside a probe branch \(0.3 where the k=2 branch trains at 0.05\)")
    with refused, lr_scaled_for_step([optimizer], 0.5, k=2.0):
        optimizer.param_groups[0]["lr"] = 0.3
