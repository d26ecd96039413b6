"""E(S) fits (McCandlish et al. 2018: B_crit; Zhou et al. 2026 for WSD: B_min, B_opt), batch sizes in tokens per
step (``TargetFit``'s in samples); the schedule following B_opt; the fits beside the noise scale and the probe."""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import ArrayLike
from scipy.optimize import least_squares, minimize, nnls
from scipy.special import expit, softmax

from lit_cbs.analysis.curves import Crossing, RunCurve
from lit_cbs.probe.reading import ProbeReading
from lit_cbs.rules.batch_schedules import PiecewiseBatch

MCCANDLISH_MIN_RUNS = 3
POOR_FIT = 0.05  # rms of log(E / fitted E) above which fit_targets warns that a fit's batch sizes are unreliable
WSD_FREE_PARAMETERS = 8  # S_min, S_1, S_opt, S_2, B_-1, C, E_min, A_1 (B_0 and A_0 follow from continuity)


def _points(steps: ArrayLike, tokens: ArrayLike, minimum: int, fit: str) -> tuple[np.ndarray, np.ndarray]:
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


@dataclass(frozen=True)
class McCandlishFit:
    """McCandlish et al.'s (S / S_min - 1)(E / E_min - 1) = 1: ``s_min`` steps, ``e_min`` tokens;
    ``rms_log_residual``: of log(E / fitted E) over the points."""

    s_min: float
    e_min: float
    rms_log_residual: float

    @property
    def b_crit(self) -> float:
        """The critical batch E_min / S_min, in tokens per step."""
        return self.e_min / self.s_min

    def tokens(self, steps: ArrayLike) -> np.ndarray:
        """E(S) = E_min S / (S - S_min) in tokens, for S > S_min steps (NaN elsewhere)."""
        steps = np.asarray(steps, dtype=float)
        with np.errstate(divide="ignore", invalid="ignore"):
            values: np.ndarray = np.where(steps > self.s_min, self.e_min * steps / (steps - self.s_min), np.nan)
        return values


def fit_mccandlish(steps: ArrayLike, tokens: ArrayLike) -> McCandlishFit:
    """McCandlish et al.'s E(S) fitted to (steps, tokens) of 3 or more runs, by least squares on log E."""
    steps, tokens = _points(steps, tokens, MCCANDLISH_MIN_RUNS, "fit_mccandlish")
    s_low = steps.min()
    (e_start, s_start), *_ = np.linalg.lstsq(np.column_stack([1 / tokens, 1 / steps]), np.ones(len(steps)), rcond=None)
    if not (0 < s_start < s_low and 0 < e_start < tokens.min()):
        e_start, s_start = 0.5 * tokens.min(), 0.5 * s_low

    def log_residuals(x: np.ndarray) -> np.ndarray:
        e_min, s_min = np.exp(x[0]), x[1] * s_low
        return np.asarray(np.log(tokens) - np.log(e_min * steps / (steps - s_min)))

    result = least_squares(
        log_residuals, [np.log(e_start), s_start / s_low], bounds=([-np.inf, 0.0], [np.inf, 1 - 1e-9])
    )
    rms = float(np.sqrt(np.mean(result.fun**2)))
    return McCandlishFit(s_min=float(result.x[1] * s_low), e_min=float(np.exp(result.x[0])), rms_log_residual=rms)


@dataclass(frozen=True)
class WSDFit:
    """Zhou et al.'s piecewise E(S): steps in steps, E in tokens, B_-1 in tokens x steps, C in tokens / steps^2, A_1
    in tokens per step; ``points_per_segment``: points in the hyperbolic, quadratic and linear parts."""

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

    def tokens(self, steps: ArrayLike) -> np.ndarray:
        """E(S) in tokens for S > S_min steps (NaN elsewhere)."""
        steps = np.asarray(steps, dtype=float)
        with np.errstate(divide="ignore", invalid="ignore"):
            hyperbolic = self.b_minus1 / (steps - self.s_min) + self.b_0
        quadratic = self.c * (steps - self.s_opt) ** 2 + self.e_min
        linear = self.a_1 * steps + self.a_0
        values = np.where(steps < self.s_1, hyperbolic, np.where(steps < self.s_2, quadratic, linear))
        return np.asarray(np.where(steps > self.s_min, values, np.nan))


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


