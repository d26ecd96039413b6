"""What a user can trust the CBS probe with: error bars on readings, no side effects on the module,
the module's own hooks in branches, callbacks that never see a branch, early stops and cooldowns
that change nothing else, and files that mirror the readings."""

from __future__ import annotations

import csv
import dataclasses
import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from scipy import stats
from torchmetrics import MeanMetric
from toys import RegressionData, RegressionModule, trainer_kwargs

from lit_cbs import BatchWarmup, CBSProbeCallback, ConstantBatch
from lit_cbs.analysis.probe_schedule import schedule_from_probe
from lit_cbs.callbacks.accounting import BatchAccounting
from lit_cbs.errors import LitCBSConfigError
from lit_cbs.probe import BranchScore, DecisionRule, ProbeReading, decide, difference
from lit_cbs.rules.batch_schedules import CBSAdaptive

SEQ = 4  # the toy's "tokens per sample"


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


# ---------------------------------------------------------------------------- statistics, by hand
def test_paired_difference_is_the_paired_t_test():
    a = BranchScore.heldout([2.0, 2.5, 3.1, 2.2, 2.9])
    b = BranchScore.heldout([1.9, 2.6, 2.8, 2.0, 2.7])
    d = difference(a, b)
    diffs = [x - y for x, y in zip(a.batch_losses, b.batch_losses)]
    assert d.mean == pytest.approx(sum(diffs) / 5)
    assert d.se == pytest.approx(stats.sem(diffs))
    assert d.dof == 4
    # The one-sided 90% bounds are the paired t interval's.
    t = stats.ttest_rel(a.batch_losses, b.batch_losses)
    low, high = d.bounds(0.9)
    assert d.mean / d.se == pytest.approx(t.statistic)
    assert high - d.mean == pytest.approx(stats.t.ppf(0.9, 4) * d.se)
    assert d.mean - low == pytest.approx(high - d.mean)
    assert d.bounds(0.5) == (d.mean, d.mean)


def test_train_ema_score_has_an_unpaired_step_scatter_se():
    losses = [3.0, 2.9, 3.1, 2.8, 3.0, 2.9]
    score = BranchScore.train_ema(losses, alpha=0.5)
    steps = [b - a for a, b in zip(losses, losses[1:])]
    sigma2 = sum(x * x for x in steps) / (2 * len(steps))
    assert score.se == pytest.approx(math.sqrt(sigma2 * 0.5 / 1.5))
    other = BranchScore.train_ema([3.2, 3.1, 3.0, 3.1], alpha=0.5)
    assert difference(score, other).se == pytest.approx(math.hypot(score.se, other.se))
    assert difference(score, other).dof == math.inf
    assert BranchScore.train_ema([3.0, 2.9], alpha=0.5).se is None  # too few steps to say


def heldout(mean: float, spread: float, n: int = 16, seed: int = 0) -> BranchScore:
    """Per-batch losses: a shared batch difficulty (paired across branches) plus branch noise."""
    g = torch.Generator().manual_seed(seed)
    difficulty = torch.linspace(-0.5, 0.5, n, dtype=torch.float64)
    noise = spread * torch.randn(n, generator=g, dtype=torch.float64)
    return BranchScore.heldout((mean + difficulty + noise - noise.mean()).tolist())


@pytest.mark.parametrize(
    "means, spread, epsilon, k_star, determined",
    [
        ({1: 3.0, 2: 3.005, 4: 3.10}, 0.001, 0.02, 2, True),  # clear on both sides
        ({1: 3.0, 2: 3.018, 4: 3.10}, 0.02, 0.02, 2, False),  # k=2 is 0.018 above with SE ~0.007
        ({1: 3.0, 2: 3.025, 4: 3.10}, 0.02, 0.02, 1, False),  # k=2 0.025 above: not surely beyond 0.02
        ({1: 3.0, 2: 3.06, 4: 3.10}, 0.02, 0.02, 1, True),  # k=2 surely beyond
        ({1: 3.0, 2: 3.0, 4: 3.0}, 0.001, 0.02, 4, True),  # the top of the grid
    ],
)
def test_decide_marks_readings_the_data_cannot_decide(means, spread, epsilon, k_star, determined):
    scores = {k: heldout(m, spread, seed=int(k)) for k, m in means.items()}
    decision = decide(scores, epsilon, confidence=0.9)
    assert (decision.k_star, decision.determined) == (k_star, determined)
    assert decision.loss_se[1] is None and decision.loss_se[2] == pytest.approx(difference(scores[2], scores[1]).se)
    assert decide(scores, epsilon, confidence=0.5).determined  # by the means alone, always decided


