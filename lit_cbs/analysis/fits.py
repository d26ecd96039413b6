"""E(S) fits: how the steps S and tokens E of constant-batch runs reaching one target loss trade off.

- McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training", arXiv 1812.06162):
  (S / S_min - 1)(E / E_min - 1) = 1, i.e. E = E_min S / (S - S_min); the critical batch
  B_crit = E_min / S_min.
- Zhou et al. 2026 ("How to Set the Batch Size for Large-Scale Pre-training?", arXiv 2601.05034),
  for the stable phase of a warmup-stable-decay LR schedule, where loss curves of different batch
  sizes cross (Zhou et al. 2026, arXiv 2601.05034):

      E(S) = B_-1 / (S - S_min) + B_0     S_min < S < S_1      (hyperbolic)
           = C (S - S_opt)^2 + E_min      S_1 <= S < S_2       (quadratic)
           = A_1 S + A_0                  S >= S_2             (linear)

  fitted with E continuous at S_1 and S_2. B_min = A_1 (below it the target is never reached)
  and B_opt = E_min / S_opt (the batch that needs the fewest tokens).

Units: S in optimizer steps, E in tokens, so every batch size a fit returns is in tokens per step;
``TargetFit`` converts to samples (sequences) with the runs' tokens per sample. Pure numpy/scipy.
"""

from __future__ import annotations

import itertools
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares, minimize, nnls
from scipy.special import expit, softmax

from lit_cbs.analysis.curves import Crossing
from lit_cbs.rules.batch_schedules import PiecewiseBatch

__all__ = [
    "McCandlishFit",
    "TargetFit",
    "WSDFit",
    "batch_group_yaml",
    "fit_mccandlish",
    "fit_targets",
    "fit_wsd",
    "propose_schedule",
    "schedule_yaml",
    "write_schedule_yaml",
]

MCCANDLISH_MIN_RUNS = 3
POOR_FIT = 0.05  # rms of log(E / fitted E) above which fit_targets warns that a fit's batch sizes are unreliable
WSD_FREE_PARAMETERS = 8  # S_min, S_1, S_opt, S_2, B_-1, C, E_min, A_1 (B_0 and A_0 follow from continuity)


def _points(steps, tokens, minimum: int, fit: str) -> tuple[np.ndarray, np.ndarray]:
    steps, tokens = np.asarray(steps, dtype=float), np.asarray(tokens, dtype=float)
    if steps.ndim != 1 or steps.shape != tokens.shape:
        raise ValueError(
            f"{fit}: steps and tokens must be 1-D and of equal length, got shapes {steps.shape} and {tokens.shape}"
        )
    if len(steps) < minimum:
        raise ValueError(f"{fit} needs at least {minimum} runs reaching the target loss, got {len(steps)}")
    if not (np.all(np.isfinite(steps)) and np.all(np.isfinite(tokens)) and np.all(steps > 0) and np.all(tokens > 0)):
        raise ValueError(
            f"{fit}: steps and tokens must be finite and > 0, got steps={steps.tolist()} tokens={tokens.tolist()}"
        )
    return steps, tokens


# ---------------------------------------------------------------------- McCandlish et al. 2018
@dataclass(frozen=True)
class McCandlishFit:
    """(S / S_min - 1)(E / E_min - 1) = 1. ``s_min`` in steps, ``e_min`` in tokens.

    ``rms_log_residual``: root mean square of log(E / fitted E) over the points.

    Examples:
        >>> law = McCandlishFit(s_min=1000.0, e_min=1e8, rms_log_residual=0.0)
        >>> law.b_crit, law.tokens([2000, 500]).tolist()  # tokens per step; E(S) in tokens (NaN below S_min)
        (100000.0, [200000000.0, nan])
    """

    s_min: float
    e_min: float
    rms_log_residual: float

    @property
    def b_crit(self) -> float:
        """The critical batch E_min / S_min, in tokens per step."""
        return self.e_min / self.s_min

    def tokens(self, steps) -> np.ndarray:
        """E(S) = E_min S / (S - S_min) in tokens, for S > S_min steps (NaN elsewhere)."""
        steps = np.asarray(steps, dtype=float)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(steps > self.s_min, self.e_min * steps / (steps - self.s_min), np.nan)


