"""The decision rule of the CBS probe and the reading it produces: pure Python, no Lightning.

Merrill et al. 2025 ("Critical Batch Size Revisited", arXiv 2505.23971): from a checkpoint trained
with batch B, train each multiplier k of a grid with batch k*B for the same window of tokens, smooth
each branch's loss (an EMA of its step losses, alpha = 0.5) and take k* = the largest k whose loss is
within ``epsilon`` nats of every smaller k's. The CBS lies in [k* B, next k B] samples.

Every reading carries its uncertainty. With ``evaluate="heldout"`` all branches are scored on the
same held-out batches, so each comparison L_k - L_j is a mean of paired per-batch differences and
has a standard error (SE) from their spread. k is *admissible with confidence c* when the upper
one-sided c-confidence bound of L_k - L_j (Student's t) is at most ``epsilon`` for every smaller j;
k is *rejected with confidence c* when, for some smaller j, the lower bound exceeds ``epsilon``.
The reading's k* is the rule applied to the mean losses; the reading is *determined* when k* is
admissible with confidence and every measured larger k is rejected with confidence, and
*undetermined* otherwise (the data cannot tell k* from its neighbours at that confidence).

The held-out SE covers the held-out batches, not the data the branches trained on: another run,
or the next window of data, moves L_k - L_j by more than it (several times more on small models).
With replicates, each measured k trains on R disjoint windows of the run's data from the same
start, and every comparison's SE adds the spread between windows (``difference``), so a reading's
confidence is not that of the one window of data it happened to train on. With
``evaluate="train_ema"`` branches train on differently grouped batches and no pairing exists: the
SE of each branch's EMA comes from the scatter of its step losses (unpaired, approximate).

Everything here works on numbers the callback hands over, so the rule can be checked on tables by
hand.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lit_cbs.rules.smoothing import ema

__all__ = [
    "BranchScore",
    "Decision",
    "DecisionRule",
    "Difference",
    "ProbeReading",
    "cbs_interval",
    "critical_multiplier",
    "decide",
    "difference",
    "ema_last",
    "is_admissible",
    "max_branches",
    "measure_losses",
    "read_readings",
]

SEARCHES = ("grid", "bisect")  # which multipliers a probe trains (ProbeConfig.search)
EVALUATIONS = ("train_ema", "heldout")
# How a reading's standard errors were made (ProbeReading.se_method).
SE_PAIRED = "paired held-out batches"
SE_REPLICATED = "paired held-out batches and replicate data windows"
SE_STEP_SCATTER = "step-loss scatter (unpaired, approximate)"
SE_NONE = "none"


@dataclass(frozen=True)
class BranchScore:
    """One branch's (or the main window's) loss and what its uncertainty is made from.

    ``batch_losses``: its loss on each held-out batch (nats; the same batches for every branch, so
    differences pair up); empty for ``evaluate="train_ema"``. ``se``: the standard error of ``loss``
    alone, for unpaired comparisons; None when it cannot be estimated.

    Attributes:
        loss: the branch's loss (nats); inf or NaN for a failed branch.
        batch_losses: its loss on each held-out batch (nats), in the held-out batches' order.
        se: the standard error of ``loss`` alone (nats), or None.
        replicate_losses: per replicate data window, its ``batch_losses`` (2+ replicates only).

    Examples:
        >>> score = BranchScore.heldout([2.0, 2.2, 2.4])
        >>> round(score.loss, 4), score.batch_losses, score.failed
        (2.2, (2.0, 2.2, 2.4), False)
        >>> BranchScore(float("inf")).failed
        True
    """

    loss: float  # nats; inf or NaN for a failed branch
    batch_losses: tuple[float, ...] = ()
    se: float | None = None
    replicate_losses: tuple[tuple[float, ...], ...] = ()  # per replicate window, its batch_losses (2+ replicates)

    @classmethod
    def heldout(cls, batch_losses: Sequence[float]) -> BranchScore:
        """The mean of per-batch held-out losses (nats).

        Args:
            batch_losses: the branch's loss on each held-out batch (nats); at least one.

        Returns:
            The score: ``loss`` their mean, ``batch_losses`` the losses as floats, no ``se`` (pairing gives it).

        Examples:
            >>> round(BranchScore.heldout([3.0, 3.5]).loss, 4)
            3.25
        """
        values = tuple(float(x) for x in batch_losses)
        return cls(sum(values) / len(values), values)

    @classmethod
    def replicated(cls, replicates: Sequence[BranchScore]) -> BranchScore:
        """One multiplier measured on several disjoint data windows, each scored on the same held-out
        batches: its loss is the mean over windows and batches, ``batch_losses`` the per-batch means
        over windows, and ``replicate_losses`` keeps each window's, from which ``difference`` estimates
        how much a comparison moves from one window of data to the next. Failed if any window failed.

        Args:
            replicates: one score per data window, each with held-out losses on the same batches.

        Returns:
            The combined score (the one score itself when there is one window; loss inf if any failed).

        Raises:
            ValueError: the windows' scores have no held-out losses, or not on as many batches each.

        Examples:
            >>> score = BranchScore.replicated([BranchScore.heldout([2.0, 2.2]), BranchScore.heldout([2.1, 2.3])])
            >>> round(score.loss, 4), score.batch_losses, score.replicate_losses
            (2.15, (2.05, 2.25), ((2.0, 2.2), (2.1, 2.3)))
        """
        if len(replicates) == 1:
            return replicates[0]
        if any(score.failed for score in replicates):
            return cls(math.inf)
        per_window = tuple(tuple(score.batch_losses) for score in replicates)
        if not per_window[0] or any(len(losses) != len(per_window[0]) for losses in per_window):
            raise ValueError("replicated scores need held-out losses on the same batches in every window")
        means = tuple(sum(column) / len(column) for column in zip(*per_window))
        return cls(sum(means) / len(means), means, replicate_losses=per_window)

    @classmethod
    def train_ema(cls, step_losses: Sequence[float], alpha: float) -> BranchScore:
        """The EMA (weight ``alpha`` on the newest) of step losses at the last step, with an SE from
        their scatter: the step-to-step variance s^2 = mean((x_t - x_{t-1})^2) / 2 (insensitive to a
        slow trend) times the EMA's variance factor alpha / (2 - alpha). Needs 3 or more steps.

        Args:
            step_losses: the branch's loss at each optimizer step (nats), in order.
            alpha: the EMA's weight on the newest step loss, in (0, 1].

        Returns:
            The score: ``loss`` the EMA at the last step (NaN for no steps), ``se`` from the scatter (None for
            fewer than 3 steps or a non-finite loss among them).

        Raises:
            ValueError: ``alpha`` is not in (0, 1] (with at least one step).

        Examples:
            >>> score = BranchScore.train_ema([3.0, 2.9, 2.85, 2.8], alpha=0.5)
            >>> round(score.loss, 4), round(score.se, 4)
            (2.85, 0.0289)
        """
        loss = ema_last(step_losses, alpha)
        if len(step_losses) < 3 or not all(math.isfinite(x) for x in step_losses):
            return cls(loss)
        steps = [b - a for a, b in zip(step_losses, step_losses[1:])]
        variance = sum(d * d for d in steps) / (2 * len(steps))
        return cls(loss, se=math.sqrt(variance * alpha / (2 - alpha)))

    @property
    def failed(self) -> bool:
        """True for a branch that failed: its loss is inf or NaN (diverged, out of memory, raised)."""
        return not math.isfinite(self.loss)


@dataclass(frozen=True)
class Difference:
    """L_k - L_j (nats) with its standard error and the degrees of freedom of its t quantile
    (inf: normal); ``se`` None when neither pairing nor per-branch SEs exist. ``replicate_se``: the
    part of ``se`` that comes from the spread between data windows (replicated scores only).

    ``difference`` makes one from two scores.

    Args:
        mean: L_k - L_j (nats).
        se: its standard error (nats), or None.
        dof: degrees of freedom of its t quantile (inf: normal).
        replicate_se: the share of ``se`` (nats) from the spread between data windows, or None.

    Examples:
        >>> gap = Difference(mean=0.02, se=0.005, dof=4)
        >>> [round(bound, 4) for bound in gap.bounds(confidence=0.9)]  # 0.02 -+ t(0.9, 4) x 0.005
        [0.0123, 0.0277]
        >>> Difference(mean=0.02, se=None).bounds(0.9)  # no SE: nothing is known at any confidence above 0.5
        (-inf, inf)
    """

    mean: float
    se: float | None
    dof: float = math.inf
    replicate_se: float | None = None

    def bounds(self, confidence: float) -> tuple[float, float]:
        """The lower and upper one-sided ``confidence`` bounds of the difference (nats).

        Args:
            confidence: one-sided, in [0.5, 1); 0.5 gives the mean twice.

        Returns:
            (lower, upper) in nats; (-inf, inf) without an SE (above 0.5).
        """
        if self.se is None:
            return (-math.inf, math.inf) if confidence > 0.5 else (self.mean, self.mean)
        quantile = one_sided_quantile(confidence, self.dof)
        return self.mean - quantile * self.se, self.mean + quantile * self.se


def one_sided_quantile(confidence: float, dof: float) -> float:
    """Student's t quantile at ``confidence`` with ``dof`` degrees of freedom (normal for inf); 0 at 0.5."""
    if confidence == 0.5:
        return 0.0
    from scipy import stats  # loaded on first use: the rule itself needs no scipy

    return float(stats.t.ppf(confidence, dof))


