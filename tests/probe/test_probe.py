"""CBSProbeCallback: the k* rule, branches that leave the main run untouched, faults, resume."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import subprocess
import sys
import warnings

import lightning.pytorch as pl
import matplotlib
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric
from toys import GlobalOrderRegressionData, RegressionData, RegressionModule, trainer_kwargs

from lit_cbs import BatchWarmup, CBSProbeCallback, ConstantBatch, PiecewiseBatch
from lit_cbs.analysis.curves import read_probe
from lit_cbs.analysis.probe_schedule import schedule_from_probe
from lit_cbs.callbacks.accounting import BatchAccounting
from lit_cbs.errors import LitCBSConfigError
from lit_cbs.probe import (
    BranchScore,
    DecisionRule,
    ProbeReading,
    cbs_interval,
    critical_multiplier,
    ema_last,
    max_branches,
    measure_losses,
    plot_cbs_curve,
)
from lit_cbs.probe.plot import cbs_curve_figure
from lit_cbs.rules.batch_schedules import CBSAdaptive

SEQ = 4  # the toy's "tokens per sample", given to BatchWarmup (its x is float, not token ids)


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path, monkeypatch):
    """Without a logger the probe writes its JSONL and plot to the trainer's root dir, the cwd."""
    monkeypatch.chdir(tmp_path)


# ---------------------------------------------------------------------------- the rule, by hand
@pytest.mark.parametrize(
    "losses, epsilon, expected",
    [
        ({1: 3.00, 2: 3.005, 4: 3.02, 8: 3.2}, 0.01, 2),  # 4 is 0.02 above k=1
        ({1: 3.00, 2: 3.01, 4: 3.02}, 0.01, 2),  # a tie at exactly epsilon counts as recovered
        ({1: 3.00, 2: 3.00, 4: 3.00, 8: 3.00}, 0.0, 8),  # ties with epsilon 0
        ({1: 3.00, 2: 3.05, 4: 3.00}, 0.01, 4),  # the paper's rule: largest k within eps of all smaller
        ({1: 3.00, 2: float("nan"), 4: 3.005}, 0.01, 4),  # a failed branch constrains nothing
        ({1: 3.00, 2: 3.001, 4: float("inf")}, 0.01, 2),  # and is never chosen
        ({0.25: 3.4, 0.5: 3.2, 1: 3.0, 2: 2.99}, 0.01, 2),  # fractional k: larger is better early on
        ({0.25: 3.0, 0.5: 3.2, 1: 3.3}, 0.01, 0.25),  # at initialisation, tiny batches win
        ({1: float("nan"), 2: float("nan")}, 0.01, 1),  # all failed: the smallest k
    ],
)
def test_critical_multiplier_on_hand_made_tables(losses, epsilon, expected):
    assert critical_multiplier(losses, epsilon) == expected


def test_cbs_interval_and_geometric_mean():
    assert cbs_interval(2, [1, 2, 4, 8], 16) == (32, 64, math.sqrt(32 * 64))
    assert cbs_interval(8, [1, 2, 4, 8], 16) == (128, None, 128)  # top of the grid: a lower bound
    assert cbs_interval(0.25, [0.25, 0.5, 1], 16) == (4, 8, math.sqrt(32))


def test_ema_matches_the_paper_alpha():
    assert ema_last([4.0, 2.0, 1.0], 0.5) == pytest.approx(0.5 * 1 + 0.5 * (0.5 * 2 + 0.5 * 4))
    assert ema_last([4.0, 2.0], 1.0) == 2.0


def test_critical_multiplier_refuses_bad_input():
    with pytest.raises(ValueError, match="empty"):
        critical_multiplier({}, 0.01)
    with pytest.raises(ValueError, match="epsilon=-0.1"):
        critical_multiplier({1: 1.0}, -0.1)


