"""Replicate windows: a reading whose standard errors cover the data the branches trained on, not
only the held-out batches they were scored on."""

from __future__ import annotations

import math
import random
import warnings

import lightning.pytorch as pl
import pytest
import torch
from scipy import stats
from toys import RegressionData, RegressionModule, trainer_kwargs

from lit_cbs import BatchWarmup, CBSProbeCallback, ConstantBatch
from lit_cbs.callbacks.accounting import BatchAccounting
from lit_cbs.errors import LitCBSConfigError
from lit_cbs.probe import BranchScore, DecisionRule, ProbeReading, decide, difference

SEQ = 4  # the toy's "tokens per sample"


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


# ---------------------------------------------------------------------------- statistics, by hand
def test_replicated_difference_adds_the_spread_between_windows():
    windows_a = [[2.0, 2.5, 3.1, 2.2], [2.3, 2.6, 3.0, 2.5], [2.1, 2.4, 3.3, 2.4]]
    windows_b = [[1.9, 2.6, 2.8, 2.0], [1.9, 2.3, 2.9, 2.1], [2.0, 2.5, 3.0, 2.2]]
    a = BranchScore.replicated([BranchScore.heldout(w) for w in windows_a])
    b = BranchScore.replicated([BranchScore.heldout(w) for w in windows_b])
    per_batch = [sum(x) / 3 for x in zip(*windows_a)]
    assert a.batch_losses == pytest.approx(per_batch) and a.loss == pytest.approx(sum(per_batch) / 4)
    d = difference(a, b)
    window_means = [sum(x - y for x, y in zip(wa, wb)) / 4 for wa, wb in zip(windows_a, windows_b)]
    batch_means = [sum(wa[h] - wb[h] for wa, wb in zip(windows_a, windows_b)) / 3 for h in range(4)]
    batch_part, window_part = stats.sem(batch_means) ** 2, stats.sem(window_means) ** 2
    assert d.mean == pytest.approx(sum(window_means) / 3)
    assert d.se == pytest.approx(math.sqrt(batch_part + window_part))
    assert d.replicate_se == pytest.approx(math.sqrt(window_part))
    assert d.dof == pytest.approx((batch_part + window_part) ** 2 / (batch_part**2 / 3 + window_part**2 / 2))
    # Without replicates the same per-batch means give the held-out SE alone, which is narrower here.
    plain = difference(BranchScore.heldout(a.batch_losses), BranchScore.heldout(b.batch_losses))
    assert plain.se == pytest.approx(math.sqrt(batch_part)) and plain.se < d.se and plain.replicate_se is None


def test_one_window_is_the_plain_score_and_a_failed_window_fails_the_multiplier():
    score = BranchScore.heldout([1.0, 2.0])
    assert BranchScore.replicated([score]) is score
    assert BranchScore.replicated([score, BranchScore(math.inf)]).failed
    with pytest.raises(ValueError, match="the same batches in every window"):
        BranchScore.replicated([score, BranchScore.heldout([1.0, 2.0, 3.0])])


def test_replicated_bounds_cover_a_difference_that_moves_between_windows():
    """Simulated: L_k - L_1 of a window is the true gap plus a window effect (sd 0.02 nats, as between
    runs of the tiny model) plus held-out batch noise (sd 0.01 per batch, 16 batches). The 90% upper
    bound of the paired SE alone holds the true gap far less often than 90%; with 3 replicate
    windows it holds it about 90% of the time."""
    rng = random.Random(0)
    true_gap, trials, held_out, replicates = 0.01, 2000, 16, 3
    covered = {"plain": 0, "replicated": 0}
    for _ in range(trials):
        batch_difficulty = [rng.gauss(0, 0.3) for _ in range(held_out)]  # shared by every branch and window
        windows_k, windows_1 = [], []
        for _ in range(replicates):
            effect = rng.gauss(0, 0.02)
            windows_1.append([3.0 + h for h in batch_difficulty])
            windows_k.append([3.0 + h + true_gap + effect + rng.gauss(0, 0.01) for h in batch_difficulty])
        first = difference(BranchScore.heldout(windows_k[0]), BranchScore.heldout(windows_1[0]))
        replicated = difference(
            BranchScore.replicated([BranchScore.heldout(w) for w in windows_k]),
            BranchScore.replicated([BranchScore.heldout(w) for w in windows_1]),
        )
        covered["plain"] += first.bounds(0.9)[1] >= true_gap
        covered["replicated"] += replicated.bounds(0.9)[1] >= true_gap
    assert covered["plain"] / trials < 0.75
    assert 0.86 <= covered["replicated"] / trials <= 0.95