def _variance(values: Sequence[float]) -> float:
    centre = sum(values) / len(values)
    return sum((v - centre) ** 2 for v in values) / (len(values) - 1)


def difference(a: BranchScore, b: BranchScore) -> Difference:
    """L_a - L_b: paired over held-out batches when both have them (SE of the mean per-batch
    difference, n - 1 degrees of freedom); else from the two SEs (unpaired, normal).

    Replicated scores (R data windows, the same H held-out batches) add the spread between windows:
    SE^2 = var_h(mean over windows of the batch's difference) / H + var_r(window's mean difference) / R,
    the first the held-out sampling error, the second what a run on other data would move the
    comparison by. The second counts a share of the batch noise again (var_r holds it / H), so the
    sum errs on the wide side. Degrees of freedom: Welch-Satterthwaite's, from H - 1 and R - 1.

    Args:
        a: the score of the larger batch (usually), L_a.
        b: the score it is compared with, L_b.

    Returns:
        L_a - L_b (nats) with its SE (nats; None where neither pairing nor both SEs exist), the degrees of
        freedom of its t quantile (inf: normal) and, for replicated scores, the SE's share from the windows.

    Examples:
        >>> gap = difference(BranchScore.heldout([2.02, 2.21, 2.43]), BranchScore.heldout([2.0, 2.2, 2.4]))
        >>> round(gap.mean, 4), round(gap.se, 4), gap.dof
        (0.02, 0.0058, 2)
        >>> [round(bound, 4) for bound in gap.bounds(confidence=0.9)]  # one-sided 90% bounds, nats
        [0.0091, 0.0309]
    """
    mean = a.loss - b.loss
    n = len(a.batch_losses)
    replicates = len(a.replicate_losses)
    if replicates >= 2 and replicates == len(b.replicate_losses) and n >= 2 and n == len(b.batch_losses):
        window_means = [
            sum(x - y for x, y in zip(wa, wb)) / n for wa, wb in zip(a.replicate_losses, b.replicate_losses)
        ]
        batch_part = _variance([x - y for x, y in zip(a.batch_losses, b.batch_losses)]) / n
        window_part = _variance(window_means) / replicates
        total = batch_part + window_part
        parts = batch_part**2 / (n - 1) + window_part**2 / (replicates - 1)
        dof = total**2 / parts if parts > 0 else math.inf
        return Difference(mean, math.sqrt(total), dof, math.sqrt(window_part))
    if n >= 2 and n == len(b.batch_losses):
        return Difference(
            mean, math.sqrt(_variance([x - y for x, y in zip(a.batch_losses, b.batch_losses)]) / n), n - 1
        )
    if a.se is not None and b.se is not None:
        return Difference(mean, math.hypot(a.se, b.se))
    return Difference(mean, None)