@pytest.mark.parametrize(
    "table",
    [
        {1: 3.0, 2: 3.005, 4: 3.009, 8: 3.02, 16: 3.1},  # k* = 4
        {1: 3.0, 2: 3.02, 4: 3.03, 8: 3.04, 16: 3.05},  # k* = 1
        {1: 3.0, 2: 3.0, 4: 3.0, 8: 3.0, 16: 3.0},  # k* = 16, the top of the grid
        {1: 3.0, 2: 3.001, 4: float("inf"), 8: float("inf"), 16: float("inf")},  # failed branches: k* = 2
    ],
)
def test_bisect_finds_the_grid_answer_on_monotone_tables(table):
    calls = []

    def measure(k):
        calls.append(k)
        return BranchScore(table[k])

    grid = {k: s.loss for k, s in measure_losses("grid", list(table), measure, 0.01).items()}
    assert calls == sorted(table) and grid == table
    calls.clear()
    bisect = {k: s.loss for k, s in measure_losses("bisect", list(table), measure, 0.01).items()}
    assert critical_multiplier(bisect, 0.01) == critical_multiplier(grid, 0.01)
    assert len(calls) == len(set(calls)) <= max_branches("bisect", len(table)) < len(table)
    assert all(bisect[k] == table[k] for k in calls)


def test_reading_applies_the_rule_and_writes_the_jsonl_readers_read(tmp_path):
    reading = ProbeReading.decide(
        {1.0: BranchScore(3.0), 2.0: BranchScore(3.004), 4.0: BranchScore(math.inf)},
        DecisionRule(0.01, 0.5),
        [1.0, 2.0, 4.0],
        16,
        tokens=4096,
        step=8,
        seq_len=32,
        window_tokens=8192,
        strategy="grid",
        evaluate="train_ema",
        main_loss=3.0,
        branches_trained=[1.0, 2.0, 4.0],
        failed=[4.0],
        tokens_spent=3 * 8192,
        overhead=0.5,
    )
    assert (reading.k_star, reading.cbs_lower, reading.cbs_upper) == (2.0, 32, 64)
    assert reading.cbs_estimate == pytest.approx(math.sqrt(32 * 64))
    assert reading.losses == {"1": 3.0, "2": 3.004, "4": None}  # JSON has no inf: a failed branch is null
    assert reading.branch_steps == 8192 // (16 * 32) + 8192 // (32 * 32) + 8192 // (64 * 32)
    path = tmp_path / "cbs_probe.jsonl"
    path.write_text(json.dumps(dataclasses.asdict(reading)) + "\n")
    (point,) = read_probe(path)
    assert (point.tokens, point.lower, point.upper, point.batch_size) == (4096, 32, 64, 16)
    # The record carries its seq_len, so another sequence length needs no measured_seq_len.
    assert schedule_from_probe(path, 16, seq_len=64).batch_size(4096) == 16
    assert schedule_from_probe(path, 16, seq_len=16).batch_size(4096) == 64


