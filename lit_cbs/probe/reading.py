"""The decision rule of the CBS probe and the reading it produces: pure Python, no Lightning.

Merrill et al. 2025 ("Critical Batch Size Revisited", arXiv 2505.23971): from a checkpoint trained
with batch B, train each multiplier k of a grid with batch k*B for the same window of tokens, smooth
each branch's loss (an EMA of its step losses, alpha = 0.5) and take k* = the largest k whose loss is
within ``epsilon`` nats of every smaller k's. The CBS lies in [k* B, next k B] samples.

Everything here works on numbers the callback hands over, so the rule can be checked on tables by
hand; statistics of a reading (its noise, confidence) belong here too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lit_cbs.analysis.curves import ema

STRATEGIES = ("grid", "bisect")
EVALUATIONS = ("train_ema", "heldout")


def is_admissible(losses: dict[float, float], k: float, epsilon: float) -> bool:
    """L_k (nats) is finite and within ``epsilon`` of every smaller k's finite loss."""
    if not math.isfinite(losses[k]):
        return False
    return all(losses[k] <= losses[j] + epsilon for j in losses if j < k and math.isfinite(losses[j]))


def critical_multiplier(losses: dict[float, float], epsilon: float) -> float:
    """k* = the largest k such that L_k <= L_j + epsilon for every smaller j in ``losses``.

    ``losses`` maps each multiplier k to its smoothed loss (nats); a failed branch has loss NaN or
    inf and counts as not recovered (it is never chosen and constrains no larger k). The smallest
    finite k is always admissible; if every branch failed, k* is the smallest k.
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
    """
    lower = k_star * batch_size
    larger = [k for k in sorted(multipliers) if k > k_star]
    if not larger:
        return lower, None, lower
    upper = larger[0] * batch_size
    return lower, upper, math.sqrt(lower * upper)


def max_branches(strategy: str, multipliers: int) -> int:
    """Branches one probe trains at most: every multiplier for "grid"; for "bisect", one baseline
    branch plus ceil(log2(multipliers)) others."""
    return multipliers if strategy == "grid" else 1 + math.ceil(math.log2(max(2, multipliers)))


def ema_last(values: Sequence[float], alpha: float) -> float:
    """The EMA (weight ``alpha`` on the newest value) of ``values`` at its last element; NaN if empty."""
    if not len(values):
        return math.nan
    return float(ema(values, decay=1.0 - alpha)[-1])


def measure_losses(
    strategy: str, multipliers: Sequence[float], measure: Callable[[float], float], epsilon: float
) -> dict[float, float]:
    """The loss (nats) of each multiplier the strategy needs, from ``measure(k)``.

    "grid" measures every k. "bisect" measures the smallest k, then bisects the rest of the (sorted)
    grid for the largest admissible k, assuming the admissible ks are a prefix of the grid: about
    log2(len(multipliers)) calls instead of len(multipliers).
    """
    ks = sorted(multipliers)
    if strategy == "grid":
        return {k: measure(k) for k in ks}
    losses = {ks[0]: measure(ks[0])}
    low, high = 0, len(ks) - 1  # ks[low] is admissible; k* lies in ks[low..high]
    while low < high:
        mid = (low + high + 1) // 2
        losses[ks[mid]] = measure(ks[mid])
        if is_admissible(losses, ks[mid], epsilon):
            low = mid
        else:
            high = mid - 1
    return losses


@dataclass
class ProbeReading:
    """One probe's measurement; ``cbs_probe.jsonl`` holds one per line (``dataclasses.asdict``).

    Token counts are global (all ranks); batches and CBS bounds in samples; losses in nats.
    """

    tokens: int  # tokens seen when the window started
    step: int  # optimizer steps taken when the window started
    batch_size: int  # the main run's global batch B over the window
    seq_len: int  # tokens per sample
    window_tokens: int  # tokens every branch trained on
    strategy: str  # "grid" or "bisect"
    evaluate: str  # "train_ema" or "heldout"
    losses: dict[str, float | None]  # per multiplier ("2" for k = 2); None for a failed branch
    main_loss: float  # the main run's own loss over the window (the k = 1 run)
    branches_trained: list[float]  # the multipliers trained as branches, in order
    failed: list[float]  # branches that diverged or ran out of memory
    k_star: float
    cbs_lower: float  # k* B
    cbs_upper: float | None  # the next multiplier's batch; None at the top of the grid
    cbs_estimate: float  # geometric mean of the bounds (the lower bound at the top of the grid)
    tokens_spent: int  # tokens trained in this probe's branches
    overhead: float  # all probes' branch tokens so far / tokens the main run trained on
    adaptive_batch: int | None = None  # the batch CBSAdaptive moved to on this reading, if any

    @classmethod
    def decide(
        cls,
        losses: dict[float, float],
        epsilon: float,
        multipliers: Sequence[float],
        batch_size: int,
        **fields,
    ) -> ProbeReading:
        """Apply the k* rule to ``losses`` (per multiplier k, nats; inf or NaN for a failed branch)
        and bracket the CBS on the grid ``multipliers`` around batch ``batch_size``; ``fields`` gives
        the rest of the reading."""
        k_star = critical_multiplier(losses, epsilon)
        lower, upper, estimate = cbs_interval(k_star, multipliers, batch_size)
        return cls(
            batch_size=batch_size,
            losses={f"{k:g}": (loss if math.isfinite(loss) else None) for k, loss in sorted(losses.items())},
            k_star=k_star,
            cbs_lower=lower,
            cbs_upper=upper,
            cbs_estimate=estimate,
            **fields,
        )

    @property
    def branch_steps(self) -> int:
        """Optimizer steps the branches trained (window_tokens / (k B seq_len) for each k)."""
        return sum(round(self.window_tokens / (k * self.batch_size * self.seq_len)) for k in self.branches_trained)
