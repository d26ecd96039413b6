"""The k* rule of the CBS probe (arXiv 2505.23971), its standard errors and ``ProbeReading``; no Lightning."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lit_cbs.errors import positive_int, positive_number
from lit_cbs.rules.smoothing import ema

__all__ = ["BranchScore", "ProbeReading", "decide", "read_readings"]

SEARCHES = ("grid", "bisect")
# A reading measured elsewhere (a paper's numbers, an own sweep): its required and optional fields.
MINIMAL = (("tokens", "cbs_lower", "cbs_upper"), ("determined", "seq_len", "epsilon"))
EVALUATIONS = ("train_ema", "heldout")


@dataclass(frozen=True)
class BranchScore:
    """One branch's loss (nats; inf or NaN: it failed) and what its uncertainty is made from: its loss on each
    held-out batch (the same batches for every branch, so differences pair up), else the SE of ``loss`` alone;
    ``replicate_losses``: each replicate data window's ``batch_losses``."""

    loss: float
    batch_losses: tuple[float, ...] = ()
    se: float | None = None
    replicate_losses: tuple[tuple[float, ...], ...] = ()

    @classmethod
    def heldout(cls, batch_losses: Sequence[float]) -> BranchScore:
        values = tuple(float(x) for x in batch_losses)
        return cls(sum(values) / len(values), values)

    @classmethod
    def replicated(cls, replicates: Sequence[BranchScore]) -> BranchScore:
        """One k over several data windows on the same held-out batches (failed if one failed)."""
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
        """The EMA of step losses at the last step, with an SE from their scatter (3 or more steps)."""
        loss = float(ema(np.asarray(step_losses, dtype=float), decay=1.0 - alpha)[-1]) if len(step_losses) else math.nan
        if len(step_losses) < 3 or not all(math.isfinite(x) for x in step_losses):
            return cls(loss)
        steps = [b - a for a, b in zip(step_losses, step_losses[1:])]
        variance = sum(d * d for d in steps) / (2 * len(steps))
        return cls(loss, se=math.sqrt(variance * alpha / (2 - alpha)))

    @property
    def failed(self) -> bool:
        return not math.isfinite(self.loss)


@dataclass(frozen=True)
class Difference:
    """L_k - L_j (nats), its SE (None: unknown), its t degrees of freedom, the windows' share of the SE."""

    mean: float
    se: float | None
    dof: float = math.inf
    replicate_se: float | None = None

    def bounds(self, confidence: float) -> tuple[float, float]:
        """The lower and upper one-sided ``confidence`` bounds (nats); (-inf, inf) without an SE above 0.5."""
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


def _variance(values: Sequence[float]) -> float:  # the sample variance
    centre = sum(values) / len(values)
    return sum((v - centre) ** 2 for v in values) / (len(values) - 1)


def difference(a: BranchScore, b: BranchScore) -> Difference:
    """L_a - L_b: paired over held-out batches, else unpaired; replicates add the windows' spread."""
    mean, n, replicates = a.loss - b.loss, len(a.batch_losses), len(a.replicate_losses)
    paired = [x - y for x, y in zip(a.batch_losses, b.batch_losses)]
    if replicates >= 2 and replicates == len(b.replicate_losses) and n >= 2 and n == len(b.batch_losses):
        window_means = [
            sum(x - y for x, y in zip(wa, wb)) / n for wa, wb in zip(a.replicate_losses, b.replicate_losses)
        ]
        batch_part = _variance(paired) / n
        window_part = _variance(window_means) / replicates
        total = batch_part + window_part
        parts = batch_part**2 / (n - 1) + window_part**2 / (replicates - 1)
        dof = total**2 / parts if parts > 0 else math.inf
        return Difference(mean, math.sqrt(total), dof, math.sqrt(window_part))
    if n >= 2 and n == len(b.batch_losses):
        return Difference(mean, math.sqrt(_variance(paired) / n), n - 1)
    if a.se is not None and b.se is not None:
        return Difference(mean, math.hypot(a.se, b.se))
    return Difference(mean, None)


@dataclass(frozen=True)
class Decision:
    """k*, whether the data decide it, per k the SE of L_k - L_base and the windows' share of it."""

    k_star: float
    determined: bool
    loss_se: dict[float, float | None] = field(default_factory=dict)
    replicate_se: dict[float, float] = field(default_factory=dict)