def test_the_rule_loads_without_lightning():
    code = "import sys, lit_cbs.probe.reading; print(sorted(m for m in ('lightning', 'torch') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_cbs_plot_leaves_the_matplotlib_backend_alone(tmp_path):
    readings = [
        ProbeReading.decide(
            {1.0: BranchScore(3.0), 2.0: BranchScore(3.0), 4.0: BranchScore(loss4)},
            DecisionRule(0.01, 0.5),
            [1.0, 2.0, 4.0],
            8,
            tokens=tokens,
            step=0,
            seq_len=4,
            window_tokens=128,
            strategy="grid",
            evaluate="train_ema",
            main_loss=3.0,
            branches_trained=[1.0, 2.0, 4.0],
            failed=[],
            tokens_spent=384,
            overhead=0.1,
        )
        for tokens, loss4 in ((1000, 3.5), (2000, 3.0))  # a closed interval, then the top of the grid
    ]
    before = matplotlib.get_backend()
    matplotlib.use("svg")  # a notebook's or script's own choice
    try:
        path = plot_cbs_curve(readings, [], tmp_path / "plots" / "cbs_curve.png", end_tokens=3000)
        assert matplotlib.get_backend() == "svg"
    finally:
        matplotlib.use(before)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_loss_gap_panel_labels_its_ticks_as_plain_numbers():
    readings = [
        ProbeReading.decide(
            {1.0: BranchScore(3.0), 2.0: BranchScore(3.0 + gap), 4.0: BranchScore(3.2)},
            DecisionRule(0.0241374, 0.5),
            [1.0, 2.0, 4.0],
            8,
            tokens=tokens,
            step=0,
            seq_len=4,
            window_tokens=128,
            strategy="grid",
            evaluate="train_ema",
            main_loss=3.0,
            branches_trained=[1.0, 2.0, 4.0],
            failed=[],
            tokens_spent=384,
            overhead=0.1,
        )
        for tokens, gap in ((1000, 0.01), (2000, 0.5))
    ]
    figure = cbs_curve_figure(readings, [], end_tokens=3000, epsilon=0.0241374)  # symlog threshold 0.0482748
    figure.canvas.draw()
    bottom = figure.axes[1]
    labels = [label.get_text() for label in bottom.get_yticklabels() + bottom.get_yticklabels(minor=True)]
    assert labels and all(re.fullmatch(r"−?-?[0-9.]+(e[+-]?[0-9]+)?", text) for text in labels if text), labels


# ---------------------------------------------------------------------------- on a real Trainer
def run(*, probe=None, schedule=None, epochs=2, n=96, micro=2, module=None, callbacks=(), max_tokens=None, ckpt=None, **fit):
    """Fit the toy with global batch 4 (2 micro-batches of 2), or ``schedule``, under BatchWarmup."""
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


def optimizer_state(trainer):
    opt = trainer.optimizers[0]
    return {k: v.clone() if torch.is_tensor(v) else v for state in opt.state.values() for k, v in state.items()}


def assert_same_main_run(a, b):
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
    assert warmup_a.tokens_seen == warmup_b.tokens_seen


def grid_probe(**kwargs):
    defaults = dict(every_tokens=160, multipliers=(1, 2, 4), window_tokens=128, epsilon=0.01)
    defaults.update(kwargs)
    return CBSProbeCallback(**defaults)


def test_probe_leaves_main_run_untouched_and_k1_branch_reproduces_it(tmp_path):
    plain = run()
    rng_plain = torch.get_rng_state()
    probe = grid_probe(output_dir=tmp_path)
    probed = run(probe=probe)
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
    assert [json.loads(line) for line in lines] == [dataclasses.asdict(r) for r in probe.history]
    assert [p.lower for p in read_probe(tmp_path / "cbs_probe.jsonl")] == [r.cbs_lower for r in probe.history]
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
    plain = run(module=MetricInTrainingStep())
    probe = grid_probe()
    probed = run(probe=probe, module=MetricInTrainingStep())
    assert probe.history
    assert probed[1].logged == plain[1].logged


def test_bisect_finds_the_grid_answer_for_fewer_tokens():
    grid = grid_probe(multipliers=(1, 2, 4, 8, 16), window_tokens=256, every_tokens=256)
    bisect = grid_probe(multipliers=(1, 2, 4, 8, 16), window_tokens=256, every_tokens=256, search="bisect")
    run(probe=grid, n=128, epochs=3)
    run(probe=bisect, n=128, epochs=3)
    assert len(grid.history) == len(bisect.history) >= 3
    for g, b in zip(grid.history, bisect.history):
        ks = [1, 2, 4, 8, 16]
        # Same tokens, same k*, within one grid step (exactly, where recovery is monotone).
        assert abs(ks.index(g.k_star) - ks.index(b.k_star)) <= 1
        assert 1.0 not in b.branches_trained and len(b.branches_trained) <= 3
        for k, loss in b.losses.items():  # every branch bisect trained matches the grid's
            assert loss == g.losses[k]
    assert bisect.tokens_spent * 5 <= grid.tokens_spent * 3