@dataclass(frozen=True)
class DecisionRule:
    """The k* rule's settings: the tolerance ``epsilon`` (nats) within which a larger batch recovers
    the loss, and the one-sided ``confidence`` in [0.5, 1) at which a reading counts as determined
    (0.5 judges by the mean losses alone).

    Attributes:
        epsilon: nats; a larger batch whose loss is within it of every smaller batch's recovered the loss.
        confidence: one-sided, in [0.5, 1); ``ProbeConfig`` checks both when it makes the rule.

    Examples:
        >>> DecisionRule()
        DecisionRule(epsilon=0.01, confidence=0.9)
        >>> DecisionRule(epsilon=0.02, confidence=0.5).epsilon
        0.02
    """

    epsilon: float = 0.01
    confidence: float = 0.9


@dataclass(frozen=True)
class Decision:
    """k* from the mean losses, whether the data decide it at ``confidence``, and each measured
    k's SE of L_k - L_base (base: the smallest measured k). ``decide`` returns one.

    Args:
        k_star: the largest k within ``epsilon`` of every smaller k, on the mean losses.
        determined: whether the data decide k* at the rule's confidence.
        loss_se: per measured k, the SE (nats) of L_k - L_base; None for the base and for a failed branch.
        replicate_se: per k, the windows' share of ``loss_se`` (nats), where known (replicates only).

    Examples:
        Two branches whose 0.005-nat gap cannot be told from 0.01 on three noisy held-out batches:

        >>> decision = decide({1: BranchScore.heldout([3.0, 3.1, 3.2]), 2: BranchScore.heldout([3.0, 3.12, 3.195])},
        ...                   epsilon=0.01, confidence=0.9)
        >>> decision.k_star, decision.determined
        (2, False)
        >>> {k: None if se is None else round(se, 4) for k, se in decision.loss_se.items()}
        {1: None, 2: 0.0076}
    """

    k_star: float
    determined: bool
    loss_se: dict[float, float | None] = field(default_factory=dict)
    replicate_se: dict[float, float] = field(default_factory=dict)  # the windows' share of loss_se, where known