def test_failed_branches_are_surely_beyond_and_the_record_keeps_the_se(tmp_path):
    scores = {1.0: heldout(3.0, 0.001), 2.0: heldout(3.001, 0.001, seed=2), 4.0: BranchScore(math.inf)}
    reading = ProbeReading.decide(
        scores,
        DecisionRule(0.02, 0.9),
        [1.0, 2.0, 4.0],
        8,
        tokens=0,
        step=0,
        seq_len=4,
        window_tokens=64,
        strategy="grid",
        evaluate="heldout",
        main_loss=3.0,
        branches_trained=[1.0, 2.0, 4.0],
        failed=[4.0],
        tokens_spent=192,
        overhead=0.1,
    )
    assert (reading.k_star, reading.determined, reading.bracket) == (2.0, True, "[16, 32]")
    assert reading.loss_se == {"1": None, "2": pytest.approx(difference(scores[2.0], scores[1.0]).se), "4": None}
    assert reading.batch_losses["2"] == list(scores[2.0].batch_losses) and "4" not in reading.batch_losses
    assert reading.se_method == "paired held-out batches"


# ---------------------------------------------------------------------------- on a real Trainer
class WithVal(RegressionData):
    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.dataset, batch_size=8)


def fit(module=None, probe=None, callbacks=(), epochs=2, data=None, **trainer_overrides):
    pl.seed_everything(0, verbose=False)
    module = module or RegressionModule(lr=0.05, optimizer="adam")
    warmup = trainer_overrides.pop("warmup", None) or BatchWarmup(ConstantBatch(4), seq_len=SEQ)
    cbs = [warmup] + ([probe] if probe is not None else []) + list(callbacks)
    kwargs = trainer_kwargs(max_epochs=epochs, limit_val_batches=0)
    kwargs.update(trainer_overrides)
    trainer = pl.Trainer(callbacks=cbs, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, data or WithVal(n=96, batch_size=2))
    return trainer, module


def probe(**kwargs):
    defaults = dict(every_tokens=160, multipliers=(1, 2, 4), window_tokens=128, epsilon=0.01)
    defaults.update(kwargs)
    return CBSProbeCallback(**defaults)