def test_records_keep_each_window_and_are_judged_anew_alike():
    scores = {
        k: BranchScore.replicated(
            [BranchScore.heldout([3.0 + 0.01 * k + 0.002 * w + 0.001 * h for h in range(4)]) for w in range(2)]
        )
        for k in (1.0, 2.0)
    }
    scores[2.0] = BranchScore.replicated(
        [BranchScore.heldout([3.02, 3.03, 3.01, 3.02]), BranchScore.heldout([3.05, 3.04, 3.06, 3.05])]
    )
    reading = ProbeReading.decide(
        scores,
        DecisionRule(0.02, 0.9),
        [1, 2, 4],
        16,
        tokens=0,
        step=0,
        seq_len=8,
        window_tokens=64,
        strategy="grid",
        evaluate="heldout",
        main_loss=3.0,
        branches_trained=[1.0, 1.0, 2.0, 2.0],
        failed=[],
        tokens_spent=256,
        overhead=1.0,
        replicates=2,
    )
    assert reading.se_method == "paired held-out batches and replicate data windows"
    assert reading.replicate_batch_losses["2"] == [[3.02, 3.03, 3.01, 3.02], [3.05, 3.04, 3.06, 3.05]]
    gap = difference(scores[2.0], scores[1.0])
    assert reading.loss_se["2"] == pytest.approx(gap.se) and reading.replicate_se["2"] == pytest.approx(gap.replicate_se)
    again = decide(reading.scores(), 0.02, 0.9)
    assert (again.k_star, again.determined) == (reading.k_star, reading.determined)
    assert again.loss_se[2.0] == pytest.approx(gap.se)


# ---------------------------------------------------------------------------- on a real Trainer
class WithVal(RegressionData):
    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.dataset, batch_size=8)


class RecordsBranchSamples(RegressionModule):
    """Records the samples of every branch step (training_step runs in branches too, and scores the
    held-out batches in eval mode)."""

    def __init__(self):
        super().__init__(lr=0.05, optimizer="adam")
        self.branch_samples: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        if BatchAccounting.attach(self.trainer).in_branch and self.training:
            self.branch_samples.append(batch["idx"].tolist())
        return super().training_step(batch, batch_idx)