def decide(scores: dict[float, BranchScore], epsilon: float, confidence: float) -> Decision:
    """Apply the k* rule to ``scores`` (per multiplier k) and judge it at ``confidence`` (one-sided,
    in [0.5, 1); 0.5 judges by the means alone): determined when k* is within ``epsilon`` of every
    smaller finite k with that confidence and every measured larger k is beyond ``epsilon`` of some
    smaller k with that confidence (a failed branch is beyond by definition).

    Args:
        scores: each measured multiplier k's score (``BranchScore``); at least one.
        epsilon: the k* rule's tolerance (nats), >= 0.
        confidence: one-sided, in [0.5, 1).

    Returns:
        A ``Decision``: ``k_star``, ``determined``, and per k the SE (nats) of L_k - L_base (base: the smallest
        k; None for the base itself and for a failed branch) and the windows' share of it (replicates only).

    Raises:
        ValueError: ``scores`` is empty or ``epsilon`` is negative (``critical_multiplier``).

    Examples:
        >>> scores = {
        ...     1: BranchScore.heldout([3.0, 3.1, 3.2]),
        ...     2: BranchScore.heldout([3.003, 3.104, 3.202]),  # within 0.01 nats of k = 1 on every batch
        ...     4: BranchScore.heldout([3.05, 3.16, 3.24]),  # about 0.05 nats worse
        ... }
        >>> decision = decide(scores, epsilon=0.01, confidence=0.9)
        >>> decision.k_star, decision.determined
        (2, True)
        >>> {k: None if se is None else round(se, 4) for k, se in decision.loss_se.items()}
        {1: None, 2: 0.0006, 4: 0.0058}
    """
    losses = {k: s.loss for k, s in scores.items()}
    k_star = critical_multiplier(losses, epsilon)
    base = scores[min(scores)]
    gaps = {
        k: (None if k == min(scores) or s.failed or base.failed else difference(s, base))
        for k, s in sorted(scores.items())
    }
    admissible, rejected = judged_multipliers(scores, epsilon, confidence)
    determined = k_star in admissible and all(k in rejected for k in scores if k > k_star)
    return Decision(
        k_star,
        determined,
        {k: None if gap is None else gap.se for k, gap in gaps.items()},
        {k: gap.replicate_se for k, gap in gaps.items() if gap is not None and gap.replicate_se is not None},
    )


def judged_multipliers(
    scores: dict[float, BranchScore], epsilon: float, confidence: float
) -> tuple[list[float], list[float]]:
    """(admissible, rejected), each sorted: the finite k within ``epsilon`` of every smaller finite k
    with ``confidence`` (upper one-sided bound of L_k - L_j), and the k beyond ``epsilon`` of some
    smaller finite k with ``confidence`` (lower bound), a failed branch among them by definition."""
    finite = sorted(k for k, s in scores.items() if not s.failed)

    def bounds(k: float, j: float) -> tuple[float, float]:
        return difference(scores[k], scores[j]).bounds(confidence)

    admissible = [k for k in finite if all(bounds(k, j)[1] <= epsilon for j in finite if j < k)]
    rejected = [
        k for k in sorted(scores) if scores[k].failed or any(bounds(k, j)[0] > epsilon for j in finite if j < k)
    ]
    return admissible, rejected


def is_admissible(losses: dict[float, float], k: float, epsilon: float) -> bool:
    """L_k (nats) is finite and within ``epsilon`` of every smaller k's finite loss.

    Args:
        losses: each multiplier's loss (nats; inf or NaN for a failed branch); must hold ``k``.
        k: the multiplier judged.
        epsilon: the tolerance (nats).

    Returns:
        Whether k recovers the loss of every smaller finite k within ``epsilon``.

    Examples:
        >>> losses = {1: 3.0, 2: 3.005, 4: 3.05}
        >>> is_admissible(losses, 2, epsilon=0.01), is_admissible(losses, 4, epsilon=0.01)
        (True, False)
    """
    if not math.isfinite(losses[k]):
        return False
    return all(losses[k] <= losses[j] + epsilon for j in losses if j < k and math.isfinite(losses[j]))


def critical_multiplier(losses: dict[float, float], epsilon: float) -> float:
    """k* = the largest k such that L_k <= L_j + epsilon for every smaller j in ``losses``.

    ``losses`` maps each multiplier k to its smoothed loss (nats); a failed branch has loss NaN or
    inf and counts as not recovered (it is never chosen and constrains no larger k). The smallest
    finite k is always admissible; if every branch failed, k* is the smallest k.

    Args:
        losses: each multiplier k's smoothed loss (nats).
        epsilon: the tolerance (nats), >= 0.

    Returns:
        k*, one of the keys of ``losses``.

    Raises:
        ValueError: ``losses`` is empty or ``epsilon`` is negative.

    Examples:
        >>> critical_multiplier({1: 3.0, 2: 3.005, 4: 3.05}, epsilon=0.01)
        2
        >>> critical_multiplier({1: 3.0, 2: 3.005, 4: float("nan")}, epsilon=0.01)  # k = 4 failed
        2
    """
    if not losses:
        raise ValueError("losses is empty: give at least one multiplier's loss")
    if epsilon < 0:
        raise ValueError(f"epsilon={epsilon} must be >= 0 (nats)")
    admissible = [k for k in sorted(losses) if is_admissible(losses, k, epsilon)]
    return admissible[-1] if admissible else min(losses)


