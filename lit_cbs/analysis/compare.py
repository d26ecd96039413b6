"""The E(S) fits' B_crit, B_min and B_opt, the runs' noise scale B_simple and the probe's CBS lined up by target
loss."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lit_cbs.analysis.curves import RunCurve
from lit_cbs.analysis.fits import POOR_FIT, TargetFit
from lit_cbs.probe.reading import ProbeReading


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


def _noise_scale_at_target(fit: TargetFit, runs: Sequence[RunCurve]) -> tuple[float, int]:
    """Median over runs of B_simple at the tokens where each run reached ``fit.target``; and how many runs."""
    by_name = {run.name: run for run in runs}
    values = []
    for crossing in fit.crossings:
        run = by_name.get(crossing.run)
        if run is None or len(run.gns) == 0:
            continue
        finite = np.isfinite(run.gns)
        tokens, gns = run.gns_tokens[finite], run.gns[finite]
        if len(tokens) and tokens[0] <= crossing.tokens <= tokens[-1]:
            values.append(float(np.interp(crossing.tokens, tokens, gns)))
    return (float(np.median(values)) if values else math.nan), len(values)


def _probe_at_target(fit: TargetFit, probe: Sequence[ProbeReading]) -> tuple[float | None, ProbeReading | None]:
    """(tokens at which the run at the probe's batch size reached the target, the reading nearest them)."""
    for crossing in fit.crossings:
        readings = [p for p in probe if p.batch_size == crossing.batch_size]
        if readings:
            return crossing.tokens, min(readings, key=lambda p: abs(math.log(p.tokens / crossing.tokens)))
    return None, None


def side_by_side(
    fits: Sequence[TargetFit], runs: Sequence[RunCurve], probe: Sequence[ProbeReading] = ()
) -> list[SideBySide]:
    """One ``SideBySide`` per fit: B_simple as the median over ``runs`` of its value where each reached the target;
    the ``probe`` reading nearest the tokens at which the run at the probe's batch reached it."""
    rows = []
    for fit in fits:
        b_simple, count = _noise_scale_at_target(fit, runs)
        run_tokens, reading = _probe_at_target(fit, probe)
        crit_poor = fit.mccandlish is not None and fit.mccandlish.rms_log_residual > POOR_FIT
        wsd_poor = fit.wsd is not None and fit.wsd.rms_log_residual > POOR_FIT
        sizes = (fit.b_crit, fit.b_min, fit.b_opt, b_simple)
        rows.append(SideBySide(fit.target, *sizes, count, run_tokens, reading, crit_poor, wsd_poor))
    return rows


def _size(value: float, poor: bool = False) -> str:
    if not math.isfinite(value):
        return "-"
    return f"{value:.3g}" + ("*" if poor else "")


def side_by_side_markdown(rows: Sequence[SideBySide]) -> str:
    """``rows`` as a markdown table (samples; * marks a fit that misses by over ``POOR_FIT``, noted below)."""
    lines = [
        "| target loss | B_crit (McCandlish) | B_min (WSD) | B_opt (WSD) | B_simple (noise scale, runs) "
        "| probe CBS (at tokens; run reached target at) |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row.probe is None:
            probe = "-"
        else:
            lower, upper = row.probe.cbs_lower, row.probe.cbs_upper
            bracket = f"[{lower:g}, {upper:g}]" if upper is not None else f">= {lower:g}"
            probe = f"{bracket} (at {row.probe.tokens:,.0f}; {row.probe_run_tokens:,.0f})"
        lines.append(
            f"| {row.target:.4g} | {_size(row.b_crit, row.b_crit_poor)} | {_size(row.b_min, row.wsd_poor)} "
            f"| {_size(row.b_opt, row.wsd_poor)} | {_size(row.b_simple)} ({row.b_simple_runs}) | {probe} |"
        )
    if any(row.b_crit_poor or row.wsd_poor for row in rows):
        lines += ["", f"\\* that E(S) fit misses the runs by more than {POOR_FIT:.0%} (rms of log E): unreliable"]
    return "\n".join(lines)