def fit_mccandlish(steps, tokens) -> McCandlishFit:
    """Fit McCandlish et al.'s E(S) to (steps, tokens) of runs reaching one target loss.

    Least squares on log E, started from the linear form E_min / E + S_min / S = 1.

    Args:
        steps: each run's optimizer steps to the target.
        tokens: each run's tokens to the target.

    Returns:
        The fit (S_min in steps, E_min in tokens).

    Raises:
        ValueError: fewer than 3 points, or non-positive or non-finite values.

    Examples:
        With S_min = 1000 steps and E_min = 1e8 tokens, E(S) = 1e8 S / (S - 1000):

        >>> steps = [1500, 2000, 3000, 5000]
        >>> tokens = [3e8, 2e8, 1.5e8, 1.25e8]
        >>> fit = fit_mccandlish(steps, tokens)
        >>> round(fit.s_min, 1), round(fit.e_min), round(fit.b_crit)  # B_crit in tokens per step
        (1000.0, 100000000, 100000)
    """
    steps, tokens = _points(steps, tokens, MCCANDLISH_MIN_RUNS, "fit_mccandlish")
    s_low = steps.min()
    (e_start, s_start), *_ = np.linalg.lstsq(np.column_stack([1 / tokens, 1 / steps]), np.ones(len(steps)), rcond=None)
    if not (0 < s_start < s_low and 0 < e_start < tokens.min()):
        e_start, s_start = 0.5 * tokens.min(), 0.5 * s_low

    def log_residuals(x):
        e_min, s_min = np.exp(x[0]), x[1] * s_low
        return np.log(tokens) - np.log(e_min * steps / (steps - s_min))

    result = least_squares(
        log_residuals, [np.log(e_start), s_start / s_low], bounds=([-np.inf, 0.0], [np.inf, 1 - 1e-9])
    )
    rms = float(np.sqrt(np.mean(result.fun**2)))
    return McCandlishFit(s_min=float(result.x[1] * s_low), e_min=float(np.exp(result.x[0])), rms_log_residual=rms)


# ---------------------------------------------------------------------- Zhou et al. 2026 (WSD)
@dataclass(frozen=True)
class WSDFit:
    """The piecewise E(S) of Zhou et al. 2026. Steps in steps, E in tokens, B_-1 in tokens x steps,
    C in tokens / steps^2, A_1 in tokens per step.

    ``points_per_segment``: how many fitted points fall in the hyperbolic, quadratic and linear
    parts; ``rms_log_residual``: root mean square of log(E / fitted E).

    Examples:
        >>> import numpy as np
        >>> law = WSDFit(s_min=1000, b_minus1=1e11, b_0=5.8e7, s_1=3000, c=2.0, s_opt=5000, e_min=1e8, s_2=8000,
        ...              a_1=1e4, a_0=3.8e7, points_per_segment=(0, 0, 0), rms_log_residual=0.0)
        >>> law.b_opt, law.b_min  # tokens per step
        (20000.0, 10000.0)
        >>> law.tokens([2000, 5000, 10_000]).tolist()  # one point in each part
        [158000000.0, 100000000.0, 138000000.0]
    """

    s_min: float
    b_minus1: float
    b_0: float
    s_1: float
    c: float
    s_opt: float
    e_min: float
    s_2: float
    a_1: float
    a_0: float
    points_per_segment: tuple[int, int, int]
    rms_log_residual: float

    @property
    def b_min(self) -> float:
        """A_1: the smallest batch that reaches the target at all, in tokens per step."""
        return self.a_1

    @property
    def b_opt(self) -> float:
        """E_min / S_opt: the batch that reaches the target with the fewest tokens, in tokens per step."""
        return self.e_min / self.s_opt

    def tokens(self, steps) -> np.ndarray:
        """E(S) in tokens for S > S_min steps (NaN elsewhere)."""
        steps = np.asarray(steps, dtype=float)
        with np.errstate(divide="ignore", invalid="ignore"):
            hyperbolic = self.b_minus1 / (steps - self.s_min) + self.b_0
        quadratic = self.c * (steps - self.s_opt) ** 2 + self.e_min
        linear = self.a_1 * steps + self.a_0
        values = np.where(steps < self.s_1, hyperbolic, np.where(steps < self.s_2, quadratic, linear))
        return np.where(steps > self.s_min, values, np.nan)


