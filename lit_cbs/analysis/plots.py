"""PNG plots of the E(S) fits, their batch sizes and the CBS forecast, through the Agg canvas (pyplot left alone)."""

from __future__ import annotations

import math
import os
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from lit_cbs._figures import save_figure
from lit_cbs.analysis.curves import RunCurve
from lit_cbs.analysis.fits import POOR_FIT, SideBySide, TargetFit
from lit_cbs.analysis.forecast import CBSForecast
from lit_cbs.probe.plot import _brackets
from lit_cbs.probe.reading import ProbeReading


def _axes(
    ax: Axes, xlabel: str, ylabel: str, title: str, fontsize: float = 9, legend: float = 8, x: str = "log"
) -> None:
    ax.set_xscale(x)
    ax.set_yscale("log")
    ax.set(xlabel=xlabel, ylabel=ylabel)
    ax.set_title(title, fontsize=fontsize)
    ax.legend(fontsize=legend)


def plot_es(target_fits: Sequence[TargetFit], path: str | os.PathLike[str]) -> Path:
    """E (tokens) against S (steps) per target loss: the runs' crossings, McCandlish's fit and the WSD fit."""
    if not target_fits:
        raise ValueError("no target fits to plot")
    figure = Figure(figsize=(7, 5))
    ax = figure.add_subplot()
    colors = colormaps["viridis"](np.linspace(0, 0.9, len(target_fits)))
    for fit, color in zip(target_fits, colors):
        steps, tokens = np.array([c.steps for c in fit.crossings]), np.array([c.tokens for c in fit.crossings])
        ax.scatter(steps, tokens, color=color, label=f"loss {fit.target:.4g} ({len(steps)} runs)", zorder=3)
        grid = np.geomspace(steps.min() / 1.5, steps.max() * 1.5, 200)
        if fit.mccandlish is not None:
            ax.plot(grid, fit.mccandlish.tokens(grid), "--", color=color, lw=1)
        if fit.wsd is not None:
            ax.plot(grid, fit.wsd.tokens(grid), "-", color=color, lw=1.5)
            ax.scatter([fit.wsd.s_opt], [fit.wsd.e_min], marker="*", s=120, color=color, edgecolor="k", zorder=4)
    title = "E(S): McCandlish et al. 2018 (dashed), Zhou et al. 2026 WSD (solid, * = S_opt, E_min)"
    _axes(ax, "optimizer steps S to reach the target", "tokens E to reach the target", title)
    return save_figure(figure, path)