def decide(scores: dict[float, BranchScore], epsilon: float, confidence: float) -> Decision:
    """The k* rule on ``scores`` (per multiplier k), judged at one-sided ``confidence``: determined when k* is within
    ``epsilon`` nats of every smaller k with that confidence and every measured larger k beyond it (a failed branch
    is beyond by definition).

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
    """(admissible, rejected): ks within ``epsilon`` of every smaller finite k, and beyond one."""
    finite = sorted(k for k, s in scores.items() if not s.failed)

    def bounds(k: float, j: float) -> tuple[float, float]:
        return difference(scores[k], scores[j]).bounds(confidence)

    admissible = [k for k in finite if all(bounds(k, j)[1] <= epsilon for j in finite if j < k)]
    rejected = [
        k for k in sorted(scores) if scores[k].failed or any(bounds(k, j)[0] > epsilon for j in finite if j < k)
    ]
    return admissible, rejected


def is_admissible(losses: dict[float, float], k: float, epsilon: float) -> bool:
    """L_k (nats) is finite and within ``epsilon`` of every smaller k's finite loss."""
    if not math.isfinite(losses[k]):
        return False
    return all(losses[k] <= losses[j] + epsilon for j in losses if j < k and math.isfinite(losses[j]))


def critical_multiplier(losses: dict[float, float], epsilon: float) -> float:
    """k* = the largest k within ``epsilon`` of every smaller finite loss (the smallest if none)."""
    if not losses:
        raise ValueError("losses is empty: give at least one multiplier's loss")
    if epsilon < 0:
        raise ValueError(f"epsilon={epsilon} must be >= 0 (nats)")
    admissible = [k for k in sorted(losses) if is_admissible(losses, k, epsilon)]
    return admissible[-1] if admissible else min(losses)


def max_branches(search: str, multipliers: int) -> int:
    """Branches one probe trains at most: every k for "grid"; for "bisect" 1 + ceil(log2(multipliers))."""
    return multipliers if search == "grid" else 1 + math.ceil(math.log2(max(2, multipliers)))


def measure_losses(
    search: str, multipliers: Sequence[float], measure: Callable[[float], BranchScore], epsilon: float
) -> dict[float, BranchScore]:
    """The score of each k ``search`` needs: every k (grid), or bisection for the largest admissible."""
    ks = sorted(multipliers)
    if search == "grid":
        return {k: measure(k) for k in ks}
    scores = {ks[0]: measure(ks[0])}
    low, high = 0, len(ks) - 1  # ks[low] is admissible; k* lies in ks[low..high]
    while low < high:
        mid = (low + high + 1) // 2
        scores[ks[mid]] = measure(ks[mid])
        if is_admissible({k: s.loss for k, s in scores.items()}, ks[mid], epsilon):
            low = mid
        else:
            high = mid - 1
    return scores