def _wsd_design(steps: np.ndarray, s_min: float, s_1: float, s_opt: float, s_2: float) -> np.ndarray:
    """E = X @ (B_-1, C, E_min, A_1), with B_0 and A_0 eliminated by continuity at S_1 and S_2."""
    design = np.zeros((len(steps), 4))
    hyperbolic, linear = steps < s_1, steps >= s_2
    quadratic = ~hyperbolic & ~linear
    design[hyperbolic, 0] = 1 / (steps[hyperbolic] - s_min) - 1 / (s_1 - s_min)
    design[hyperbolic, 1] = (s_1 - s_opt) ** 2
    design[quadratic, 1] = (steps[quadratic] - s_opt) ** 2
    design[linear, 1] = (s_2 - s_opt) ** 2
    design[linear, 3] = steps[linear] - s_2
    design[:, 2] = 1.0
    return design


def fit_wsd(steps, tokens) -> WSDFit:
    """Fit Zhou et al.'s piecewise E(S) to (steps, tokens) of runs reaching one target loss.

    Variable projection: for given S_min < min(S) and breakpoints min(S) < S_1 < S_opt < S_2 < max(S)
    with at least one run in [S_1, S_2) (so every part holds data and E_min is the minimum of the
    quadratic part), B_-1, C, E_min and
    A_1 >= 0 follow from a non-negative least-squares fit of the relative residuals; those four
    positions are then searched on a grid and refined with Nelder-Mead.

    Args:
        steps: each run's optimizer steps to the target (8 runs or more).
        tokens: each run's tokens to the target.

    Returns:
        The fit (steps in steps, E in tokens; ``WSDFit`` lists the units of the others).

    Raises:
        ValueError: fewer than 8 points (the fit's free parameters), or non-positive or non-finite values.

    Examples:
        Eleven runs on an exact WSD law give it back:

        >>> import numpy as np
        >>> law = WSDFit(s_min=1000, b_minus1=1e11, b_0=5.8e7, s_1=3000, c=2.0, s_opt=5000, e_min=1e8, s_2=8000,
        ...              a_1=1e4, a_0=3.8e7, points_per_segment=(0, 0, 0), rms_log_residual=0.0)
        >>> steps = [1200, 1500, 2000, 2500, 3500, 4500, 5500, 6500, 9000, 10_000, 12_000]
        >>> fit = fit_wsd(steps, law.tokens(steps))
        >>> round(fit.b_opt), round(fit.b_min), fit.points_per_segment
        (20000, 10000, (4, 4, 3))
    """
    steps, tokens = _points(steps, tokens, WSD_FREE_PARAMETERS, "fit_wsd")
    s_low, log_low, log_span = steps.min(), np.log(steps.min()), np.log(steps.max() / steps.min())
    if log_span <= 0:
        raise ValueError(f"fit_wsd needs runs at different step counts, got steps={steps.tolist()}")
    weighted_rhs = np.ones(len(steps))

    def positions(u):
        s_min = s_low * expit(u[0])
        fractions = np.cumsum(softmax([u[1], u[2], u[3], 0.0]))[:3]
        s_1, s_opt, s_2 = np.exp(log_low + log_span * fractions)
        return s_min, s_1, s_opt, s_2

    def solve(u):
        s_min, s_1, s_opt, s_2 = positions(u)
        if not s_min < s_low:  # expit rounded to 1: the hyperbola's pole reached the first run
            return None, np.inf
        if not np.any((steps >= s_1) & (steps < s_2)):  # an empty quadratic part could dip anywhere
            return None, np.inf
        coefficients, residual_norm = nnls(_wsd_design(steps, s_min, s_1, s_opt, s_2) / tokens[:, None], weighted_rhs)
        return coefficients, residual_norm**2

    def start(s_min_fraction, t_1, t_opt, t_2):
        fractions = np.array([t_1, t_opt - t_1, t_2 - t_opt, 1 - t_2])
        return np.concatenate([[np.log(s_min_fraction / (1 - s_min_fraction))], np.log(fractions[:3] / fractions[3])])

    t_grid = np.linspace(0.05, 0.95, 10)
    starts = [
        start(s, t_1, t_opt, t_2) for s in (0.3, 0.7, 0.95) for t_1, t_opt, t_2 in itertools.combinations(t_grid, 3)
    ]
    costs = [solve(u)[1] for u in starts]
    best = None
    for index in np.argsort(costs)[:4]:
        result = minimize(
            lambda u: solve(u)[1],
            starts[index],
            method="Nelder-Mead",
            options={"xatol": 1e-7, "fatol": 1e-14, "maxiter": 4000},
        )
        if best is None or result.fun < best.fun:
            best = result
    assert best is not None  # the loop ran: there are 3 x 120 starts
    s_min, s_1, s_opt, s_2 = positions(best.x)
    (b_minus1, c, e_min, a_1), _ = solve(best.x)
    fitted = WSDFit(
        s_min=float(s_min),
        b_minus1=float(b_minus1),
        b_0=float(c * (s_1 - s_opt) ** 2 + e_min - b_minus1 / (s_1 - s_min)),
        s_1=float(s_1),
        c=float(c),
        s_opt=float(s_opt),
        e_min=float(e_min),
        s_2=float(s_2),
        a_1=float(a_1),
        a_0=float(c * (s_2 - s_opt) ** 2 + e_min - a_1 * s_2),
        points_per_segment=(
            int(np.sum(steps < s_1)),
            int(np.sum((steps >= s_1) & (steps < s_2))),
            int(np.sum(steps >= s_2)),
        ),
        rms_log_residual=0.0,
    )
    rms = float(np.sqrt(np.mean(np.log(tokens / fitted.tokens(steps)) ** 2)))
    return WSDFit(**{**fitted.__dict__, "rms_log_residual": rms})