def fit(probe=None, module=None):
    pl.seed_everything(0, verbose=False)
    module = module or RecordsBranchSamples()
    callbacks = [BatchWarmup(ConstantBatch(4), seq_len=SEQ)] + ([probe] if probe is not None else [])
    trainer = pl.Trainer(callbacks=callbacks, **trainer_kwargs(max_epochs=2, limit_val_batches=0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, WithVal(n=96, batch_size=2))
    return trainer, module


def replicated_probe(**kwargs):
    settings = dict(
        every_tokens=160, multipliers=(1, 2), window_tokens=64, epsilon=0.01, evaluate="heldout", heldout_batches=3, replicates=2
    )
    settings.update(kwargs)
    return CBSProbeCallback(**settings)


def test_replicate_windows_train_on_the_next_data_and_leave_the_main_run_alone():
    _, plain = fit()
    probe = replicated_probe(search="grid")
    trainer, probed = fit(probe)
    assert len(probed.steps) == len(plain.steps)
    assert all(torch.equal(a["weight"], b["weight"]) for a, b in zip(probed.steps, plain.steps))
    assert torch.equal(probed.layer.weight, plain.layer.weight)
    assert probed.micro_batches == plain.micro_batches
    assert len(probe.history) >= 2
    window_samples = 64 // SEQ
    main_order = [i for batch in probed.micro_batches for i in batch]
    branch_steps = iter(probed.branch_samples)
    for reading in probe.history:
        assert reading.replicates == 2 and reading.window_tokens == 64
        assert reading.branches_trained == [1.0, 1.0, 2.0, 2.0]  # k by k, each on both windows
        assert reading.tokens_spent == 4 * 64
        start = reading.tokens // SEQ  # samples the main run had trained on when the window began
        windows = [main_order[start : start + window_samples], main_order[start + window_samples : start + 2 * window_samples]]
        for _k in (1, 2):
            for window in windows:  # each branch trains on its window's samples, in the main run's order
                trained = []
                while len(trained) < window_samples:
                    trained += next(branch_steps)
                assert trained == window
        assert set(reading.replicate_batch_losses) == {"1", "2"}
        assert all(len(w) == 2 and all(len(b) == 3 for b in w) for w in reading.replicate_batch_losses.values())
        held_out_only = difference(BranchScore.heldout(reading.batch_losses["2"]), BranchScore.heldout(reading.batch_losses["1"]))
        assert reading.loss_se["2"] ** 2 == pytest.approx(held_out_only.se**2 + reading.replicate_se["2"] ** 2)


def test_bisect_uses_the_main_run_for_the_first_window_only():
    grid = replicated_probe(search="grid")
    fit(grid)
    bisect = replicated_probe(search="bisect")
    fit(bisect)
    for g, b in zip(grid.history, bisect.history):
        # The main run over the first window is the k = 1 branch there: the same held-out losses.
        assert b.replicate_batch_losses["1"][0] == pytest.approx(g.replicate_batch_losses["1"][0], rel=1e-12)
        assert b.replicate_batch_losses == pytest.approx(g.replicate_batch_losses, rel=1e-12)
        assert b.branches_trained == [1.0, 2.0, 2.0] and b.tokens_spent == 3 * 64
    assert bisect.tokens_spent < grid.tokens_spent


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(replicates=0), "replicates=0 must be"),
        (dict(replicates=2, evaluate="train_ema"), "replicates=2 compares each k on the same held-out batches"),
        (dict(replicates=2, early_stop=(0.5,)), r"early_stop=\[0.5\] and replicates=2 cannot be combined"),
    ],
)
def test_bad_replicate_settings_are_refused(kwargs, match):
    settings = dict(every_tokens=160, multipliers=(1, 2), window_tokens=64, evaluate="heldout")
    settings.update(kwargs)
    with pytest.raises(LitCBSConfigError, match=match):
        CBSProbeCallback(**settings)


def test_the_forecast_reads_a_replicated_record_as_its_probe_judged_it():
    """Two windows that disagree about k = 2: on the held-out batches alone k = 2 is surely beyond
    epsilon (a bracket [16, 32]); with the spread between windows the data support [16, 64)."""
    import dataclasses

    from lit_cbs.analysis.forecast import supported_interval

    def windows(*offsets):
        return BranchScore.replicated([BranchScore.heldout([3.0 + o + 0.001 * h for h in range(8)]) for o in offsets])

    scores = {1.0: windows(0.0, 0.0), 2.0: windows(0.005, 0.065), 4.0: windows(0.2, 0.2)}
    reading = ProbeReading.decide(
        scores,
        DecisionRule(0.02, 0.9),
        [1, 2, 4],
        16,
        tokens=1024,
        step=1,
        seq_len=8,
        window_tokens=64,
        strategy="grid",
        evaluate="heldout",
        main_loss=3.0,
        branches_trained=[1.0] * 2,
        failed=[],
        tokens_spent=384,
        overhead=1.0,
        replicates=2,
    )
    record = dataclasses.asdict(reading)
    assert not reading.determined
    assert supported_interval(record) == (16.0, 64.0)
    held_out_only = {**record, "replicate_batch_losses": {}}
    assert supported_interval(held_out_only) == (16.0, 32.0)