def cbs_interval(k_star: float, multipliers: Sequence[float], batch_size: int) -> tuple[float, float | None, float]:
    """(lower, upper, estimate) in samples: [k* B, next k B] and their geometric mean.

    At the top of the grid there is no upper end: upper is None and the estimate is the lower
    bound (the CBS is at least that).

    Args:
        k_star: the reading's k* (``critical_multiplier``).
        multipliers: the grid of k the probe could train.
        batch_size: the main run's global batch B (samples).

    Returns:
        (lower, upper, estimate) in samples; upper None at the top of the grid.

    Examples:
        >>> lower, upper, estimate = cbs_interval(2, [1, 2, 4], batch_size=256)
        >>> lower, upper, round(estimate, 1)
        (512, 1024, 724.1)
        >>> cbs_interval(4, [1, 2, 4], batch_size=256)
        (1024, None, 1024)
    """
    lower = k_star * batch_size
    larger = [k for k in sorted(multipliers) if k > k_star]
    if not larger:
        return lower, None, lower
    upper = larger[0] * batch_size
    return lower, upper, math.sqrt(lower * upper)


def max_branches(search: str, multipliers: int) -> int:
    """Branches one probe trains at most: every multiplier for "grid"; for "bisect", one baseline
    branch plus ceil(log2(multipliers)) others.

    Args:
        search: "grid" or "bisect" (``ProbeConfig.search``).
        multipliers: how many multipliers the grid holds.

    Returns:
        The number of branches (per data window).

    Examples:
        >>> max_branches("grid", 8), max_branches("bisect", 8)
        (8, 4)
    """
    return multipliers if search == "grid" else 1 + math.ceil(math.log2(max(2, multipliers)))


def ema_last(values: Sequence[float], alpha: float) -> float:
    """The EMA (weight ``alpha`` on the newest value) of ``values`` at its last element; NaN if empty.

    Args:
        values: the series, in logged order (nats for step losses).
        alpha: the weight on the newest value, in (0, 1].

    Returns:
        The EMA at the last value, in the unit of ``values``.

    Raises:
        ValueError: ``alpha`` is not in (0, 1] (``lit_cbs.rules.smoothing.ema``).

    Examples:
        >>> ema_last([3.0, 2.0], alpha=0.5)
        2.5
    """
    if not len(values):
        return math.nan
    return float(ema(np.asarray(values, dtype=float), decay=1.0 - alpha)[-1])


def measure_losses(
    search: str, multipliers: Sequence[float], measure: Callable[[float], BranchScore], epsilon: float
) -> dict[float, BranchScore]:
    """The score of each multiplier the ``search`` ("grid" or "bisect") needs, from ``measure(k)``.

    "grid" measures every k. "bisect" measures the smallest k, then bisects the rest of the (sorted)
    grid for the largest admissible k, assuming the admissible ks are a prefix of the grid: about
    log2(len(multipliers)) calls instead of len(multipliers). Bisection steers by the mean losses;
    how sure the answer is, ``decide`` says afterwards.

    Args:
        search: "grid" or "bisect".
        multipliers: the grid of k (any order; at least one).
        measure: trains (or looks up) branch k and returns its score.
        epsilon: the k* rule's tolerance (nats) that steers the bisection.

    Returns:
        The score of each multiplier measured, by k.

    Examples:
        >>> losses = {1: 3.0, 2: 3.004, 4: 3.008, 8: 3.05, 16: 3.2}
        >>> scores = measure_losses("bisect", [1, 2, 4, 8, 16], lambda k: BranchScore(losses[k]), epsilon=0.01)
        >>> sorted(scores)  # 3 branches instead of 5: k = 4 is admissible, k = 8 is not
        [1, 4, 8]
    """
    ks = sorted(multipliers)
    if search == "grid":
        return {k: measure(k) for k in ks}
    scores = {ks[0]: measure(ks[0])}
    low, high = 0, len(ks) - 1  # ks[low] is admissible; k* lies in ks[low..high]
    while low < high:
        mid = _bisection_point(low, high)
        scores[ks[mid]] = measure(ks[mid])
        if is_admissible({k: s.loss for k, s in scores.items()}, ks[mid], epsilon):
            low = mid
        else:
            high = mid - 1
    return scores


def _bisection_point(low: int, high: int) -> int:
    return (low + high + 1) // 2


def first_measured(search: str, multipliers: Sequence[float]) -> list[float]:
    """The multipliers ``measure_losses`` measures whatever their losses turn out to be: every k for "grid";
    for "bisect" the smallest k and the first midpoint. A side job trains these before it needs the main
    run's own (k = 1) score, which arrives when the main run's window ends.

    Examples:
        >>> first_measured("bisect", [1, 2, 4, 8, 16])
        [1, 4]
    """
    ks = sorted(multipliers)
    if search == "grid" or len(ks) < 2:
        return ks
    return [ks[0], ks[_bisection_point(0, len(ks) - 1)]]


