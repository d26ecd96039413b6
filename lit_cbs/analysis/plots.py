"""PNG plots of the E(S) fits and of the batch sizes they imply, next to the probe's CBS and the noise scale.

Drawn on matplotlib ``Figure`` objects with the Agg canvas, so nothing touches pyplot's global
state or needs a display.
"""

from __future__ import annotations

import math
import os
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from lit_cbs.analysis.compare import SideBySide
from lit_cbs.analysis.curves import RunCurve
from lit_cbs.analysis.fits import POOR_FIT, TargetFit
from lit_cbs.probe.reading import ProbeReading

__all__ = [
    "plot_batch_sizes",
    "plot_es",
    "plot_forecast",
]


def save_figure(figure: Figure, path: str | os.PathLike) -> Path:
    """Write ``figure`` as a PNG at ``path`` (its folder is created) through the Agg canvas, which
    leaves pyplot's backend and global state alone (a notebook keeps its own)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(figure)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return path


def plot_es(target_fits: Sequence[TargetFit], path: str | os.PathLike) -> Path:
    """E (tokens) vs S (steps) per target loss, log-log: the runs' crossings, McCandlish's fit (dashed)
    and the WSD fit (solid) where it was made.

    Args:
        target_fits: the fits (``fit_targets``).
        path: where the PNG goes (its folder is created).

    Returns:
        The PNG's path.

    Raises:
        ValueError: no fits.

    Examples:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from lit_cbs.analysis.curves import Crossing
        >>> from lit_cbs.analysis.fits import McCandlishFit, TargetFit
        >>> points = [(1500, 3e8), (2000, 2e8), (3000, 1.5e8), (5000, 1.25e8)]  # (steps, tokens) of 4 runs
        >>> crossings = tuple(Crossing(f"run{i}", 2.5, s, e, e / s, int(e / s / 1000))
        ...                   for i, (s, e) in enumerate(points))
        >>> fit = TargetFit(2.5, crossings, tokens_per_sample=1000.0,
        ...                 mccandlish=McCandlishFit(s_min=1000.0, e_min=1e8, rms_log_residual=0.0), wsd=None)
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     plot_es([fit], Path(folder, "es.png")).name
        'es.png'
    """
    if not target_fits:
        raise ValueError("no target fits to plot")
    figure = Figure(figsize=(7, 5))
    ax = figure.add_subplot()
    colors = colormaps["viridis"](np.linspace(0, 0.9, len(target_fits)))
    for fit, color in zip(target_fits, colors):
        steps, tokens = fit.steps, fit.tokens
        ax.scatter(steps, tokens, color=color, label=f"loss {fit.target:.4g} ({len(steps)} runs)", zorder=3)
        grid = np.geomspace(steps.min() / 1.5, steps.max() * 1.5, 200)
        if fit.mccandlish is not None:
            ax.plot(grid, fit.mccandlish.tokens(grid), "--", color=color, lw=1)
        if fit.wsd is not None:
            ax.plot(grid, fit.wsd.tokens(grid), "-", color=color, lw=1.5)
            ax.scatter([fit.wsd.s_opt], [fit.wsd.e_min], marker="*", s=120, color=color, edgecolor="k", zorder=4)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("optimizer steps S to reach the target")
    ax.set_ylabel("tokens E to reach the target")
    ax.set_title("E(S): McCandlish et al. 2018 (dashed), Zhou et al. 2026 WSD (solid, * = S_opt, E_min)", fontsize=9)
    ax.legend(fontsize=8)
    return save_figure(figure, path)


def plot_batch_sizes(
    target_fits: Sequence[TargetFit],
    path: str | os.PathLike,
    probe: Sequence[ProbeReading] = (),
    gns_runs: Sequence[RunCurve] = (),
    compared: Sequence[SideBySide] = (),
) -> Path:
    """B_crit, B_min and B_opt against the target loss (left) and against the tokens at which the
    target is reached (right: E_min of each fit), where the CBS probe's brackets and each run's
    gradient noise scale (all in samples) are overlaid when given. B_crit is drawn filled where
    McCandlish's E(S) fits the runs (rms of log E within 5%), hollow where it does not.
    ``compared`` (``side_by_side``'s rows) adds the noise scale and the probe's bracket at each
    target loss to the left panel.

    Args:
        target_fits: the fits (``fit_targets``).
        path: where the PNG goes (its folder is created).
        probe: the probe's readings, drawn as brackets over tokens.
        gns_runs: runs whose logged noise scale is drawn over tokens.
        compared: ``side_by_side``'s rows.

    Returns:
        The PNG's path.

    Raises:
        ValueError: no fits, or probe/noise-scale data (samples) with fits known only in tokens per step.

    Examples:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from lit_cbs.analysis.curves import Crossing
        >>> from lit_cbs.analysis.fits import McCandlishFit, TargetFit
        >>> points = [(1500, 3e8), (2000, 2e8), (3000, 1.5e8), (5000, 1.25e8)]  # (steps, tokens) of 4 runs
        >>> crossings = tuple(Crossing(f"run{i}", 2.5, s, e, e / s, int(e / s / 1000))
        ...                   for i, (s, e) in enumerate(points))
        >>> fit = TargetFit(2.5, crossings, tokens_per_sample=1000.0,
        ...                 mccandlish=McCandlishFit(s_min=1000.0, e_min=1e8, rms_log_residual=0.0), wsd=None)
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     plot_batch_sizes([fit], Path(folder, "batch_sizes.png")).name
        'batch_sizes.png'
    """
    if not target_fits:
        raise ValueError("no target fits to plot")
    unit = target_fits[0].unit
    gns_runs = [run for run in gns_runs if len(run.gns)]
    if unit != "samples" and (probe or gns_runs):
        raise ValueError(
            "mismatched units: the probe's CBS and the noise scale are in samples, but the fits are in tokens per step "
            "because the runs log no global batch in samples; log batch/global_size"
        )
    figure = Figure(figsize=(12, 5))
    by_loss, by_tokens = figure.subplots(1, 2)
    targets = np.array([f.target for f in target_fits])
    # B_crit filled where McCandlish's E(S) fits, hollow where it misses (fit_targets warns about those).
    reliable = [f.mccandlish is not None and f.mccandlish.rms_log_residual <= POOR_FIT for f in target_fits]
    unreliable = [f.mccandlish is not None and not ok for f, ok in zip(target_fits, reliable)]
    series: tuple[tuple[str, str, list[float], list[float], dict[str, Any]], ...] = (
        (
            f"B_crit (McCandlish, fits within {POOR_FIT:.0%})",
            "o--",
            [f.b_crit if ok else np.nan for f, ok in zip(target_fits, reliable)],
            [f.mccandlish.e_min if ok and f.mccandlish else np.nan for f, ok in zip(target_fits, reliable)],
            {},
        ),
        (
            f"B_crit (McCandlish, fits miss > {POOR_FIT:.0%})",
            "o:",
            [f.b_crit if bad else np.nan for f, bad in zip(target_fits, unreliable)],
            [f.mccandlish.e_min if bad and f.mccandlish else np.nan for f, bad in zip(target_fits, unreliable)],
            {"markerfacecolor": "none"},  # hollow: a poor fit
        ),
        (
            "B_min (WSD)",
            "v-",
            [f.b_min for f in target_fits],
            [f.wsd.e_min if f.wsd else np.nan for f in target_fits],
            {},
        ),
        (
            "B_opt (WSD)",
            "s-",
            [f.b_opt for f in target_fits],
            [f.wsd.e_min if f.wsd else np.nan for f in target_fits],
            {},
        ),
    )
    for label, style, size_list, token_list, marker in series:
        sizes, tokens = np.array(size_list, dtype=float), np.array(token_list, dtype=float)
        sizes[~(sizes > 0)] = np.nan  # a fit that put B_min or E_min at its bound 0 has no place on log axes
        tokens[~(tokens > 0)] = np.nan
        if np.all(np.isnan(sizes)):
            continue
        by_loss.plot(targets, sizes, style, label=label, **marker)
        by_tokens.plot(tokens, sizes, style, label=f"{label} at E_min", **marker)
    if compared:
        rows = [row for row in compared if math.isfinite(row.b_simple)]
        if rows:
            by_loss.plot(
                [r.target for r in rows],
                [r.b_simple for r in rows],
                "x-",
                color="tab:gray",
                label="noise scale B_simple (median of runs at the target)",
            )
        brackets = [(row.target, row.probe) for row in compared if row.probe is not None]
        for i, (target, reading) in enumerate(brackets):
            top = reading.cbs_upper if reading.cbs_upper is not None else reading.cbs_lower * 2
            by_loss.vlines(
                target,
                reading.cbs_lower,
                top,
                color="k",
                lw=3,
                alpha=0.5,
                label="CBS probe bracket (reading nearest the target)" if i == 0 else None,
            )
    if probe:
        tokens = np.array([p.tokens for p in probe])
        estimate = np.array([p.cbs_estimate for p in probe])
        closed = np.array([p.cbs_upper is not None for p in probe])
        lower = estimate - np.array([p.cbs_lower for p in probe])
        upper = np.array([(p.cbs_upper if p.cbs_upper is not None else p.cbs_estimate) for p in probe]) - estimate
        by_tokens.errorbar(
            tokens[closed],
            estimate[closed],
            yerr=[lower[closed], upper[closed]],
            fmt="D",
            color="k",
            capsize=3,
            label="CBS probe",
        )
        if np.any(~closed):
            by_tokens.scatter(
                tokens[~closed],
                [p.cbs_lower for p, c in zip(probe, closed) if not c],
                marker="^",
                color="k",
                label="CBS probe (>= lower)",
            )
    for i, run in enumerate(gns_runs):
        run_label = f"gradient noise scale B_simple ({len(gns_runs)} runs)" if i == 0 else None
        by_tokens.plot(run.gns_tokens, run.gns, lw=0.8, alpha=0.6, color="tab:gray", label=run_label)
    by_loss.invert_xaxis()  # training moves to lower losses
    by_loss.set_xlabel("target loss (training goes right)")
    by_tokens.set_xscale("log")
    by_tokens.set_xlabel("tokens")
    for ax in (by_loss, by_tokens):
        ax.set_yscale("log")
        ax.set_ylabel(f"batch size ({unit})")
        ax.legend(fontsize=7)
    by_loss.set_title("batch sizes implied by the E(S) fits", fontsize=9)
    by_tokens.set_title("over training: fits at E_min, probe CBS, gradient noise scale", fontsize=9)
    return save_figure(figure, path)


def plot_forecast(
    forecast,
    path: str | os.PathLike,
    tokens_to: float | None = None,
    noise_scale: tuple[Sequence[float], Sequence[float]] | None = None,
) -> Path:
    """The brackets a ``CBSForecast`` was fitted on (a bar per reading from lower to upper, dashed when
    undetermined, an arrow when it has no upper end), the fitted curve and its band, out to
    ``tokens_to`` (default: the last reading); with ``noise_scale`` = (tokens, B_simple), the
    gradient noise scale over tokens beside it. Log-log.

    Args:
        forecast: the ``CBSForecast`` (``forecast_cbs``).
        path: where the PNG goes (its folder is created).
        tokens_to: how far (tokens) to draw the curve and band.
        noise_scale: (tokens, B_simple in samples) of a run, or None.

    Returns:
        The PNG's path.

    Examples:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from lit_cbs.analysis.forecast import Bracket, forecast_cbs
        >>> brackets = [Bracket(tokens=d, lower=0.75 * cbs, upper=1.5 * cbs, run="run")
        ...             for d, cbs in [(1e8, 64), (4e8, 128), (1.6e9, 256), (6.4e9, 512)]]
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     plot_forecast(forecast_cbs(brackets, model="power"), Path(folder, "forecast.png"), tokens_to=2e10).name
        'forecast.png'
    """
    brackets = forecast.brackets
    last = max(b.tokens for b in brackets)
    end = max(tokens_to or last, last)
    figure = Figure(figsize=(7, 5))
    ax = figure.add_subplot()
    runs = sorted({b.run for b in brackets})
    colors = dict(zip(runs, colormaps["tab10"](np.arange(len(runs)) % 10)))
    for index, run in enumerate(runs):
        members = [b for b in brackets if b.run == run]
        shift = 1.04 ** (index - (len(runs) - 1) / 2)  # runs read at the same tokens side by side
        for number, bracket in enumerate(members):
            top = bracket.upper if math.isfinite(bracket.upper) else bracket.lower * 2
            x = bracket.tokens * shift
            ax.plot(
                [x, x],
                [bracket.lower, top],
                "-" if bracket.determined else "--",
                color=colors[run],
                lw=2,
                label=run if number == 0 else None,
            )
            if not math.isfinite(bracket.upper):
                ax.annotate(
                    "", xy=(x, top * 1.3), xytext=(x, top), arrowprops={"arrowstyle": "->", "color": colors[run]}
                )
    grid = np.geomspace(min(b.tokens for b in brackets) / 1.2, end * 1.2, 200)
    low, high = forecast.band(grid)
    ax.fill_between(grid, low, high, color="0.6", alpha=0.3, label=f"{forecast.coverage:.0%} band")
    ax.plot(grid, forecast.predict(grid), "k-", lw=1.2, label=f"{forecast.model} fit")
    if end > last:
        ax.axvline(last, color="0.4", ls=":", lw=1)
        ax.text(last, ax.get_ylim()[1], " last reading", fontsize=7, va="top")
    if noise_scale is not None:
        tokens, b_simple = (np.asarray(values, dtype=float) for values in noise_scale)
        keep = np.isfinite(b_simple) & (b_simple > 0) & (tokens > 0)
        ax.plot(tokens[keep], b_simple[keep], color="tab:purple", lw=1, label="noise scale B_simple")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens seen D")
    ax.set_ylabel("critical batch size (samples)")
    ax.set_title(textwrap.fill(forecast.describe(), 100), fontsize=7)  # matplotlib's wrap=True overflows a log axis
    ax.legend(fontsize=8)
    return save_figure(figure, path)