def test_diverging_branches_are_recorded_as_failed_and_main_goes_on():
    explode = lambda ratio: 1.0 if ratio < 4 else 1e200  # noqa: E731 - an LR rule that blows up k >= 4
    plain = run()
    probe = grid_probe(lr_rule=explode)
    probed = run(probe=probe)
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
    plain = run()
    probe = grid_probe()
    probed = run(probe=probe, module=OutOfMemoryInBranches(lr=0.05, optimizer="adam"))
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
    probe = grid_probe()
    on_exception = OnExceptionCheckpoint(dirpath=tmp_path, filename="on_exception")
    with pytest.raises(RuntimeError, match="boom inside a branch"):
        run(probe=probe, module=module, callbacks=[on_exception], enable_checkpointing=True)
    steps_done = len(module.steps)
    # The checkpoint written on the exception holds the main run's state at that step, not a branch's.
    reference = run(max_tokens=steps_done * 4 * SEQ)
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
    probe = grid_probe()
    with pytest.raises(SystemExit):
        run(probe=probe, module=module)
    reference = run(max_tokens=len(module.steps) * 4 * SEQ)
    assert torch.equal(module.layer.weight, reference[1].layer.weight)
    assert not probe.history  # the aborted probe is not recorded


def test_resume_mid_run_continues_probe_schedule_and_main_run(tmp_path):
    # 80 samples x 4 tokens = 320 tokens per epoch; probe windows [288, 352], [576, 640], [864, 928].
    def probe():
        return grid_probe(every_tokens=288, window_tokens=64)

    full_probe = probe()
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1, filename="{epoch}")
    full = run(probe=full_probe, callbacks=[checkpoint], n=80, epochs=3, enable_checkpointing=True)
    assert [r.tokens for r in full_probe.history] == [288, 576, 864]

    # Between windows (640 tokens): the resumed run continues exactly, probes included.
    resumed_probe = probe()
    resumed = run(probe=resumed_probe, n=80, epochs=3, ckpt=tmp_path / "epoch=1.ckpt")
    assert torch.equal(full[1].layer.weight, resumed[1].layer.weight)
    assert resumed_probe.history == full_probe.history
    assert all(isinstance(r, ProbeReading) for r in resumed_probe.history)  # rebuilt from the checkpoint's dicts
    assert resumed_probe.tokens_spent == full_probe.tokens_spent

    # A lit_cbs 0.1 checkpoint (readings without seq_len) resumes alike.
    state = torch.load(tmp_path / "epoch=1.ckpt", weights_only=False)
    (key,) = [key for key in state["callbacks"] if key.startswith("CBSProbeCallback")]
    for reading in state["callbacks"][key]["history"]:
        del reading["seq_len"]
    torch.save(state, tmp_path / "v0.1.ckpt")
    old_probe = probe()
    run(probe=old_probe, n=80, epochs=3, ckpt=tmp_path / "v0.1.ckpt")
    assert old_probe.history == full_probe.history

    # Inside the first window (320 tokens): that probe is taken again where the resumed run starts, and says
    # where the interrupted one began; the later ones are the uninterrupted run's.
    inside_probe = probe()
    inside = run(probe=inside_probe, n=80, epochs=3, ckpt=tmp_path / "epoch=0.ckpt")
    assert torch.equal(full[1].layer.weight, inside[1].layer.weight)
    assert [r.tokens for r in inside_probe.history] == [320, 576, 864]
    assert [r.interrupted_at_tokens for r in inside_probe.history] == [288, None, None]
    assert inside_probe.history[1:] == full_probe.history[1:]


def test_heldout_evaluation_and_overhead_budget():
    probe = grid_probe(evaluate="heldout", heldout_batches=2)

    class WithVal(RegressionData):
        def val_dataloader(self):
            return torch.utils.data.DataLoader(self.dataset, batch_size=8)

    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        callbacks=[BatchWarmup(ConstantBatch(4), seq_len=SEQ), probe],
        **trainer_kwargs(max_epochs=2, limit_val_batches=0),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(RegressionModule(lr=0.05, optimizer="adam"), WithVal(n=96, batch_size=2))
    assert probe.history and all(r.evaluate == "heldout" for r in probe.history)
    assert all(r.losses["1"] == pytest.approx(r.main_loss, rel=1e-12) for r in probe.history)

    budget = grid_probe(max_overhead=0.5)
    run(probe=budget)
    assert budget.history and budget.tokens_spent / (2 * 96 * SEQ) <= 0.5 + 1e-9
    assert all(r.overhead <= 0.5 for r in budget.history)