def plot_batch_sizes(
    target_fits: Sequence[TargetFit],
    path: str | os.PathLike[str],
    probe: Sequence[ProbeReading] = (),
    gns_runs: Sequence[RunCurve] = (),
    compared: Sequence[SideBySide] = (),
) -> Path:
    """B_crit, B_min and B_opt against the target loss (left; ``compared``: with ``side_by_side``'s noise scale and
    bracket) and against E_min (right, with the probe's brackets and the runs' B_simple); hollow: a poor fit."""
    if not target_fits:
        raise ValueError("no target fits to plot")
    gns_runs = [run for run in gns_runs if len(run.gns)]
    figure = Figure(figsize=(12, 5))
    by_loss, by_tokens = figure.subplots(1, 2)
    targets = np.array([f.target for f in target_fits])
    nan = (np.nan, np.nan)
    crit = [(f.b_crit, f.mccandlish.e_min) if f.mccandlish else nan for f in target_fits]
    well = [f.mccandlish is not None and f.mccandlish.rms_log_residual <= POOR_FIT for f in target_fits]
    wsd_e_min = [f.wsd.e_min if f.wsd else np.nan for f in target_fits]
    hollow, poor = {"markerfacecolor": "none"}, f"B_crit (McCandlish, fits miss > {POOR_FIT:.0%})"
    series: list[tuple[str, str, dict[str, Any], list[tuple[float, float]]]] = [
        (f"B_crit (McCandlish, fits within {POOR_FIT:.0%})", "o--", {}, [c if w else nan for c, w in zip(crit, well)]),
        (poor, "o:", hollow, [nan if w else c for c, w in zip(crit, well)]),
        ("B_min (WSD)", "v-", {}, [(f.b_min, e) for f, e in zip(target_fits, wsd_e_min)]),
        ("B_opt (WSD)", "s-", {}, [(f.b_opt, e) for f, e in zip(target_fits, wsd_e_min)]),
    ]
    for label, style, marker, points in series:
        sizes, tokens = np.array(points, dtype=float).T.copy()
        sizes[~(sizes > 0)] = np.nan  # a fit that put B_min or E_min at its bound 0 has no place on log axes
        tokens[~(tokens > 0)] = np.nan
        if not np.all(np.isnan(sizes)):
            by_loss.plot(targets, sizes, style, label=label, **marker)
            by_tokens.plot(tokens, sizes, style, label=f"{label} at E_min", **marker)
    rows = [row for row in compared if math.isfinite(row.b_simple)]
    if rows:
        median = "noise scale B_simple (median of runs at the target)"
        by_loss.plot([r.target for r in rows], [r.b_simple for r in rows], "x-", color="tab:gray", label=median)
    nearest = [(row.target, row.probe) for row in compared if row.probe is not None]
    _brackets(by_loss, nearest, "CBS probe bracket (reading nearest the target)", color="k", lw=3, alpha=0.5)
    _brackets(by_tokens, [(p.tokens, p) for p in probe], "CBS probe", color="k", lw=2)
    for i, run in enumerate(gns_runs):
        run_label = f"gradient noise scale B_simple ({len(gns_runs)} runs)" if i == 0 else None
        by_tokens.plot(run.gns_tokens, run.gns, lw=0.8, alpha=0.6, color="tab:gray", label=run_label)
    by_loss.invert_xaxis()  # training moves to lower losses
    size = "batch size (samples)"
    _axes(
        by_loss, "target loss (training goes right)", size, "batch sizes implied by the E(S) fits", legend=7, x="linear"
    )
    _axes(by_tokens, "tokens", size, "over training: fits at E_min, probe CBS, gradient noise scale", legend=7)
    return save_figure(figure, path)


def plot_forecast(
    forecast: CBSForecast,
    path: str | os.PathLike[str],
    tokens_to: float | None = None,
    noise_scale: tuple[Sequence[float], Sequence[float]] | None = None,
) -> Path:
    """The brackets ``forecast`` was fitted on (dashed: undetermined; an arrow: no upper end), its curve and band
    out to ``tokens_to`` (default: the last reading), and ``noise_scale`` = (tokens, B_simple) beside them.

    Examples:
        >>> import tempfile
        >>> from lit_cbs.analysis.forecast import Bracket, forecast_cbs
        >>> brackets = [Bracket(d, 0.75 * cbs, 1.5 * cbs, "run") for d, cbs in [(1e8, 64), (4e8, 128), (1.6e9, 256)]]
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     plot_forecast(forecast_cbs(brackets, model="power"), f"{folder}/forecast.png", tokens_to=2e10).name
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
        shift = 1.04 ** (index - (len(runs) - 1) / 2)  # runs read at the same tokens side by side
        for number, bracket in enumerate(b for b in brackets if b.run == run):
            top, x = bracket.upper if math.isfinite(bracket.upper) else bracket.lower * 2, bracket.tokens * shift
            style, label = "-" if bracket.determined else "--", run if number == 0 else None
            ax.plot([x, x], [bracket.lower, top], style, color=colors[run], lw=2, label=label)
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
    title = textwrap.fill(forecast.describe(), 100)  # matplotlib's wrap=True overflows a log axis
    _axes(ax, "tokens seen D", "critical batch size (samples)", title, fontsize=7)
    return save_figure(figure, path)