@dataclass
class ProbeReading:
    """One probe's measurement; ``cbs_probe.jsonl`` holds one per line (``dataclasses.asdict``).

    Token counts are global (all ranks); batches and CBS bounds in samples; losses in nats. Only a
    ``determined`` reading says where the CBS is; an undetermined one keeps its k* (the rule on the
    means) for the record, and CBSAdaptive does not act on it.

    Made by ``ProbeReading.decide`` (the probe's way), read back by ``from_record`` or ``read_readings``.

    Examples:
        A probe at batch 256 that trained k = 2 and k = 4 on a window of 262,144 tokens (train-EMA scores
        have no pairing: with ``confidence=0.5`` the means decide):

        >>> scores = {1: BranchScore(3.1), 2: BranchScore(3.103), 4: BranchScore(3.15)}  # nats
        >>> where = dict(tokens=10**6, step=100, seq_len=128, window_tokens=262144, search="grid",
        ...     evaluate="train_ema", main_loss=3.1, branches_trained=[2, 4], failed=[],
        ...     tokens_spent=524288, overhead=0.52)
        >>> reading = ProbeReading.decide(scores, DecisionRule(confidence=0.5), [1, 2, 4], 256, **where)
        >>> reading.k_star, reading.cbs_lower, reading.cbs_upper, round(reading.cbs_estimate, 1)
        (2, 512, 1024, 724.1)
        >>> reading.bracket, reading.losses
        ('[512, 1024]', {'1': 3.1, '2': 3.103, '4': 3.15})
    """

    tokens: int  # tokens seen when the window started
    step: int  # optimizer steps taken when the window started
    batch_size: int  # the main run's global batch B over the window
    seq_len: int | None  # tokens per sample (None: a reading of the first shape, which had none, read from a file)
    window_tokens: int  # tokens every branch trained on
    search: str  # which multipliers the probe trained: "grid" or "bisect" (ProbeConfig.search)
    evaluate: str  # "train_ema" or "heldout"
    losses: dict[str, float | None]  # per multiplier ("2" for k = 2); None for a failed branch
    main_loss: float  # the main run's own loss over the window (the k = 1 run)
    branches_trained: list[float]  # the multipliers trained as branches, in order (once per data window)
    failed: list[float]  # branches that diverged, ran out of memory or raised
    k_star: float
    cbs_lower: float  # k* B
    cbs_upper: float | None  # the next multiplier's batch; None at the top of the grid
    cbs_estimate: float  # geometric mean of the bounds (the lower bound at the top of the grid)
    tokens_spent: int  # tokens trained in this probe's branches
    overhead: float  # all probes' branch tokens so far / tokens the main run trained on
    adaptive_batch: int | None = None  # the batch CBSAdaptive moved to on this reading, if any
    determined: bool = True  # k* is decided at `confidence` (see the module docstring)
    confidence: float = 0.5  # one-sided confidence of the decision; 0.5 judges by the means alone
    loss_se: dict[str, float | None] = field(default_factory=dict)  # SE of L_k - L_base (base: smallest k)
    se_method: str = SE_NONE  # how loss_se was made
    batch_losses: dict[str, list[float]] = field(default_factory=dict)  # per k, per held-out batch (heldout)
    cooldown_fraction: float = 0.0  # share of each branch's steps over which its LR decayed to 0
    planned_window_tokens: int | None = None  # the window before an early stop (window_tokens: where it ended)
    interrupted_at_tokens: int | None = (
        None  # a stop signal interrupted this probe where its window began, at these tokens
    )
    epsilon: float | None = None  # nats, the k* rule's tolerance (None: a reading that did not store it)
    replicates: int = 1  # disjoint data windows each measured k trained on (window_tokens each)
    replicate_se: dict[str, float] = field(default_factory=dict)  # the windows' share of loss_se (replicates >= 2)
    replicate_batch_losses: dict[str, list[list[float]]] = field(default_factory=dict)  # per k, per window, per batch
    mode: str = "in_process"  # where the branches trained: "in_process", "side_jobs" or "checkpoint" (a saved one)
    arrived_at_tokens: int | None = None  # side jobs: the main run's tokens when the reading arrived (it acted there)

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> ProbeReading:
        """The reading ``record`` holds (a line of ``cbs_probe.jsonl``, an entry of the probe's checkpointed history).

        Args:
            record: the reading's fields by name (``dataclasses.asdict`` of a reading, or a JSON line's object).

        Returns:
            The reading, with the fields of today's version.

        Raises:
            ValueError: the record lacks a field a reading needs, or has one a reading does not know.

        Examples:
            >>> import dataclasses
            >>> scores = {1: BranchScore(3.1), 2: BranchScore(3.103), 4: BranchScore(3.15)}  # nats
            >>> where = dict(tokens=10**6, step=100, seq_len=128, window_tokens=262144, search="grid",
            ...     evaluate="train_ema", main_loss=3.1, branches_trained=[2, 4], failed=[],
            ...     tokens_spent=524288, overhead=0.52)
            >>> reading = ProbeReading.decide(scores, DecisionRule(confidence=0.5), [1, 2, 4], 256, **where)
            >>> ProbeReading.from_record(dataclasses.asdict(reading)) == reading
            True
            >>> ProbeReading.from_record({"tokens": 1, "colour": "red"})  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ValueError: not a CBS probe reading: it lacks batch_size, ... and has unknown fields colour
        """
        fields = dict(record)
        known = dataclasses.fields(cls)
        no_default = dataclasses.MISSING
        needed = {f.name for f in known if f.default is no_default and f.default_factory is no_default}
        missing, unknown = sorted(needed - fields.keys()), sorted(fields.keys() - {f.name for f in known})
        if missing or unknown:
            lacks = f"lacks {', '.join(missing)}" if missing else ""
            extra = f"has unknown fields {', '.join(unknown)}" if unknown else ""
            raise ValueError(f"not a CBS probe reading: it {' and '.join(filter(None, (lacks, extra)))}")
        return cls(**fields)

    @classmethod
    def decide(
        cls,
        scores: dict[float, BranchScore],
        rule: DecisionRule,
        multipliers: Sequence[float],
        batch_size: int,
        **fields,
    ) -> ProbeReading:
        """Apply the k* rule to ``scores`` (per multiplier k; a failed branch has loss inf or NaN),
        judge it at ``rule.confidence`` and bracket the CBS on the grid ``multipliers`` around batch
        ``batch_size`` (samples); ``fields`` gives the rest of the reading (where and how it was measured).

        Args:
            scores: each measured multiplier k's score (``BranchScore``; loss in nats).
            rule: the k* rule's ``epsilon`` (nats) and ``confidence``.
            multipliers: the grid of k the probe could train (it brackets the CBS).
            batch_size: the main run's global batch B (samples).
            **fields: the reading's other fields: ``tokens``, ``step``, ``seq_len``, ``window_tokens``, ``search``,
                ``evaluate``, ``main_loss``, ``branches_trained``, ``failed``, ``tokens_spent``, ``overhead`` and
                any optional one.

        Returns:
            The reading: k*, the CBS bracket in samples, whether it is determined, and the SEs (nats).

        Raises:
            ValueError: ``scores`` is empty or ``rule.epsilon`` is negative.
            TypeError: ``fields`` lacks a field the reading needs, or names one it does not have.

        Examples:
            >>> scores = {1: BranchScore(3.1), 2: BranchScore(3.103), 4: BranchScore(3.15)}  # nats
            >>> where = dict(tokens=10**6, step=100, seq_len=128, window_tokens=262144, search="grid",
            ...     evaluate="train_ema", main_loss=3.1, branches_trained=[2, 4], failed=[],
            ...     tokens_spent=524288, overhead=0.52)
            >>> reading = ProbeReading.decide(scores, DecisionRule(confidence=0.5), [1, 2, 4], 256, **where)
            >>> reading.k_star, reading.determined, reading.se_method
            (2, True, 'none')
            >>> ProbeReading.decide(scores, DecisionRule(confidence=0.9), [1, 2, 4], 256, **where).bracket
            '[512, 1024] (undetermined)'
        """
        decision = decide(scores, rule.epsilon, rule.confidence)
        lower, upper, estimate = cbs_interval(decision.k_star, multipliers, batch_size)
        paired = any(s.batch_losses for s in scores.values())
        replicated = any(s.replicate_losses for s in scores.values())
        unpaired = any(s.se is not None for s in scores.values())
        return cls(
            batch_size=batch_size,
            losses={f"{k:g}": (s.loss if not s.failed else None) for k, s in sorted(scores.items())},
            k_star=decision.k_star,
            cbs_lower=lower,
            cbs_upper=upper,
            cbs_estimate=estimate,
            determined=decision.determined,
            confidence=rule.confidence,
            loss_se={f"{k:g}": se for k, se in decision.loss_se.items()},
            se_method=SE_REPLICATED
            if replicated
            else SE_PAIRED
            if paired
            else SE_STEP_SCATTER
            if unpaired
            else SE_NONE,
            batch_losses={f"{k:g}": list(s.batch_losses) for k, s in sorted(scores.items()) if s.batch_losses},
            replicate_se={f"{k:g}": se for k, se in decision.replicate_se.items()},
            replicate_batch_losses={
                f"{k:g}": [list(w) for w in s.replicate_losses] for k, s in sorted(scores.items()) if s.replicate_losses
            },
            epsilon=rule.epsilon,
            **fields,
        )

    @property
    def branch_steps(self) -> int:
        """Optimizer steps the branches trained (window_tokens / (k B seq_len) for each k).

        Raises:
            ValueError: the reading has no ``seq_len`` (one of the first shape, read from a file).

        Examples:
            >>> scores = {1: BranchScore(3.1), 2: BranchScore(3.103), 4: BranchScore(3.15)}  # nats
            >>> where = dict(tokens=10**6, step=100, seq_len=128, window_tokens=262144, search="grid",
            ...     evaluate="train_ema", main_loss=3.1, branches_trained=[2, 4], failed=[],
            ...     tokens_spent=524288, overhead=0.52)
            >>> reading = ProbeReading.decide(scores, DecisionRule(confidence=0.5), [1, 2, 4], 256, **where)
            >>> reading.branch_steps  # 262,144 tokens: 4 steps of batch 512 x 128, 2 of batch 1024 x 128
            6
        """
        seq_len = self.seq_len
        if seq_len is None:
            raise ValueError("ProbeReading.branch_steps needs seq_len, which a reading of the first shape lacks")
        return sum(round(self.window_tokens / (k * self.batch_size * seq_len)) for k in self.branches_trained)

    def scores(self) -> dict[float, BranchScore]:
        """Each measured k's score again, from the reading: its per-window and per-batch held-out losses where it
        has them, else its loss alone (inf for a failed branch); ``decide`` can judge them anew.

        Returns:
            Each measured multiplier's score, by k (a float).

        Examples:
            >>> scores = {1: BranchScore(3.1), 2: BranchScore(3.103), 4: BranchScore(3.15)}  # nats
            >>> where = dict(tokens=10**6, step=100, seq_len=128, window_tokens=262144, search="grid",
            ...     evaluate="train_ema", main_loss=3.1, branches_trained=[2, 4], failed=[],
            ...     tokens_spent=524288, overhead=0.52)
            >>> reading = ProbeReading.decide(scores, DecisionRule(confidence=0.5), [1, 2, 4], 256, **where)
            >>> {k: score.loss for k, score in reading.scores().items()}
            {1.0: 3.1, 2.0: 3.103, 4.0: 3.15}
            >>> decide(reading.scores(), epsilon=0.05, confidence=0.5).k_star  # judged anew, a wider tolerance
            4.0
        """

        def score(k: str, loss: float | None) -> BranchScore:
            if loss is None:
                return BranchScore(math.inf)
            if k in self.replicate_batch_losses:
                windows = self.replicate_batch_losses[k]
                return BranchScore.replicated([BranchScore.heldout(window) for window in windows])
            if k in self.batch_losses:
                return BranchScore.heldout(self.batch_losses[k])
            return BranchScore(loss)

        return {float(k): score(k, loss) for k, loss in self.losses.items()}

    @property
    def bracket(self) -> str:
        """ "[lower, upper]" in samples, "[lower, beyond the grid]" at the top, and "undetermined"
        after it when the data do not decide k*.

        Examples:
            >>> scores = {1: BranchScore(3.1), 2: BranchScore(3.103), 4: BranchScore(3.15)}  # nats
            >>> where = dict(tokens=10**6, step=100, seq_len=128, window_tokens=262144, search="grid",
            ...     evaluate="train_ema", main_loss=3.1, branches_trained=[2, 4], failed=[],
            ...     tokens_spent=524288, overhead=0.52)
            >>> reading = ProbeReading.decide(scores, DecisionRule(confidence=0.5), [1, 2, 4], 256, **where)
            >>> reading.bracket
            '[512, 1024]'
        """
        upper = f"{self.cbs_upper:g}" if self.cbs_upper is not None else "beyond the grid"
        return f"[{self.cbs_lower:g}, {upper}]" + ("" if self.determined else " (undetermined)")