def fit_wsd(steps: ArrayLike, tokens: ArrayLike) -> WSDFit:
    """Zhou et al.'s E(S) fitted to (steps, tokens) of 8 or more runs, by variable projection."""
    steps, tokens = _points(steps, tokens, WSD_FREE_PARAMETERS, "fit_wsd")
    s_low, log_low, log_span = steps.min(), np.log(steps.min()), np.log(steps.max() / steps.min())
    if log_span <= 0:
        raise ValueError(f"fit_wsd needs runs at different step counts, got steps={steps.tolist()}")
    weighted_rhs = np.ones(len(steps))

    def positions(u: np.ndarray) -> tuple[float, float, float, float]:
        s_min = s_low * expit(u[0])
        fractions = np.cumsum(softmax([u[1], u[2], u[3], 0.0]))[:3]
        s_1, s_opt, s_2 = np.exp(log_low + log_span * fractions)
        return s_min, s_1, s_opt, s_2

    def solve(u: np.ndarray) -> tuple[Any, float]:
        s_min, s_1, s_opt, s_2 = positions(u)
        if not s_min < s_low:  # expit rounded to 1: the hyperbola's pole reached the first run
            return None, np.inf
        if not np.any((steps >= s_1) & (steps < s_2)):  # an empty quadratic part could dip anywhere
            return None, np.inf
        coefficients, residual_norm = nnls(_wsd_design(steps, s_min, s_1, s_opt, s_2) / tokens[:, None], weighted_rhs)
        return coefficients, residual_norm**2

    def start(s_min_fraction: float, t_1: float, t_opt: float, t_2: float) -> np.ndarray:
        fractions = np.array([t_1, t_opt - t_1, t_2 - t_opt, 1 - t_2])
        return np.concatenate([[np.log(s_min_fraction / (1 - s_min_fraction))], np.log(fractions[:3] / fractions[3])])

    t_grid = np.linspace(0.05, 0.95, 10)
    starts = [
        start(s, t_1, t_opt, t_2) for s in (0.3, 0.7, 0.95) for t_1, t_opt, t_2 in itertools.combinations(t_grid, 3)
    ]
    options = {"xatol": 1e-7, "fatol": 1e-14, "maxiter": 4000}
    results = [
        minimize(lambda u: solve(u)[1], starts[i], method="Nelder-Mead", options=options)
        for i in np.argsort([solve(u)[1] for u in starts])[:4]
    ]
    best = min(results, key=lambda result: result.fun)  # the first of the lowest, as the search went
    s_min, s_1, s_opt, s_2 = positions(best.x)
    (b_minus1, c, e_min, a_1), _ = solve(best.x)
    b_0 = c * (s_1 - s_opt) ** 2 + e_min - b_minus1 / (s_1 - s_min)
    a_0 = c * (s_2 - s_opt) ** 2 + e_min - a_1 * s_2
    parts = (int(np.sum(steps < s_1)), int(np.sum((steps >= s_1) & (steps < s_2))), int(np.sum(steps >= s_2)))
    s_min, b_minus1, b_0, s_1, c, s_opt, e_min, s_2, a_1, a_0 = map(
        float, (s_min, b_minus1, b_0, s_1, c, s_opt, e_min, s_2, a_1, a_0)
    )
    fitted = WSDFit(s_min, b_minus1, b_0, s_1, c, s_opt, e_min, s_2, a_1, a_0, parts, 0.0)
    rms = float(np.sqrt(np.mean(np.log(tokens / fitted.tokens(steps)) ** 2)))
    return dataclasses.replace(fitted, rms_log_residual=rms)


@dataclass(frozen=True)
class TargetFit:
    """Both fits for one target loss (None: not made; its batch sizes NaN), with batch sizes in samples."""

    target: float
    crossings: tuple[Crossing, ...]
    tokens_per_sample: float
    mccandlish: McCandlishFit | None
    wsd: WSDFit | None

    @property
    def b_crit(self) -> float:
        return self.mccandlish.b_crit / self.tokens_per_sample if self.mccandlish else math.nan

    @property
    def b_min(self) -> float:
        return self.wsd.b_min / self.tokens_per_sample if self.wsd else math.nan

    @property
    def b_opt(self) -> float:
        return self.wsd.b_opt / self.tokens_per_sample if self.wsd else math.nan