# ---------------------------------------------------------------------- per target loss
@dataclass(frozen=True)
class TargetFit:
    """Both fits for one target loss, with the batch sizes in samples (sequences).

    ``tokens_per_sample`` converts the fits' tokens per step to samples; when it is None (the runs
    log no batch in samples) ``b_crit``, ``b_min`` and ``b_opt`` stay in tokens per step and
    ``unit`` says so. A fit that could not be made is None and its batch sizes NaN.

    Examples:
        >>> fit = TargetFit(target=2.5, crossings=(), tokens_per_sample=1000.0,
        ...                 mccandlish=McCandlishFit(s_min=1000.0, e_min=1e8, rms_log_residual=0.0), wsd=None)
        >>> fit.unit, fit.b_crit, fit.b_opt  # 1e5 tokens per step / 1000 tokens per sample; no WSD fit
        ('samples', 100.0, nan)
    """

    target: float
    crossings: tuple[Crossing, ...]
    tokens_per_sample: float | None
    mccandlish: McCandlishFit | None
    wsd: WSDFit | None

    @property
    def unit(self) -> str:
        return "tokens per step" if self.tokens_per_sample is None else "samples"

    @property
    def runs(self) -> list[str]:
        return [c.run for c in self.crossings]

    @property
    def steps(self) -> np.ndarray:
        return np.array([c.steps for c in self.crossings])

    @property
    def tokens(self) -> np.ndarray:
        return np.array([c.tokens for c in self.crossings])

    def _in_unit(self, tokens_per_step: float | None) -> float:
        if tokens_per_step is None:
            return float("nan")
        return tokens_per_step if self.tokens_per_sample is None else tokens_per_step / self.tokens_per_sample

    @property
    def b_crit(self) -> float:
        """McCandlish et al.'s E_min / S_min, in ``unit``."""
        return self._in_unit(self.mccandlish.b_crit if self.mccandlish else None)

    @property
    def b_min(self) -> float:
        """Zhou et al.'s A_1, in ``unit``."""
        return self._in_unit(self.wsd.b_min if self.wsd else None)

    @property
    def b_opt(self) -> float:
        """Zhou et al.'s E_min / S_opt, in ``unit``."""
        return self._in_unit(self.wsd.b_opt if self.wsd else None)