def test_cbs_adaptive_doubles_when_probe_says_so():
    schedule = CBSAdaptive(start=2, final=16, factor=2, unit="tokens")
    probe = grid_probe(multipliers=(1, 2, 4), window_tokens=64, every_tokens=96, confidence=0.5)
    trainer, module, warmup = run(probe=probe, schedule=schedule, epochs=3, micro=2)
    moves = [r.adaptive_batch for r in probe.history if r.adaptive_batch is not None]
    assert moves and moves == [size for _, size in schedule.decisions]
    for record in probe.history:  # doubled exactly when the measured CBS reached twice the batch
        if record.adaptive_batch is not None:
            assert record.cbs_lower >= record.adaptive_batch
    assert [c.new_global_batch for c in warmup.history] == moves
    assert all(c.lr_factor == pytest.approx(math.sqrt(2)) for c in warmup.history)


def test_cbs_adaptive_rule_unit():
    schedule = CBSAdaptive(start=16, final=64)
    assert not schedule.observe(100, 31.9) and schedule.batch_size(100) == 16
    assert schedule.observe(200, 32) and schedule.batch_size(199) == 16 and schedule.batch_size(200) == 32
    assert schedule.observe(300, 1000) and schedule.batch_size(300) == 64
    assert not schedule.observe(400, 10_000)  # never past final
    restored = CBSAdaptive(start=16, final=64)
    restored.load_state_dict(schedule.state_dict())
    assert restored.batch_size(250) == 32 and restored.sizes(0) == [16, 32, 64]
    with pytest.raises(ValueError, match="power of 2"):
        CBSAdaptive(start=16, final=48)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(multipliers=()), "non-empty"),
        (dict(multipliers=(1, -2)), "positive"),
        (dict(epsilon=-0.01), "epsilon=-0.01"),
        (dict(epsilon=2.0), r"epsilon=2.0 must lie in \[0, 0.5\) nats.*every batch recovers"),
        (dict(multipliers=(2, 4)), "has no k = 1.*include 1"),
        (dict(ema_alpha=0.0), "ema_alpha=0.0"),
        (dict(ema_alpha=1.5), "ema_alpha=1.5"),
        (dict(window_tokens=0), "window_tokens=0"),
        (dict(search="random"), "search='random'"),
        (dict(search="bisect", multipliers=(2, 4)), "include 1"),
        (dict(every_tokens=None), "exactly one"),
        (dict(at_tokens=[100]), "exactly one"),
        (dict(every_tokens=0), "every_tokens=0"),
        (dict(evaluate="val"), "evaluate='val'"),
        (dict(heldout_batches=0), "heldout_batches=0"),
        (dict(max_overhead=0), "max_overhead=0"),
    ],
)
def test_bad_probe_arguments(kwargs, match):
    with pytest.raises(LitCBSConfigError, match=match):
        grid_probe(**kwargs)


def test_window_smaller_than_one_large_branch_step_is_refused_before_a_step():
    module = RegressionModule(lr=0.05, optimizer="adam")
    with pytest.raises(
        LitCBSConfigError, match=r"window_tokens=64 is smaller than one step of the largest branch \(k=8 x batch 4"
    ):
        run(probe=grid_probe(multipliers=(1, 8), window_tokens=64), module=module)
    assert module.steps == []


def test_probe_schedule_outside_the_run_is_refused():
    with pytest.raises(LitCBSConfigError, match="no probe point lies inside the run.*max_tokens=200"):
        run(probe=grid_probe(at_tokens=[10_000], every_tokens=None), max_tokens=200)