def fit_targets(crossings: Mapping[float, Sequence[Crossing]], tokens_per_sample: float) -> list[TargetFit]:
    """Both fits per target loss reached by 3 or more runs, highest target first; warns where a fit is unreliable."""
    fits = []
    for target in sorted(crossings, reverse=True):
        points = tuple(crossings[target])
        names, at = ", ".join(c.run for c in points) or "none", f"target loss {target:g}"
        if len(points) < MCCANDLISH_MIN_RUNS:
            warnings.warn(
                f"{at}: only {len(points)} runs reach it ({names}); E(S) fits need at least "
                f"{MCCANDLISH_MIN_RUNS}: left out"
            )
            continue
        steps, tokens = [c.steps for c in points], [c.tokens for c in points]
        mccandlish = fit_mccandlish(steps, tokens)
        wsd = fit_wsd(steps, tokens) if len(points) >= WSD_FREE_PARAMETERS else None
        if mccandlish.rms_log_residual > POOR_FIT:
            warnings.warn(
                f"{at}: McCandlish's E(S) misses the runs by {mccandlish.rms_log_residual:.0%} (rms of log E); E(S) is "
                "probably not monotone (loss curves cross, as under a WSD schedule), so B_crit is unreliable"
            )
        if wsd is None:
            warnings.warn(
                f"{at}: {len(points)} runs reach it ({names}); the WSD fit (B_min, B_opt) has {WSD_FREE_PARAMETERS} "
                f"free parameters and needs at least {WSD_FREE_PARAMETERS} runs: B_min and B_opt left out"
            )
        elif wsd.rms_log_residual > POOR_FIT:
            warnings.warn(
                f"{at}: the WSD E(S) misses the runs by {wsd.rms_log_residual:.0%} (rms of log E), so B_min and "
                "B_opt are unreliable"
            )
        parts = zip(("hyperbolic", "quadratic", "linear"), wsd.points_per_segment if wsd else ())
        if thin := [part for part, n in parts if n < 2]:
            warnings.warn(
                f"{at}: the WSD fit has fewer than 2 runs in its {' and '.join(thin)} part(s) (runs per part: "
                f"{wsd and wsd.points_per_segment}); B_min and B_opt are poorly determined there"
            )
        fits.append(TargetFit(target, points, tokens_per_sample, mccandlish, wsd))
    return fits


def propose_schedule(target_fits: Sequence[TargetFit], multiple_of: int = 1) -> PiecewiseBatch:
    """A token-indexed schedule of B_opt: the highest target's from the start, each next one's from the previous
    target's E_min tokens on; rounded to ``multiple_of`` samples, never decreasing (warned)."""
    if isinstance(multiple_of, bool) or not isinstance(multiple_of, int) or multiple_of <= 0:
        raise ValueError(f"multiple_of={multiple_of!r} must be a positive int (samples)")
    kept: list[tuple[float, TargetFit]] = []  # (E_min, fit) of the fits with B_opt, highest target first
    for fit in sorted(target_fits, key=lambda f: f.target, reverse=True):
        if fit.wsd is not None and kept and fit.wsd.e_min <= kept[-1][0]:
            warnings.warn(
                f"target loss {fit.target:g}: E_min {fit.wsd.e_min:.4g} tokens is not above the previous target's "
                f"({kept[-1][0]:.4g}); target dropped from the schedule"
            )
        elif fit.wsd is not None:
            kept.append((fit.wsd.e_min, fit))
    if not kept:
        raise ValueError("no target loss has a WSD fit (B_opt): it needs at least 8 runs that reach the target")
    sizes: list[int] = []
    thresholds: list[int] = []
    for starts_at, (_, fit) in zip([0.0] + [e for e, _ in kept[:-1]], kept):
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


def _schedule_yaml(schedule: PiecewiseBatch, comment: str, keys: Sequence[str], **tail: object) -> str:
    """``schedule`` nested under ``keys``, ``comment`` on top as YAML comments, ``tail`` below."""
    import yaml

    node: dict[str, object] = {"_target_": f"{type(schedule).__module__}.{type(schedule).__qualname__}"}
    node |= {"batch_sizes": schedule.batch_sizes, "thresholds": schedule.thresholds, "unit": schedule.unit}
    for key in reversed(keys):
        node = {key: node}
    comments = "".join(f"# {line}\n" if line else "#\n" for line in comment.splitlines())
    return comments + str(yaml.safe_dump({**node, **tail}, sort_keys=False, default_flow_style=None, width=1000))