def fit_targets(
    crossings: Mapping[float, Sequence[Crossing]], tokens_per_sample: float | None = None
) -> list[TargetFit]:
    """Fit both models for every target loss that at least 3 runs reach, highest target (earliest in training) first.

    McCandlish's fit needs 3 runs, the WSD fit 8 (its free parameters); a target with too few runs
    for a fit gets a warning naming the target and the runs it has, and that fit is None. Kept with
    a warning: a fit whose rms log residual exceeds ``POOR_FIT`` (5%; for McCandlish's, E(S) is
    probably not monotone) and a WSD fit with fewer than 2 runs in some part (B_min or B_opt rests
    on 1 run).

    Args:
        crossings: target loss (nats) -> the runs' crossings (``find_crossings``).
        tokens_per_sample: the sequence length (``check_units``), for batch sizes in samples; None
            leaves them in tokens per step.

    Returns:
        One ``TargetFit`` per target with at least 3 runs, highest target first.

    Examples:
        Four runs reach loss 2.5, on McCandlish's law with B_crit = 1e5 tokens per step:

        >>> import warnings
        >>> from lit_cbs.analysis.curves import Crossing
        >>> points = [(1500, 3e8), (2000, 2e8), (3000, 1.5e8), (5000, 1.25e8)]  # (steps, tokens)
        >>> crossings = [Crossing(f"run{i}", 2.5, s, e, e / s, int(e / s / 1000)) for i, (s, e) in enumerate(points)]
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     (fit,) = fit_targets({2.5: crossings}, tokens_per_sample=1000)
        >>> round(fit.b_crit, 2), fit.wsd  # samples; 4 runs are too few for the WSD fit, which warns
        (100.0, None)
        >>> str(caught[0].message)
        'target loss 2.5: 4 runs reach it (run0, run1, run2, run3); the WSD fit (B_min, B_opt) has 8 free ...'
    """
    fits = []
    for target in sorted(crossings, reverse=True):
        points = tuple(crossings[target])
        names = ", ".join(c.run for c in points) or "none"
        if len(points) < MCCANDLISH_MIN_RUNS:
            warnings.warn(
                f"target loss {target:g}: only {len(points)} runs reach it ({names}); E(S) fits need at least "
                f"{MCCANDLISH_MIN_RUNS}: left out"
            )
            continue
        steps = [c.steps for c in points]
        tokens = [c.tokens for c in points]
        mccandlish = fit_mccandlish(steps, tokens)
        if mccandlish.rms_log_residual > POOR_FIT:
            warnings.warn(
                f"target loss {target:g}: McCandlish's E(S) misses the runs by {mccandlish.rms_log_residual:.0%} "
                "(rms of log E); E(S) is probably not monotone (loss curves cross, as under a WSD schedule), "
                "so B_crit is unreliable"
            )
        wsd = None
        if len(points) < WSD_FREE_PARAMETERS:
            warnings.warn(
                f"target loss {target:g}: {len(points)} runs reach it ({names}); the WSD fit (B_min, B_opt) has "
                f"{WSD_FREE_PARAMETERS} free parameters and needs at least {WSD_FREE_PARAMETERS} runs: "
                "B_min and B_opt left out"
            )
        else:
            wsd = fit_wsd(steps, tokens)
            if wsd.rms_log_residual > POOR_FIT:
                warnings.warn(
                    f"target loss {target:g}: the WSD E(S) misses the runs by {wsd.rms_log_residual:.0%} "
                    "(rms of log E), so B_min and B_opt are unreliable"
                )
            thin = [part for part, n in zip(("hyperbolic", "quadratic", "linear"), wsd.points_per_segment) if n < 2]
            if thin:
                warnings.warn(
                    f"target loss {target:g}: the WSD fit has fewer than 2 runs in its {' and '.join(thin)} part(s) "
                    f"(runs per part: {wsd.points_per_segment}); B_min and B_opt are poorly determined there"
                )
        fits.append(TargetFit(target, points, tokens_per_sample, mccandlish, wsd))
    return fits


def _e_min(fit: TargetFit) -> float:
    """E_min (tokens) of a target fit that has a WSD fit."""
    if fit.wsd is None:
        raise RuntimeError(f"target loss {fit.target:g} has no WSD fit")
    return fit.wsd.e_min