def test_no_window_starts_that_max_tokens_would_cut_short(caplog):
    # 96 samples of SEQ tokens per epoch; points every 160 tokens with 128-token windows: the window
    # from 640 tokens ends at 768 <= max_tokens and runs; the one from 800 would pass 832 and never starts.
    probe = grid_probe()
    pl.seed_everything(0, verbose=False)
    warmup = BatchWarmup(ConstantBatch(4), lr_rule="sqrt", seq_len=SEQ, max_tokens=832)
    trainer = pl.Trainer(callbacks=[warmup, probe], **trainer_kwargs(max_epochs=10))
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        trainer.fit(RegressionModule(lr=0.05, optimizer="adam"), RegressionData(n=96, batch_size=2))
    assert warmup.tokens_seen == 832
    assert [r.tokens for r in probe.history] == [160, 320, 480, 640]
    assert not [w for w in caught if "dropped" in str(w.message)]
    assert (
        "CBS probe at 800 tokens not started: its window of 128 tokens would end past the run's end (max_tokens=832, at 832 tokens)"
        in caplog.text
    )


class TokenData(pl.LightningDataModule):
    """Token ids (2-D int64) from a fixed random bigram chain: a plain DataLoader of batch_size samples."""

    def __init__(self, n: int = 64, tokens_per_sample: int = 8, vocab: int = 16, batch_size: int = 4):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        successor = torch.randint(0, vocab, (vocab, 2), generator=g)
        ids = torch.empty(n, tokens_per_sample, dtype=torch.long)
        ids[:, 0] = torch.randint(0, vocab, (n,), generator=g)
        for t in range(1, tokens_per_sample):
            ids[:, t] = successor[ids[:, t - 1], torch.randint(0, 2, (n,), generator=g)]
        self.dataset = TensorDataset(ids)
        self.vocab = vocab
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True, generator=torch.Generator().manual_seed(1))


class Bigram(pl.LightningModule):
    def __init__(self, vocab: int = 16):
        super().__init__()
        torch.manual_seed(2)
        self.logits = torch.nn.Embedding(vocab, vocab)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        return torch.nn.functional.cross_entropy(self.logits(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.05)


def fit_tokens(callbacks, **trainer_overrides):
    pl.seed_everything(0, verbose=False)
    module = Bigram()
    trainer = pl.Trainer(callbacks=callbacks, **trainer_kwargs(max_epochs=2, **trainer_overrides))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, TokenData())
    return trainer, module


def test_probe_alone_measures_a_fixed_batch_token_run(tmp_path):
    # 64 samples x 8 tokens per epoch, batch 4 x accumulate 2 = 8 samples (64 tokens) per step.
    plain_trainer, plain = fit_tokens([], accumulate_grad_batches=2)
    probe = CBSProbeCallback(at_tokens=(128, 512), multipliers=(0.5, 1, 2), window_tokens=256, output_dir=tmp_path)
    trainer, probed = fit_tokens([probe], accumulate_grad_batches=2)
    assert torch.equal(plain.logits.weight, probed.logits.weight) and trainer.global_step == plain_trainer.global_step
    assert [r.tokens for r in probe.history] == [128, 512]
    for record in probe.history:
        assert (record.batch_size, record.seq_len, record.window_tokens) == (8, 8, 256)
        assert record.branches_trained == [0.5, 1.0, 2.0]
        assert record.losses["1"] == pytest.approx(record.main_loss, rel=1e-12)
    assert len((tmp_path / "cbs_probe.jsonl").read_text().splitlines()) == 2 and (tmp_path / "cbs_curve.png").exists()


def test_probe_refuses_batches_without_token_ids():
    module = RegressionModule(lr=0.05, optimizer="adam")
    trainer = pl.Trainer(callbacks=[grid_probe()], **trainer_kwargs())
    with pytest.raises(LitCBSConfigError, match="no token ids.*give seq_len=... to BatchAccounting or BatchWarmup"):
        trainer.fit(module, RegressionData(n=16))
    assert module.steps == []


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