def batch_group_yaml(
    schedule: PiecewiseBatch, comment: str = "", lr_rule: str = "sqrt", *, max_micro_batch_size: int | None
) -> str:
    """A ``conf/batch/`` option running ``schedule`` with ``lr_rule``; ``max_micro_batch_size`` (None: accumulation
    alone) is required so that a schedule read off one run keeps its micro-batch growth."""
    return _schedule_yaml(schedule, comment, ("schedule",), lr_rule=lr_rule, max_micro_batch_size=max_micro_batch_size)


def write_schedule_yaml(schedule: PiecewiseBatch, path: str | os.PathLike[str], comment: str = "") -> Path:
    """Write a Hydra recipe (``# @package _global_``) setting ``batch.schedule`` to ``path``."""
    path = Path(path)
    path.write_text("# @package _global_\n" + _schedule_yaml(schedule, comment, ("batch", "schedule")))
    return path


@dataclass(frozen=True)
class SideBySide:
    """One target loss; batch sizes in samples, NaN or None where nothing is known. ``probe_run_tokens``: where the
    run at the probe's batch reached the target; ``b_crit_poor``, ``wsd_poor``: the fit misses by over ``POOR_FIT``."""

    target: float
    b_crit: float
    b_min: float
    b_opt: float
    b_simple: float
    b_simple_runs: int
    probe_run_tokens: float | None
    probe: ProbeReading | None
    b_crit_poor: bool = False
    wsd_poor: bool = False


def side_by_side(
    fits: Sequence[TargetFit], runs: Sequence[RunCurve], probe: Sequence[ProbeReading] = ()
) -> list[SideBySide]:
    """One ``SideBySide`` per fit: B_simple as the median over ``runs`` of its value where each reached the target;
    the ``probe`` reading nearest the tokens at which the run at the probe's batch reached it."""
    by_name, rows = {run.name: run for run in runs}, []
    for fit in fits:
        values = [  # B_simple where each run reached the target (read_run keeps its finite values)
            float(np.interp(c.tokens, run.gns_tokens, run.gns))
            for c in fit.crossings
            if (run := by_name.get(c.run)) is not None
            and run.gns.size
            and run.gns_tokens[0] <= c.tokens <= run.gns_tokens[-1]
        ]
        run_tokens, reading = None, None  # where the run at the probe's batch reached the target, the nearest reading
        for crossing in fit.crossings:
            if readings := [p for p in probe if p.batch_size == crossing.batch_size]:
                run_tokens = crossing.tokens
                reading = min(readings, key=lambda p: abs(math.log(p.tokens / crossing.tokens)))
                break
        crit_poor = fit.mccandlish is not None and fit.mccandlish.rms_log_residual > POOR_FIT
        wsd_poor = fit.wsd is not None and fit.wsd.rms_log_residual > POOR_FIT
        b_simple = float(np.median(values)) if values else math.nan
        sizes = (fit.b_crit, fit.b_min, fit.b_opt, b_simple)
        rows.append(SideBySide(fit.target, *sizes, len(values), run_tokens, reading, crit_poor, wsd_poor))
    return rows


def side_by_side_markdown(rows: Sequence[SideBySide]) -> str:
    """``rows`` as a markdown table (samples; * marks a fit that misses by over ``POOR_FIT``, noted below)."""

    def size(value: float, poor: bool = False) -> str:
        return f"{value:.3g}" + ("*" if poor else "") if math.isfinite(value) else "-"

    lines = [
        "| target loss | B_crit (McCandlish) | B_min (WSD) | B_opt (WSD) | B_simple (noise scale, runs) "
        "| probe CBS (at tokens; run reached target at) |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        probe = "-"
        if row.probe is not None:
            lower, upper = row.probe.cbs_lower, row.probe.cbs_upper
            bracket = f"[{lower:g}, {upper:g}]" if upper is not None else f">= {lower:g}"
            probe = f"{bracket} (at {row.probe.tokens:,.0f}; {row.probe_run_tokens:,.0f})"
        lines.append(
            f"| {row.target:.4g} | {size(row.b_crit, row.b_crit_poor)} | {size(row.b_min, row.wsd_poor)} "
            f"| {size(row.b_opt, row.wsd_poor)} | {size(row.b_simple)} ({row.b_simple_runs}) | {probe} |"
        )
    if any(row.b_crit_poor or row.wsd_poor for row in rows):
        lines += ["", f"\\* that E(S) fit misses the runs by more than {POOR_FIT:.0%} (rms of log E): unreliable"]
    return "\n".join(lines)