def propose_schedule(target_fits: Sequence[TargetFit], multiple_of: int = 1) -> PiecewiseBatch:
    """A batch schedule in tokens that follows B_opt (Zhou et al. 2026) as the loss falls.

    Targets are taken from the highest loss down: the batch is B_opt of the first target from the
    start, and B_opt of each next target from E_min tokens of the previous one on (the tokens its
    optimal batch needs to reach it), i.e. while training heads for a target it uses that target's
    optimal batch. Sizes are in samples, rounded to a multiple of ``multiple_of`` (give micro-batch
    x world size) and never decrease (a smaller B_opt keeps the previous size, with a warning); a
    target whose E_min is not above the previous target's is dropped with a warning.

    Args:
        target_fits: the fits (``fit_targets``); those without a WSD fit are skipped.
        multiple_of: every size is a multiple of it (samples).

    Returns:
        The schedule: sizes in samples, thresholds in tokens.

    Raises:
        ValueError: no target has a WSD fit, the batch is known only in tokens per step, or
            ``multiple_of`` is not a positive int.

    Examples:
        B_opt is 20 samples at loss 3.0 (E_min 1e8 tokens) and 40 at loss 2.5:

        >>> import dataclasses
        >>> import numpy as np
        >>> law = WSDFit(s_min=1000, b_minus1=1e11, b_0=5.8e7, s_1=3000, c=2.0, s_opt=5000, e_min=1e8, s_2=8000,
        ...              a_1=1e4, a_0=3.8e7, points_per_segment=(0, 0, 0), rms_log_residual=0.0)
        >>> fits = [TargetFit(3.0, (), 1000.0, None, law),
        ...         TargetFit(2.5, (), 1000.0, None, dataclasses.replace(law, e_min=4e8, s_opt=10_000))]
        >>> schedule = propose_schedule(fits, multiple_of=8)
        >>> schedule.batch_sizes, schedule.thresholds  # 20 rounds to 16
        ([16, 40], [0, 100000000])
    """
    if isinstance(multiple_of, bool) or not isinstance(multiple_of, int) or multiple_of <= 0:
        raise ValueError(f"multiple_of={multiple_of!r} must be a positive int (samples)")
    usable = sorted((f for f in target_fits if f.wsd is not None), key=lambda f: f.target, reverse=True)
    if not usable:
        raise ValueError("no target loss has a WSD fit (B_opt): it needs at least 8 runs that reach the target")
    if any(f.tokens_per_sample is None for f in usable):
        raise ValueError(
            "mismatched units: B_opt is known only in tokens per step because the runs log no global batch in samples; "
            "log batch/global_size (BatchWarmup does) so the schedule can be given in samples"
        )
    kept: list[TargetFit] = []
    for fit in usable:
        if kept and _e_min(fit) <= _e_min(kept[-1]):
            warnings.warn(
                f"target loss {fit.target:g}: E_min {_e_min(fit):.4g} tokens is not above the previous target's "
                f"({_e_min(kept[-1]):.4g}); target dropped from the schedule"
            )
            continue
        kept.append(fit)
    sizes: list[int] = []
    thresholds: list[int] = []
    for starts_at, fit in zip([0.0] + [_e_min(f) for f in kept[:-1]], kept):
        size = max(multiple_of, int(round(fit.b_opt / multiple_of)) * multiple_of)
        if sizes and size < sizes[-1]:
            warnings.warn(
                f"target loss {fit.target:g}: B_opt {fit.b_opt:.4g} samples is below the previous target's; "
                f"kept at {sizes[-1]}"
            )
            size = sizes[-1]
        if not sizes or size != sizes[-1]:
            sizes.append(size)
            thresholds.append(int(round(starts_at)))
    return PiecewiseBatch(sizes, thresholds, unit="tokens")


def _piecewise_lines(schedule: PiecewiseBatch, indent: str) -> list[str]:
    """``schedule`` as the YAML lines of a ``_target_`` node, each prefixed by ``indent``."""
    return [
        f"{indent}_target_: {type(schedule).__module__}.{type(schedule).__qualname__}",
        f"{indent}batch_sizes: [{', '.join(str(b) for b in schedule.batch_sizes)}]",
        f"{indent}thresholds: [{', '.join(str(t) for t in schedule.thresholds)}]",
        f"{indent}unit: {schedule.unit}",
    ]