def read_csv(path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


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
    for name, callback in (("plain", None), ("probed", probe(evaluate="heldout", heldout_batches=3))):
        logger = CSVLogger(tmp_path, name=name)
        fit(LogsAMeanMetric(), callback, logger=logger, log_every_n_steps=1)
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
    for name, callback in (("plain", None), ("probed", probe(search="grid"))):
        counter, logger = CountsHooks(), CSVLogger(tmp_path, name=name)
        trainer, module = fit(
            CustomTraining(), callback, [counter, LearningRateMonitor("step")], logger=logger, log_every_n_steps=1
        )
        counts[name] = (counter.counts, module)
        lr_rows[name] = [(row["step"], row["lr-Adam"]) for row in read_csv(f"{logger.log_dir}/metrics.csv") if row.get("lr-Adam")]
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


def test_undetermined_readings_do_not_move_the_batch():
    schedule = CBSAdaptive(start=2, final=16, factor=2, unit="tokens")
    unsure = probe(
        multipliers=(1, 2, 4), window_tokens=64, every_tokens=96, evaluate="heldout", heldout_batches=2, confidence=0.999
    )
    fit(probe=unsure, warmup=BatchWarmup(schedule, seq_len=SEQ), epochs=3)
    assert unsure.history and not any(r.determined for r in unsure.history)
    assert schedule.decisions == [] and all(r.adaptive_batch is None for r in unsure.history)
    # Nor does a schedule read off those records for another run.
    with pytest.warns(UserWarning, match="every reading in probe records is undetermined"):
        carried = schedule_from_probe([dataclasses.asdict(r) for r in unsure.history], start=2)
    assert carried.batch_sizes == [2]


def test_cbs_adaptive_stops_probing_at_its_final_batch():
    def run(probe_after_final):
        schedule = CBSAdaptive(start=2, final=4, factor=2, unit="tokens", probe_after_final=probe_after_final)
        callback = probe(multipliers=(1, 2, 4), window_tokens=64, every_tokens=96, confidence=0.5)
        fit(probe=callback, warmup=BatchWarmup(schedule, seq_len=SEQ), epochs=3)
        return schedule, callback

    schedule, stopping = run(probe_after_final=False)
    ((at, size),) = schedule.decisions
    assert size == 4
    assert [r.tokens for r in stopping.history if r.tokens >= at] == []  # no probe once the batch is final
    _, going_on = run(probe_after_final=True)
    assert len(going_on.history) > len(stopping.history)
    assert going_on.history[: len(stopping.history)] == stopping.history


def test_early_stop_ends_decided_windows_and_resumes_branches_exactly():
    straight = probe(search="grid", evaluate="heldout", heldout_batches=3, window_tokens=256, every_tokens=320)
    fit(probe=straight, epochs=3)
    # Undecidable at the checkpoints: the branches go on from where they stopped, and the readings
    # at the window's end are those of branches trained straight through.
    resumed = probe(
        search="grid",
        evaluate="heldout",
        heldout_batches=3,
        window_tokens=256,
        every_tokens=320,
        early_stop=(0.25, 0.5),
        confidence=0.99999,
    )
    fit(probe=resumed, epochs=3)
    assert [r.losses for r in resumed.history] == [r.losses for r in straight.history]
    assert all(r.window_tokens == r.planned_window_tokens == 256 for r in resumed.history)
    assert resumed.tokens_spent == straight.tokens_spent
    # Decidable at once: each window ends at its first checkpoint, for a quarter of the tokens.
    quick = probe(
        search="grid",
        evaluate="heldout",
        heldout_batches=3,
        window_tokens=256,
        every_tokens=320,
        early_stop=(0.25, 0.5),
        confidence=0.5,
    )
    fit(probe=quick, epochs=3)
    assert quick.history and all(r.window_tokens == 64 and r.determined for r in quick.history)
    assert quick.tokens_spent < straight.tokens_spent


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
    cooled = probe(search="bisect", multipliers=(1, 2), window_tokens=128, every_tokens=160, cooldown_fraction=0.5)
    trainer, _ = fit(module, cooled, epochs=1)
    first = cooled.history[0]
    assert first.branches_trained[0] == 1.0 and first.cooldown_fraction == 0.5
    # k = 1: 8 steps of batch 4 at LR 0.05, the last 4 decayed linearly towards 0.
    assert module.branch_lrs[:8] == pytest.approx([0.05] * 4 + [0.05 * f for f in (0.8, 0.6, 0.4, 0.2)])
    # The main run kept its LR.
    assert all(step["lr"] == 0.05 for step in module.steps)


def test_cbs_metrics_are_logged_on_the_row_of_the_step_that_ended_the_window(tmp_path):
    callback = probe()
    logger = CSVLogger(tmp_path, name="rows")
    fit(probe=callback, logger=logger, log_every_n_steps=1)
    rows = [row for row in read_csv(f"{logger.log_dir}/metrics.csv") if row.get("cbs/k_star")]
    # Rows count steps from 0: the window's last step is reading.step + its steps - 1.
    expected = [r.step + r.window_tokens // (r.batch_size * SEQ) - 1 for r in callback.history]
    assert [int(row["step"]) for row in rows] == expected
    assert [float(row["cbs/determined"]) for row in rows] == [float(r.determined) for r in callback.history]


def test_files_mirror_the_readings_after_a_resume_and_need_a_place(tmp_path):
    logger = CSVLogger(tmp_path, name="resume", version=0)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_epochs=1, save_top_k=-1)
    first = probe()
    fit(probe=first, callbacks=[checkpoint], logger=logger, enable_checkpointing=True, epochs=2)
    jsonl = tmp_path / "resume" / "version_0" / "cbs_probe.jsonl"
    assert len(jsonl.read_text().splitlines()) == len(first.history)
    # Resume from the end of epoch 1 into the same folder: the file holds each reading once.
    resumed = probe()
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        callbacks=[BatchWarmup(ConstantBatch(4), seq_len=SEQ), resumed],
        **trainer_kwargs(max_epochs=3, limit_val_batches=0, logger=CSVLogger(tmp_path, name="resume", version=0)),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(
            RegressionModule(lr=0.05, optimizer="adam"),
            WithVal(n=96, batch_size=2),
            ckpt_path=tmp_path / "ckpt" / "epoch=0-step=24.ckpt",
        )
    tokens = [line.split('"tokens": ')[1].split(",")[0] for line in jsonl.read_text().splitlines()]
    assert len(tokens) == len(set(tokens)) == len(resumed.history) > len(first.history) // 2
    # Without a logger and without output_dir nothing is written to the working directory.
    lonely = probe()
    fit(probe=lonely)
    assert lonely.history and not list(tmp_path.glob("*.jsonl")) and not list(tmp_path.glob("*.png"))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(multipliers=(1,)), "has one batch size"),
        (dict(confidence=1.0), "confidence=1.0"),
        (dict(confidence=0.3), "confidence=0.3"),
        (dict(cooldown_fraction=1.0), "cooldown_fraction=1.0"),
        (dict(early_stop=(0.0, 0.5)), "early_stop="),
        (dict(early_stop=(0.5,), cooldown_fraction=0.2), "cannot be combined"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(kwargs, match):
    with pytest.raises(LitCBSConfigError, match=match):
        probe(**kwargs)


def test_manual_optimization_is_refused_before_training():
    class Manual(RegressionModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

    trainer = pl.Trainer(callbacks=[BatchAccounting(seq_len=SEQ), probe()], **trainer_kwargs())
    with pytest.raises(LitCBSConfigError, match="automatic_optimization = False"):
        trainer.fit(Manual(), WithVal(n=96, batch_size=2))


def test_lr_rule_is_checked_for_every_multiplier_before_training():
    class AdamW(RegressionModule):
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.95))

    with pytest.raises(
        LitCBSConfigError,
        match=r"lr_rule='adam_sde', multipliers=\[1, 2, 4, 8, 16\]\): batch ratio 16 is above 10, the largest safe",
    ):
        fit(AdamW(), probe(multipliers=(1, 2, 4, 8, 16), lr_rule="adam_sde"))

    class OneCycle(RegressionModule):
        def configure_optimizers(self):
            optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
            schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=1000)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    with pytest.raises(LitCBSConfigError, match="CBSProbeCallback.*OneCycleLR"):
        fit(OneCycle(), probe(), warmup=BatchAccounting(seq_len=SEQ))