@dataclass
class ProbeReading:
    """One probe's measurement: what was measured and what the k* rule decided; ``cbs_probe.jsonl`` holds one per
    line (``to_record``). Tokens global (all ranks), batches and CBS bounds in samples, losses in nats. Only a
    ``determined`` reading says where the CBS is; CBSAdaptive ignores an undetermined one.

    Examples:
        A probe at batch 256 whose k = 2 and 4 branches trained 262,144 tokens (``confidence=0.5``: the means decide):

        >>> scores = {1: BranchScore(3.1), 2: BranchScore(3.103), 4: BranchScore(3.15)}  # nats
        >>> reading = ProbeReading.decide(scores, 0.01, 0.5, [1, 2, 4], 256, tokens=10**6,
        ...     step=100, seq_len=128, window_tokens=262144, search="grid", evaluate="train_ema", main_loss=3.1,
        ...     branches_trained=[2, 4], failed=[], tokens_spent=524288, overhead=0.52)
        >>> reading.k_star, reading.bracket, round(reading.cbs_estimate, 1), reading.branch_steps
        (2, '[512, 1024]', 724.1, 6)
        >>> ProbeReading.from_record(reading.to_record()) == reading
        True
    """

    tokens: int  # when the window started
    step: int  # optimizer steps when the window started
    batch_size: int  # the main run's global batch B over the window
    seq_len: int | None  # tokens per sample (None: a reading measured elsewhere that does not say)
    window_tokens: int  # every branch trained on
    search: str  # "grid" or "bisect"
    evaluate: str  # "train_ema" or "heldout"
    losses: dict[str, float | None]  # per multiplier ("2" for k = 2); None for a failed branch
    main_loss: float  # the main run's own (k = 1) over the window
    branches_trained: list[float]  # in order, once per data window
    failed: list[float]  # branches that diverged, ran out of memory or raised
    k_star: float
    cbs_upper: float | None  # the next multiplier's batch; None at the top of the grid
    tokens_spent: int  # trained in this probe's branches
    overhead: float  # all probes' branch tokens so far / the main run's tokens
    adaptive_batch: int | None = None  # the batch CBSAdaptive moved to on this reading
    determined: bool = True  # k* is decided at `confidence`
    confidence: float = 0.5
    loss_se: dict[str, float | None] = field(default_factory=dict)  # SE of L_k - L_base (base: the smallest k)
    se_method: str = "none"  # how loss_se was made
    batch_losses: dict[str, list[float]] = field(default_factory=dict)  # per k, per held-out batch
    cooldown_fraction: float = 0.0  # share of each branch's steps over which its LR decayed to 0
    planned_window_tokens: int | None = None  # the window before an early stop
    interrupted_at_tokens: int | None = None  # a stop signal interrupted this probe where its window began
    epsilon: float | None = None  # nats
    replicates: int = 1  # disjoint data windows each k trained on
    replicate_se: dict[str, float] = field(default_factory=dict)  # the windows' share of loss_se
    replicate_batch_losses: dict[str, list[list[float]]] = field(default_factory=dict)  # per k, window, batch
    mode: str = "in_process"  # where the branches trained: "in_process", "side_jobs", "checkpoint"; or "elsewhere"
    arrived_at_tokens: int | None = None  # side jobs: the main run's tokens when the reading arrived

    @property
    def cbs_lower(self) -> float:
        return self.k_star * self.batch_size

    @property
    def cbs_estimate(self) -> float:
        """The geometric mean of the bracket (samples); the lower bound at the top of the grid."""
        if self.cbs_upper is None:
            return self.cbs_lower
        return math.sqrt(self.cbs_lower * self.cbs_upper)

    def to_record(self) -> dict[str, Any]:
        """The reading as a line of ``cbs_probe.jsonl``: its fields, cbs_lower and cbs_estimate around cbs_upper."""
        items = list(dataclasses.asdict(self).items())
        at = [key for key, _ in items].index("cbs_upper")
        derived = [("cbs_lower", self.cbs_lower), items[at], ("cbs_estimate", self.cbs_estimate)]
        return dict(items[:at] + derived + items[at + 1 :])

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> ProbeReading:
        """The reading ``record`` holds: ``to_record``'s (a line of ``cbs_probe.jsonl``), or one measured elsewhere
        (``MINIMAL``: no ``losses``), held as a bracket [cbs_lower, cbs_upper] read at k* = 1.

        Examples:
            >>> reading = ProbeReading.from_record({"tokens": 2e9, "cbs_lower": 1024, "cbs_upper": 2048})
            >>> reading.bracket, reading.mode
            ('[1024, 2048]', 'elsewhere')
            >>> ProbeReading.from_record({"tokens": 2e9, "cbs_lower": 1024})
            Traceback (most recent call last):
            ValueError: not a CBS reading: it lacks cbs_upper (one measured elsewhere holds tokens, cbs_lower and \
cbs_upper (null: no upper end); it may hold determined, seq_len and epsilon)
        """
        if "losses" not in record:
            return cls._measured_elsewhere(record)
        fields = {key: value for key, value in record.items() if key not in ("cbs_lower", "cbs_estimate")}
        known, none = dataclasses.fields(cls), dataclasses.MISSING
        missing = sorted({f.name for f in known if f.default is none and f.default_factory is none} - fields.keys())
        wrong = (("lacks", missing), ("has unknown fields", sorted(fields.keys() - {f.name for f in known})))
        if said := [f"{what} {', '.join(names)}" for what, names in wrong if names]:
            raise ValueError(f"not a CBS probe reading: it {' and '.join(said)}")
        return cls(**fields)

    @classmethod
    def _measured_elsewhere(cls, record: Mapping[str, Any]) -> ProbeReading:
        required, optional = MINIMAL
        unknown = sorted(record.keys() - {*required, *optional, "cbs_estimate"})  # cbs_estimate: derived, dropped
        lacks = sorted(set(required) - record.keys())
        wrong = (("lacks", lacks), ("has unknown fields", unknown))
        if said := [f"{what} {', '.join(names)}" for what, names in wrong if names]:
            raise ValueError(
                f"not a CBS reading: it {' and '.join(said)} (one measured elsewhere holds tokens, cbs_lower and "
                "cbs_upper (null: no upper end); it may hold determined, seq_len and epsilon)"
            )
        tokens, lower, upper = (record[key] for key in required)
        for key, value in (("tokens", tokens), ("cbs_lower", lower), ("cbs_upper", upper)):
            if not (value is None and key == "cbs_upper"):
                positive_number(key, value, "tokens" if key == "tokens" else "samples")
        if upper is not None and upper <= lower:
            raise ValueError(f"cbs_upper={upper} must be above cbs_lower={lower} (samples), or null for no upper end")
        if not isinstance(determined := record.get("determined", True), bool):
            raise ValueError(f"determined={determined!r} must be true or false")
        positive_int("seq_len", seq_len := record.get("seq_len"), "tokens per sample", optional=True)
        positive_number("epsilon", epsilon := record.get("epsilon"), "nats", optional=True)
        return cls(
            tokens=tokens, step=0, batch_size=lower, seq_len=seq_len, window_tokens=0, search="elsewhere",
            evaluate="elsewhere", losses={}, main_loss=math.nan, branches_trained=[], failed=[], k_star=1,
            cbs_upper=upper, tokens_spent=0, overhead=0.0, determined=determined, epsilon=epsilon, mode="elsewhere",
        )  # fmt: skip

    @classmethod
    def decide(
        cls,
        scores: dict[float, BranchScore],
        epsilon: float,
        confidence: float,
        multipliers: Sequence[float],
        batch_size: int,
        **fields: Any,
    ) -> ProbeReading:
        """The k* rule (``decide``) on ``scores``, the CBS bracketed on ``multipliers`` x ``batch_size``."""
        decision = decide(scores, epsilon, confidence)
        measured = sorted(scores.items())
        methods = {
            "paired held-out batches and replicate data windows": any(s.replicate_losses for _, s in measured),
            "paired held-out batches": any(s.batch_losses for _, s in measured),
            "step-loss scatter (unpaired, approximate)": any(s.se is not None for _, s in measured),
        }
        return cls(
            batch_size=batch_size,
            losses={f"{k:g}": (s.loss if not s.failed else None) for k, s in measured},
            k_star=decision.k_star,
            cbs_upper=next((k * batch_size for k in sorted(multipliers) if k > decision.k_star), None),
            determined=decision.determined,
            confidence=confidence,
            loss_se={f"{k:g}": se for k, se in decision.loss_se.items()},
            se_method=next((method for method, made in methods.items() if made), "none"),
            batch_losses={f"{k:g}": list(s.batch_losses) for k, s in measured if s.batch_losses},
            replicate_se={f"{k:g}": se for k, se in decision.replicate_se.items()},
            replicate_batch_losses={
                f"{k:g}": [list(w) for w in s.replicate_losses] for k, s in measured if s.replicate_losses
            },
            epsilon=epsilon,
            **fields,
        )

    @property
    def branch_steps(self) -> int:
        """Optimizer steps the branches trained (window_tokens / (k B seq_len) for each k trained)."""
        per_step = self.batch_size * (self.seq_len or 0)  # none trained for a reading measured elsewhere
        return sum(round(self.window_tokens / (k * per_step)) for k in self.branches_trained)

    def scores(self) -> dict[float, BranchScore]:
        """Each measured k's score again (held-out losses where kept), for ``decide`` to judge anew."""

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
        """ "[lower, upper]" in samples ("beyond the grid" at the top), " (undetermined)" after it if so."""
        upper = f"{self.cbs_upper:g}" if self.cbs_upper is not None else "beyond the grid"
        return f"[{self.cbs_lower:g}, {upper}]" + ("" if self.determined else " (undetermined)")


def read_readings(path: str | os.PathLike[str]) -> list[ProbeReading]:
    """The readings of a ``cbs_probe.jsonl``, in file order (blank lines skipped); ValueError naming the file and
    line where it holds something else.

    Examples:
        >>> import os, tempfile
        >>> scores = {1: BranchScore(3.1), 2: BranchScore(3.103)}  # nats
        >>> reading = ProbeReading.decide(scores, 0.01, 0.5, [1, 2], 256, tokens=10**6, step=100,
        ...     seq_len=128, window_tokens=262144, search="grid", evaluate="train_ema", main_loss=3.1,
        ...     branches_trained=[2], failed=[], tokens_spent=262144, overhead=0.26)
        >>> folder = tempfile.TemporaryDirectory()
        >>> path = os.path.join(folder.name, "cbs_probe.jsonl")
        >>> with open(path, "w") as f:
        ...     print(json.dumps(reading.to_record()), file=f)
        >>> [(r.tokens, r.k_star, r.bracket) for r in read_readings(path)]
        [(1000000, 2, '[512, beyond the grid]')]
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