def _comment_lines(comment: str) -> list[str]:
    return [f"# {line}" if line else "#" for line in comment.splitlines()]


def schedule_yaml(schedule: PiecewiseBatch, comment: str = "") -> str:
    """A Hydra recipe (``# @package _global_``) that sets ``batch.schedule`` to ``schedule``.

    Args:
        schedule: the schedule (``propose_schedule``).
        comment: lines written as YAML comments at the top.

    Returns:
        The YAML text.

    Examples:
        >>> from lit_cbs.rules.batch_schedules import PiecewiseBatch
        >>> print(schedule_yaml(PiecewiseBatch([16, 40], [0, 100_000_000]), comment="B_opt of 2 targets"))
        # @package _global_
        # B_opt of 2 targets
        batch:
          schedule:
            _target_: lit_cbs.rules.batch_schedules.PiecewiseBatch
            batch_sizes: [16, 40]
            thresholds: [0, 100000000]
            unit: tokens
        <BLANKLINE>
    """
    lines = [
        "# @package _global_",
        *_comment_lines(comment),
        "batch:",
        "  schedule:",
        *_piecewise_lines(schedule, "    "),
    ]
    return "\n".join(lines) + "\n"


def batch_group_yaml(
    schedule: PiecewiseBatch, comment: str = "", lr_rule: str = "sqrt", *, max_micro_batch_size: int | None
) -> str:
    """A ``conf/batch/`` group option (like ``batch/warmup.yaml``) running ``schedule``, the LR following
    each change by ``lr_rule``: save it as ``conf/batch/NAME.yaml`` and select it with ``batch=NAME``.

    ``max_micro_batch_size`` (samples per rank): the micro-batch grows with the batch up to it, then
    the accumulation (``BatchWarmup``'s argument); None keeps the micro-batch at ``data.batch_size`` and
    grows the batch by accumulation alone. Required: a schedule read off one run should train with its
    micro-batch growth (``batch/warmup.yaml`` has 64), not lose it by default.

    Args:
        schedule: the schedule (``propose_schedule``).
        comment: lines written as YAML comments at the top.
        lr_rule: the LR rule at each change (``lit_cbs.rules.scaling.get_lr_rule``'s names).
        max_micro_batch_size: as above (samples per rank), or None.

    Returns:
        The YAML text.

    Examples:
        >>> from lit_cbs.rules.batch_schedules import PiecewiseBatch
        >>> print(batch_group_yaml(PiecewiseBatch([16, 40], [0, 100_000_000]), max_micro_batch_size=16))
        schedule:
          _target_: lit_cbs.rules.batch_schedules.PiecewiseBatch
          batch_sizes: [16, 40]
          thresholds: [0, 100000000]
          unit: tokens
        lr_rule: sqrt
        max_micro_batch_size: 16
        <BLANKLINE>
    """
    lines = [
        *_comment_lines(comment),
        "schedule:",
        *_piecewise_lines(schedule, "  "),
        f"lr_rule: {lr_rule}",
        f"max_micro_batch_size: {'null' if max_micro_batch_size is None else max_micro_batch_size}",
    ]
    return "\n".join(lines) + "\n"


def write_schedule_yaml(schedule: PiecewiseBatch, path: str | os.PathLike, comment: str = "") -> Path:
    """Write ``schedule_yaml(schedule, comment)`` to ``path`` (e.g. ``conf/recipe/my_schedule.yaml``).

    Args:
        schedule: the schedule (a ``PiecewiseBatch``, e.g. ``propose_schedule``'s).
        path: the file to write (a Hydra recipe's YAML); its folder must exist.
        comment: lines written as YAML comments at the top ("" for none).

    Returns:
        ``path``, as a ``Path``.

    Examples:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from lit_cbs.rules.batch_schedules import PiecewiseBatch
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     path = write_schedule_yaml(PiecewiseBatch([16, 40], [0, 100_000_000]), Path(folder, "b_opt.yaml"))
        ...     path.name, path.read_text().splitlines()[0]
        ('b_opt.yaml', '# @package _global_')
    """
    path = Path(path)
    path.write_text(schedule_yaml(schedule, comment))
    return path