def read_readings(path: str | os.PathLike) -> list[ProbeReading]:
    """The readings of a ``cbs_probe.jsonl`` (one JSON object per line; blank lines skipped), in file order, as
    any lit_cbs version wrote them (``ProbeReading.from_record``): what the curves, the forecast, the schedules,
    the run report and the plots read.

    Args:
        path: the ``cbs_probe.jsonl`` file.

    Returns:
        The readings, in file order.

    Raises:
        ValueError: the file cannot be read or holds no reading, or a line is not a reading; the message names
            the file and line.

    Examples:
        >>> import dataclasses, json, os, tempfile
        >>> scores = {1: BranchScore(3.1), 2: BranchScore(3.103), 4: BranchScore(3.15)}  # nats
        >>> where = dict(tokens=10**6, step=100, seq_len=128, window_tokens=262144, search="grid",
        ...     evaluate="train_ema", main_loss=3.1, branches_trained=[2, 4], failed=[],
        ...     tokens_spent=524288, overhead=0.52)
        >>> reading = ProbeReading.decide(scores, DecisionRule(confidence=0.5), [1, 2, 4], 256, **where)
        >>> folder = tempfile.TemporaryDirectory()
        >>> path = os.path.join(folder.name, "cbs_probe.jsonl")
        >>> with open(path, "w") as f:
        ...     print(json.dumps(dataclasses.asdict(reading)), file=f)
        >>> [(r.tokens, r.k_star, r.bracket) for r in read_readings(path)]
        [(1000000, 2, '[512, 1024]')]
        >>> with open(path, "a") as f:
        ...     print("[1, 2]", file=f)
        >>> read_readings(path)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: ...cbs_probe.jsonl:2: '[1, 2]' is not a probe reading (a JSON object: tokens, ...)
        >>> folder.cleanup()
    """
    try:
        with open(path) as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(
            f"cannot read CBS probe readings from {path} ({error}); pass the cbs_probe.jsonl a CBSProbeCallback wrote"
        ) from error
    readings = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as error:
            raise ValueError(f"{path}:{number}: not JSON ({error}); each line is one reading") from error
        if not isinstance(record, dict):
            shown = line.strip()[:60]
            raise ValueError(f"{path}:{number}: {shown!r} is not a probe reading (a JSON object: tokens, ...)")
        try:
            readings.append(ProbeReading.from_record(record))
        except ValueError as error:
            raise ValueError(f"{path}:{number}: {error}") from None
    if not readings:
        raise ValueError(
            f"{path} holds no CBS probe reading; run with CBSProbeCallback until a probe finishes, or pass another file"
        )
    return readings
