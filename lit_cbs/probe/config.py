"""``ProbeConfig``: what ``CBSProbeCallback`` is asked to measure, checked once, before any work.

Every setting of the probe, with its unit, and every check that needs no Trainer (``__post_init__``
raises ``LitCBSConfigError`` naming the field, the value and the fix). Checks that need the Trainer
(the batch, the micro-batch, the optimizer) stay in the callback's ``setup`` and first batch.
A recipe can build and check a probe's settings, and where its first probe falls
(``check_inside_run``), before it builds a model.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lit_cbs.errors import LitCBSConfigError, one_of, positive_int, positive_number
from lit_cbs.probe.launchers import SideJobs
from lit_cbs.probe.reading import EVALUATIONS, SEARCHES, BranchScore, DecisionRule, ProbeReading
from lit_cbs.rules.scaling import BETA2_FLOOR, OptimizerRules

__all__ = ["ProbeConfig"]

MAX_EPSILON = 0.5  # nats: a tolerance this wide lets every batch "recover" the loss


@dataclass(frozen=True)
class ProbeConfig:
    """The settings of ``CBSProbeCallback``; token counts are global (all ranks).

    One of ``every_tokens``, ``at_tokens`` and ``geometric`` places the probes of ``CBSProbeCallback`` (a probe
    of a saved checkpoint, ``lit_cbs.probe.probe_checkpoint``, needs none). A point passed while another probe's
    window runs is probed as soon as that window ends.

    Each field below is a keyword argument; the checked fields are kept in a normal form (sorted float
    ``multipliers``, a sorted ``early_stop`` list, a ``Path`` ``output_dir``).

    Raises:
        LitCBSConfigError: a setting out of its range or two that cannot be combined; the message names the field,
            the value and the fix.

    Examples:
        >>> config = ProbeConfig(geometric=(1_000_000, 2), multipliers=[4, 1, 2], window_tokens=262_144)
        >>> config.multipliers, config.early_stop, config.rule
        ([1.0, 2.0, 4.0], [], DecisionRule(epsilon=0.01, confidence=0.9))
        >>> [config.probe_point(i) for i in range(3)]  # tokens
        [1000000, 2000000, 4000000]
        >>> ProbeConfig(every_tokens=1000, at_tokens=[5000])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        lit_cbs.errors.LitCBSConfigError: give one of every_tokens, at_tokens or geometric=(first_tokens, ratio), ...
        >>> ProbeConfig(replicates=2)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        lit_cbs.errors.LitCBSConfigError: replicates=2 compares each k ...: set evaluate='heldout' (or replicates=1)
    """

    every_tokens: int | None = None
    """Probe every this many tokens."""

    at_tokens: Sequence[int] | None = None
    """Probe at these token counts (kept sorted)."""

    geometric: tuple[int, float] | None = None
    """``(first_tokens, ratio)``: probe at first, first*ratio, ... tokens (dense early, where the CBS
    moves fast); ratio > 1, unitless."""

    multipliers: Sequence[float] = (1, 2, 4, 8)
    """The grid of k, unitless (batch k*B samples for each branch), with 1 (the run's own batch) and at
    least one more; kept as sorted floats. Fractions below 1 are used where k*B is a whole number of
    micro-batches on every rank, skipped (and said) otherwise. A run where fewer than two fit at every
    batch of its schedule is refused at its first batch."""

    window_tokens: int = 1_000_000
    """Delta, the tokens every branch trains on (rounded down to a whole number of steps of the
    largest branch)."""

    epsilon: float = 0.01
    """Tolerance of the k* rule in nats (the paper: 0.01; docs/tiny_workload.md has the noise floor of
    small runs), in [0, ``MAX_EPSILON``)."""

    confidence: float = 0.9
    """One-sided confidence in [0.5, 1) with which a k must be within ``epsilon`` of every smaller k (and
    a larger k beyond it) for the reading to be determined; a reading the data cannot decide is recorded
    as undetermined and CBSAdaptive does not act on it. 0.5 judges by the mean losses alone (every
    reading determined)."""

    ema_alpha: float = 0.5
    """Weight in (0, 1] of the newest step loss in the EMA of ``evaluate="train_ema"`` (the paper: 0.5)."""

    lr_rule: Any = "sqrt"
    """LR factor for batch ratio k: a rule name ("sqrt" for Adam, "linear" for SGD, ...) or rule object."""

    weight_decay_rule: str | None = None
    """How each branch's weight decay moves for batch ratio k, as in ``BatchWarmup`` ("timescale", or
    None: unchanged). Beside a BatchWarmup whose batch changes, the three rules must be its own: a branch
    at k x B measures what the run would train after growing its batch k-fold."""

    beta2_rule: str | None = None
    """How each branch's Adam beta2 moves for batch ratio k ("half_life", or None: unchanged)."""

    search: str = "grid"
    """Which k to train: "grid" (every k, the paper's protocol) or "bisect" (the main run as the k = 1
    baseline, bisection over the rest; assumes recovery is monotone in k)."""

    evaluate: str = "train_ema"
    """How a branch is scored: "train_ema" (the paper) or "heldout" (the loss in nats on the first
    ``heldout_batches`` batches of the run's validation data at the window's end, the same batches for
    every branch, so differences pair up). The held-out loss comes from the module's
    ``probe_loss(batch)`` if it has one, else its ``validation_step`` if that returns a loss, else its
    ``training_step``; metrics, logs and RNG streams are left as they were."""

    heldout_batches: int = 8
    """Validation micro-batches (per rank) ``evaluate="heldout"`` scores on."""

    cooldown_fraction: float = 0.0
    """Share in [0, 1) of a branch's last steps over which its LR decays linearly towards 0 (k = 1 then
    trains as a branch too, as the main run does not cool down). Compares branches after an equal short
    LR decay instead of at a constant LR, where a larger batch gains for a while from its lower
    gradient noise alone."""

    early_stop: Sequence[float] | None = None
    """Fractions in (0, 1) of the window (e.g. ``(0.25, 0.5)``) where the probe is tried before the
    window's end: the first at which the reading is determined ends the window there; an undetermined
    one lets the main run go on while the branches resume from where they stopped (their states kept on
    ``snapshot_device`` meanwhile, one per branch). Kept as a sorted list, empty for none."""

    replicates: int = 1
    """Disjoint data windows of ``window_tokens`` each measured k trains on, one after the other, each
    from the same start, so the probe records ``replicates`` x ``window_tokens`` of the main run and its
    branches cost about ``replicates`` times as much (k = 1 trains as a branch on every window but the
    first). Each comparison's standard error then adds how much it moves from one window of data to
    the next, which the held-out SE alone does not cover (the reading's ``replicate_se``). 1 turns it
    off; 2 or more needs ``evaluate="heldout"``."""

    max_overhead: float | None = None
    """Skip a probe that would bring probe tokens above this fraction of the training tokens (unitless)."""

    snapshot_device: str = "cpu"
    """Where snapshots and recorded batches live ("cpu" keeps accelerator memory free)."""

    side_jobs: SideJobs | None = None
    """Train the branches as side jobs (``SideJobs``: a launcher, how a job rebuilds the run, retries) while the
    main run trains on as k = 1, instead of in process while the main run waits (None). Needs a
    ``GlobalOrderLoader`` (the window is handed over as a data position); not with ``early_stop``."""

    output_dir: str | os.PathLike | None = None
    """Folder of ``cbs_probe.jsonl`` and ``cbs_curve.png`` (kept as a Path; None: the logger's log_dir,
    and without a logger nothing is written)."""

    # Added last, so that the fields before it keep their positions.
    beta2_floor: float | None = BETA2_FLOOR
    """The lowest beta2 ``beta2_rule="half_life"`` moves a branch's beta2 to (unitless; None: no floor). Beside
    a BatchWarmup whose batch changes it must be the BatchWarmup's."""

    rules: OptimizerRules = field(init=False, repr=False, compare=False)
    """``lr_rule``, ``weight_decay_rule`` and ``beta2_rule`` (with ``beta2_floor``) as rule objects (set from them)."""

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.every_tokens, self.at_tokens, self.geometric)) > 1:
            raise LitCBSConfigError(
                "give one of every_tokens, at_tokens or geometric=(first_tokens, ratio), not several"
            )
        positive_int("every_tokens", self.every_tokens, "tokens", optional=True)
        if self.at_tokens is not None:
            at_tokens = sorted(int(t) for t in self.at_tokens)
            if not at_tokens or at_tokens[0] <= 0:
                raise LitCBSConfigError(f"at_tokens={at_tokens!r} must be a non-empty list of positive token counts")
            self._set("at_tokens", at_tokens)
        if self.geometric is not None:
            first, ratio = self.geometric
            if not (first > 0 and ratio > 1):
                raise LitCBSConfigError(f"geometric={self.geometric!r} needs first_tokens > 0 and ratio > 1")
            self._set("geometric", tuple(self.geometric))
        multipliers = list(self.multipliers)
        if not multipliers or any(
            isinstance(k, bool) or not (isinstance(k, (int, float)) and k > 0) for k in multipliers
        ):
            raise LitCBSConfigError(f"multipliers={multipliers!r} must be a non-empty list of positive numbers")
        if len(set(multipliers)) != len(multipliers):
            raise LitCBSConfigError(f"multipliers={multipliers!r} has duplicates")
        if len(multipliers) < 2:
            raise LitCBSConfigError(
                f"multipliers={multipliers!r} has one batch size, which brackets no CBS: give at least two, e.g. [1, 2]"
            )
        if not 0.5 <= self.confidence < 1:
            raise LitCBSConfigError(
                f"confidence={self.confidence} must lie in [0.5, 1) (0.9: 90% one-sided; 0.5: the means alone)"
            )
        if not 0 <= self.cooldown_fraction < 1:
            raise LitCBSConfigError(
                f"cooldown_fraction={self.cooldown_fraction} must lie in [0, 1) (share of a branch's steps)"
            )
        early_stop = sorted(float(f) for f in self.early_stop) if self.early_stop is not None else []
        if not all(0 < f < 1 for f in early_stop):
            raise LitCBSConfigError(
                f"early_stop={early_stop!r} must be fractions of the window in (0, 1), e.g. [0.25, 0.5]"
            )
        if early_stop and self.cooldown_fraction:
            raise LitCBSConfigError(
                "early_stop and cooldown_fraction cannot be combined (a branch cut short has not cooled down): drop one"
            )
        if not 0 <= self.epsilon < MAX_EPSILON:
            raise LitCBSConfigError(
                f"epsilon={self.epsilon} must lie in [0, {MAX_EPSILON}) nats: the tolerance within which a larger "
                f"batch counts as recovering the loss (the paper: 0.01); at {MAX_EPSILON} nats or more every batch "
                "recovers and the reading means nothing"
            )
        if not 0 < self.ema_alpha <= 1:
            raise LitCBSConfigError(f"ema_alpha={self.ema_alpha} must lie in (0, 1] (weight of the newest step loss)")
        one_of("search", self.search, SEARCHES)
        if self.search == "bisect" and 1 not in multipliers:
            raise LitCBSConfigError("search='bisect' uses the main run as the k=1 baseline: include 1 in multipliers")
        if 1 not in multipliers:
            raise LitCBSConfigError(
                f"multipliers={multipliers!r} has no k = 1: a reading asks which larger batch k x B recovers the loss "
                "of the run's own batch B within epsilon, so without k = 1 it compares the branches among themselves "
                "and says nothing about the run: include 1"
            )
        self._set("multipliers", sorted(float(k) for k in multipliers))
        positive_int("window_tokens", self.window_tokens, "tokens")
        for name in ("epsilon", "confidence", "cooldown_fraction", "ema_alpha"):
            self._set(name, float(getattr(self, name)))
        self._set("early_stop", early_stop)
        rules = OptimizerRules.build(self.lr_rule, self.weight_decay_rule, self.beta2_rule, self.beta2_floor)
        self._set("rules", rules)
        one_of("evaluate", self.evaluate, EVALUATIONS)
        positive_int("heldout_batches", self.heldout_batches, "validation batches")
        positive_int("replicates", self.replicates, "data windows per measured k")
        if self.replicates > 1 and self.evaluate != "heldout":
            raise LitCBSConfigError(
                f"replicates={self.replicates} compares each k on the same held-out batches across data windows: set "
                "evaluate='heldout' (or replicates=1)"
            )
        if self.replicates > 1 and early_stop:
            raise LitCBSConfigError(
                f"early_stop={early_stop!r} and replicates={self.replicates} cannot be combined "
                "(a reading cut short has not trained its later windows): drop one"
            )
        self._set(
            "max_overhead",
            positive_number("max_overhead", self.max_overhead, "probe tokens / training tokens", optional=True),
        )
        self._set("output_dir", Path(self.output_dir) if self.output_dir is not None else None)
        if self.side_jobs is not None and not isinstance(self.side_jobs, SideJobs):
            raise LitCBSConfigError(
                f"side_jobs={self.side_jobs!r} must be a lit_cbs.probe.SideJobs (or None: in process)"
            )
        if self.side_jobs is not None and not isinstance(self.lr_rule, str):
            raise LitCBSConfigError(
                f"side jobs rebuild the probe's rules by name: give lr_rule as a name ('sqrt', 'linear', ...), not "
                f"{self.lr_rule!r} (or drop side_jobs)"
            )
        if self.side_jobs is not None and early_stop:
            raise LitCBSConfigError(
                f"early_stop={early_stop!r} ends a probe's window early so that the main run waits less; "
                "with side_jobs it never waits: drop early_stop (or side_jobs)"
            )

    def _set(self, name: str, value: Any) -> None:
        """Store a checked field in its normal form (the dataclass is frozen once made)."""
        object.__setattr__(self, name, value)

    @property
    def rule(self) -> DecisionRule:
        """The k* rule's settings (``epsilon``, ``confidence``) for ``ProbeReading.decide``.

        Examples:
            >>> ProbeConfig(epsilon=0.02, confidence=0.5).rule
            DecisionRule(epsilon=0.02, confidence=0.5)
        """
        return DecisionRule(self.epsilon, self.confidence)

    def decide(
        self, scores: dict[float, BranchScore], multipliers: Sequence[float], batch_size: int, **fields: Any
    ) -> ProbeReading:
        """The reading of ``scores`` (per multiplier) by this probe's k* rule on the grid ``multipliers`` around
        the global batch ``batch_size`` (samples), recording the probe's search, scoring and cooldown; ``fields``
        are the rest of the reading (where, on what and at what cost it was measured).

        Args:
            scores: each measured multiplier k's score (loss in nats).
            multipliers: the grid of k the probe could train (it brackets the CBS).
            batch_size: the main run's global batch B (samples).
            **fields: the reading's other fields (``tokens``, ``step``, ``seq_len``, ``window_tokens``,
                ``main_loss``, ``branches_trained``, ``failed``, ``tokens_spent``, ``overhead``, ...).

        Returns:
            The reading (``ProbeReading.decide``), with this probe's ``search``, ``evaluate`` and
            ``cooldown_fraction``.

        Examples:
            >>> from lit_cbs.probe.reading import BranchScore
            >>> config = ProbeConfig(geometric=(1_000_000, 2), multipliers=[4, 1, 2], window_tokens=262_144)
            >>> scores = {1: BranchScore(3.1), 2: BranchScore(3.103), 4: BranchScore(3.15)}  # nats
            >>> reading = config.decide(scores, config.multipliers, 256, tokens=10**6, step=100, seq_len=128,
            ...     window_tokens=262_144, main_loss=3.1, branches_trained=[2.0, 4.0], failed=[],
            ...     tokens_spent=524_288, overhead=0.52)
            >>> reading.search, reading.k_star, reading.bracket  # train-EMA scores carry no SE at 90% confidence
            ('grid', 2, '[512, 1024] (undetermined)')
        """
        return ProbeReading.decide(
            scores,
            self.rule,
            multipliers,
            batch_size,
            search=self.search,
            evaluate=self.evaluate,
            cooldown_fraction=self.cooldown_fraction,
            **fields,
        )

    @property
    def span_tokens(self) -> int:
        """Tokens of the main run one probe records (``replicates`` windows of ``window_tokens``, at most).

        Examples:
            >>> ProbeConfig(window_tokens=262_144, replicates=2, evaluate="heldout").span_tokens
            524288
        """
        return self.window_tokens * self.replicates

    def probe_point(self, index: int) -> float:
        """Token count of the index-th probe (0-based); inf past the last of ``at_tokens``.

        Args:
            index: which probe, 0 for the first.

        Returns:
            Its point in tokens (global); inf where none is placed (past ``at_tokens``, or no placement).

        Examples:
            >>> ProbeConfig(every_tokens=500_000).probe_point(2)
            1500000
            >>> ProbeConfig(at_tokens=[20_000, 10_000]).probe_point(0), ProbeConfig(at_tokens=[10_000]).probe_point(1)
            (10000, inf)
        """
        if self.every_tokens is not None:
            return self.every_tokens * (index + 1)
        if self.at_tokens is not None:
            return self.at_tokens[index] if index < len(self.at_tokens) else math.inf
        if self.geometric is None:  # no placement: a probe of a saved checkpoint, which probes at its step
            return math.inf
        first, ratio = self.geometric
        return round(first * ratio**index)

    def points_before(self, end_tokens: float, next_probe: int = 0) -> Iterator[float]:
        """The probe points (tokens) from the ``next_probe``-th (0-based) on that lie before ``end_tokens``.

        Args:
            end_tokens: tokens (global); a point at or past it is not given.
            next_probe: the index of the first point given.

        Returns:
            An iterator of the points, in order (endless for ``end_tokens=inf`` with every_tokens or geometric).

        Examples:
            >>> config = ProbeConfig(geometric=(1_000_000, 2), multipliers=[4, 1, 2], window_tokens=262_144)
            >>> list(config.points_before(5_000_000)), list(config.points_before(5_000_000, next_probe=1))
            ([1000000, 2000000, 4000000], [2000000, 4000000])
        """
        index = next_probe
        while (point := self.probe_point(index)) < end_tokens:
            yield point
            index += 1

    def check_inside_run(
        self,
        run_end_tokens: int,
        limit: str,
        *,
        whole_span: bool = False,
        next_probe: int = 0,
        window_tokens: int | None = None,
    ) -> None:
        """Raise ``LitCBSConfigError`` when the ``next_probe``-th probe cannot run before the run ends at
        ``run_end_tokens`` tokens (by ``limit``, e.g. "max_tokens=4096"): its point lies at or past the end,
        or, with ``whole_span``, its span ends past it: ``replicates`` windows of ``window_tokens`` tokens,
        what its window records where the caller knows it (the setting rounded down to whole steps of the
        largest branch at the batch the probe runs at), else the setting. Call it before any work: a
        recipe with its max_tokens (the budget is final), the callback at a fresh run's first batch with
        the run's latest end (a window that only a batch other than the schedule's would push past the
        end is decided when the probe is due).

        Args:
            run_end_tokens: the run's (latest) end, in tokens (global).
            limit: the limit that ends it there, as the message should name it.
            whole_span: refuse a probe whose span, not only its point, ends past the run's end.
            next_probe: the index of the probe checked (0: the first).
            window_tokens: the tokens one window records where the caller knows them (None: ``window_tokens``).

        Raises:
            LitCBSConfigError: the probe cannot run before the run ends.

        Examples:
            >>> config = ProbeConfig(geometric=(1_000_000, 2), multipliers=[4, 1, 2], window_tokens=262_144)
            >>> config.check_inside_run(2_000_000, "max_tokens=2000000", whole_span=True)  # 1,262,144 <= 2,000,000
            >>> config.check_inside_run(1_200_000, "max_tokens=1200000", whole_span=True)  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            lit_cbs.errors.LitCBSConfigError: the first probe (1,000,000 tokens + window_tokens=262,144) ends past ...
        """
        point = self.probe_point(next_probe)
        window = self.window_tokens if window_tokens is None else window_tokens
        if whole_span and point + window * self.replicates > run_end_tokens:
            windows = f"{self.replicates} x " if self.replicates > 1 else ""
            rounded = f", {window:,} in whole steps of its largest branch" if window != self.window_tokens else ""
            raise LitCBSConfigError(
                f"the first probe ({point:,} tokens + {windows}window_tokens={self.window_tokens:,}{rounded}) "
                f"ends past {limit}, so it never runs; probe earlier (every_tokens, at_tokens or geometric)"
            )
        if point >= run_end_tokens:
            raise LitCBSConfigError(
                f"no probe point lies inside the run: the first is at {point:,.0f} tokens but the run ends by "
                f"{limit} at {run_end_tokens:,} tokens or sooner; probe earlier (every_tokens, at_tokens or geometric)"
            )
