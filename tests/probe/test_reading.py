"""The decision rule (lit_cbs.probe.reading), on hand-made tables: k*, the CBS interval, bisection,
paired and replicated standard errors, decide, and the reading's record."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import subprocess
import sys

import pytest
from scipy import stats
from toys import heldout_score

from lit_cbs.analysis.probe_schedule import schedule_from_probe
from lit_cbs.probe.reading import (
    BranchScore,
    ProbeReading,
    critical_multiplier,
    decide,
    difference,
    max_branches,
    measure_losses,
    read_readings,
)


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


def test_ema_matches_the_paper_alpha():
    assert BranchScore.train_ema([4.0, 2.0, 1.0], 0.5).loss == pytest.approx(0.5 * 1 + 0.5 * (0.5 * 2 + 0.5 * 4))
    assert BranchScore.train_ema([4.0, 2.0], 1.0).loss == 2.0


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
        0.01,
        0.5,
        [1.0, 2.0, 4.0],
        16,
        tokens=4096,
        step=8,
        seq_len=32,
        window_tokens=8192,
        search="grid",
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
    path.write_text(json.dumps(reading.to_record()) + "\n")
    assert read_readings(path) == [reading]
    # k* at the top of the grid bounds the CBS from below only; the estimate is that bound.
    scores = {1.0: BranchScore(3.0), 2.0: BranchScore(3.004), 4.0: BranchScore(3.006)}
    context = {k: v for k, v in dataclasses.asdict(reading).items() if k in ("tokens", "step", "seq_len")}
    top = ProbeReading.decide(
        scores,
        0.01,
        0.5,
        [1.0, 2.0, 4.0],
        16,
        **context,
        window_tokens=8192,
        search="grid",
        evaluate="train_ema",
        main_loss=3.0,
        branches_trained=[1.0, 2.0, 4.0],
        failed=[],
        tokens_spent=3 * 8192,
        overhead=0.5,
    )
    assert (top.k_star, top.cbs_lower, top.cbs_upper, top.cbs_estimate) == (4.0, 64, None, 64)
    # The record carries its seq_len, so another sequence length needs no measured_seq_len.
    assert schedule_from_probe(path, 16, seq_len=64).batch_size(4096) == 16
    assert schedule_from_probe(path, 16, seq_len=16).batch_size(4096) == 64


def test_a_line_that_is_no_reading_is_named_with_what_it_lacks(tmp_path):
    path = tmp_path / "cbs_probe.jsonl"
    path.write_text('{"tokens": 10, "losses": {"1": 3.1}, "cbs_lower": 4, "cbs_upper": 8, "cbs_estimate": 5.7}\n')
    lacks = r"cbs_probe.jsonl:1: not a CBS probe reading: it lacks batch_size, branches_trained"
    with pytest.raises(ValueError, match=lacks):
        read_readings(path)
    path.write_text('{"tokens": 10, "cbs_lower": 4, "cbs_estimate": 5.7}\n')  # no losses: one measured elsewhere
    with pytest.raises(ValueError, match=r"cbs_probe.jsonl:1: not a CBS reading: it lacks cbs_upper \(one measured"):
        read_readings(path)
    path.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=r"cbs_probe.jsonl:1: '\[1, 2\]' is not a probe reading"):
        read_readings(path)
    record = {field.name: 0 for field in dataclasses.fields(ProbeReading)} | {"mood": "calm"}
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(ValueError, match=r"cbs_probe.jsonl:1: not a CBS probe reading: it has unknown fields mood$"):
        read_readings(path)


def test_the_rule_loads_without_lightning():
    code = "import sys, lit_cbs.probe.reading; print(sorted(m for m in ('lightning', 'torch') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


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
    scores = {k: heldout_score(m, spread, seed=int(k)) for k, m in means.items()}
    decision = decide(scores, epsilon, confidence=0.9)
    assert (decision.k_star, decision.determined) == (k_star, determined)
    assert decision.loss_se[1] is None and decision.loss_se[2] == pytest.approx(difference(scores[2], scores[1]).se)
    assert decide(scores, epsilon, confidence=0.5).determined  # by the means alone, always decided


def test_failed_branches_are_surely_beyond_and_the_record_keeps_the_se(tmp_path):
    scores = {1.0: heldout_score(3.0, 0.001), 2.0: heldout_score(3.001, 0.001, seed=2), 4.0: BranchScore(math.inf)}
    reading = ProbeReading.decide(
        scores,
        0.02,
        0.9,
        [1.0, 2.0, 4.0],
        8,
        tokens=0,
        step=0,
        seq_len=4,
        window_tokens=64,
        search="grid",
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
        0.02,
        0.9,
        [1, 2, 4],
        16,
        tokens=0,
        step=0,
        seq_len=8,
        window_tokens=64,
        search="grid",
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
    assert reading.loss_se["2"] == pytest.approx(gap.se) and reading.replicate_se["2"] == pytest.approx(
        gap.replicate_se
    )
    again = decide(reading.scores(), 0.02, 0.9)
    assert (again.k_star, again.determined) == (reading.k_star, reading.determined)
    assert again.loss_se[2.0] == pytest.approx(gap.se)


def test_the_forecast_reads_a_replicated_record_as_its_probe_judged_it():
    """Two windows that disagree about k = 2: on the held-out batches alone k = 2 is surely beyond
    epsilon (a bracket [16, 32]); with the spread between windows the data support [16, 64)."""
    from lit_cbs.analysis.forecast import supported_interval

    def windows(*offsets):
        return BranchScore.replicated([BranchScore.heldout([3.0 + o + 0.001 * h for h in range(8)]) for o in offsets])

    scores = {1.0: windows(0.0, 0.0), 2.0: windows(0.005, 0.065), 4.0: windows(0.2, 0.2)}
    reading = ProbeReading.decide(
        scores,
        0.02,
        0.9,
        [1, 2, 4],
        16,
        tokens=1024,
        step=1,
        seq_len=8,
        window_tokens=64,
        search="grid",
        evaluate="heldout",
        main_loss=3.0,
        branches_trained=[1.0] * 2,
        failed=[],
        tokens_spent=384,
        overhead=1.0,
        replicates=2,
    )
    assert not reading.determined
    assert supported_interval(reading) == (16.0, 64.0)
    held_out_only = dataclasses.replace(reading, replicate_batch_losses={})
    assert supported_interval(held_out_only) == (16.0, 32.0)