def test_train_ema_readings_say_their_se_is_unpaired():
    callback = probe(search="grid", window_tokens=256, every_tokens=320)
    fit(probe=callback, epochs=3)
    for reading in callback.history:
        assert reading.se_method == "step-loss scatter (unpaired, approximate)" and reading.batch_losses == {}
        assert reading.loss_se["1"] is None and all(reading.loss_se[k] > 0 for k in ("2", "4"))


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
        fit(module, probe())
    assert not module.steps
    # An override that leaves the LR alone passes the trial, which changes nothing: the same run as without it.
    callback, plain_probe = probe(), probe()
    trainer, kept = fit(KeepsTheLR(lr=0.05, optimizer="adam"), callback)
    _, plain = fit(RegressionModule(lr=0.05, optimizer="adam"), plain_probe)
    assert torch.equal(kept.layer.weight, plain.layer.weight) and [s["lr"] for s in kept.steps] == [s["lr"] for s in plain.steps]
    assert [r.losses for r in callback.history] == [r.losses for r in plain_probe.history] and callback.history


def test_an_optimizer_step_that_writes_the_lr_later_fails_its_probe_and_the_run_goes_on():
    callback = probe()
    trainer, module = fit(WritesTheLR(from_step=5, lr=0.05, optimizer="adam"), callback)  # passes the trial at step 0
    # The first probe (at 160 tokens, step 10) finds it and is recorded as failed; no reading, no later probe.
    assert [(f["tokens"], f["step"]) for f in callback.failures] == [(160, 10)] and not callback.history
    assert "optimizer_step set the learning rate inside a probe branch" in callback.failures[0]["reason"]
    assert trainer.global_step == len(module.steps) == 48  # the whole run: 2 epochs of 96 samples at batch 4
    plain = fit(WritesTheLR(from_step=5, lr=0.05, optimizer="adam"), None)[1]
    assert torch.equal(module.layer.weight, plain.layer.weight)  # the main run as if no probe had run


def test_fewer_held_out_batches_than_asked_are_said():
    class ThreeValBatches(RegressionData):
        def val_dataloader(self):
            return torch.utils.data.DataLoader(self.dataset, batch_size=32)

    callback = probe(evaluate="heldout", heldout_batches=16)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        callbacks=[BatchWarmup(ConstantBatch(4), seq_len=SEQ), callback], **trainer_kwargs(max_epochs=2, limit_val_batches=0)
    )
    with pytest.warns(UserWarning, match="heldout_batches=16 but the validation data has 3 batches"):
        trainer.fit(RegressionModule(lr=0.05, optimizer="adam"), ThreeValBatches(n=96, batch_size=2))
    assert callback.history and all(len(v) == 3 for v in callback.history[0].batch_losses.values())


def test_the_plot_draws_what_the_rule_holds_against_epsilon():
    from lit_cbs.probe.plot import _gap_to_smaller
    from lit_cbs.probe.reading import one_sided_quantile

    scores = {1.0: heldout(3.0, 0.01), 2.0: heldout(2.95, 0.01, seed=2), 4.0: heldout(2.99, 0.01, seed=4)}
    reading = ProbeReading.decide(
        scores,
        DecisionRule(0.02, 0.9),
        [1.0, 2.0, 4.0],
        8,
        tokens=100,
        step=0,
        seq_len=4,
        window_tokens=64,
        strategy="grid",
        evaluate="heldout",
        main_loss=3.0,
        branches_trained=[1.0, 2.0, 4.0],
        failed=[],
        tokens_spent=192,
        overhead=0.1,
    )
    tokens, gap, bar = _gap_to_smaller(reading, 4.0)  # against k = 2, the lowest smaller loss
    pair = difference(scores[4.0], scores[2.0])
    assert (tokens, gap) == (100, pytest.approx(0.04)) and bar == pytest.approx(pair.se * one_sided_quantile(0.9, 15))
    assert reading.k_star == 2.0  # 4 is 0.04 above k = 2: beyond epsilon, though only 0.01 below k = 1
