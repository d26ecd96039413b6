"""The CBS curve: each probe reading's interval against tokens, and the loss gaps it was judged on."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

from lit_cbs._figures import save_figure
from lit_cbs.probe.reading import ProbeReading, difference, one_sided_quantile


def _brackets(ax: Axes, at: Sequence[tuple[float, ProbeReading]], label: str, **style: Any) -> None:
    """Each reading's CBS interval (samples) at x, a ^ above the lower end of one read at the top of its grid."""
    if at:
        tops = [r.cbs_upper if r.cbs_upper is not None else r.cbs_lower for _, r in at]
        ax.vlines([x for x, _ in at], [r.cbs_lower for _, r in at], tops, label=label, **style)
    if open_ended := [(x, r.cbs_lower) for x, r in at if r.cbs_upper is None]:
        ax.scatter(*zip(*open_ended), marker="^", color=style["color"], zorder=4)


def plot_cbs_curve(
    history: Sequence[ProbeReading],
    batch_changes: Sequence[Any],
    path: str | os.PathLike[str],
    end_tokens: float | None = None,
    epsilon: float | None = None,
) -> Path:
    return save_figure(cbs_curve_figure(history, batch_changes, end_tokens, epsilon), path)


def cbs_curve_figure(
    history: Sequence[ProbeReading],
    batch_changes: Sequence[Any],
    end_tokens: float | None = None,
    epsilon: float | None = None,
) -> Figure:
    """Against tokens: each reading's CBS interval (dashed: undetermined) with the global batch used (BatchWarmup's
    ``history``); and per k, L_k minus the lowest smaller-k loss with its confidence bar, against ``epsilon``."""
    figure = Figure(figsize=(7.5, 7))
    top, bottom = figure.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    for determined, color, line, label in (
        (True, "tab:blue", "solid", "CBS interval [k* B, next k B]"),
        (False, "tab:gray", "dashed", "undetermined reading"),
    ):
        readings = [r for r in history if r.determined == determined]
        _brackets(top, [(r.tokens, r) for r in readings], label, color=color, linestyles=line, alpha=0.7)
        at = ([r.tokens for r in readings], [r.cbs_estimate for r in readings])
        top.scatter(*at, zorder=3, color=color, facecolors=color if determined else "none")
    if history:
        start = history[0].batch_size if not batch_changes else batch_changes[0].old_global_batch
        xs = [0, *(c.tokens_seen for c in batch_changes), max(end_tokens or 0, max(r.tokens for r in history) * 1.05)]
        ys = [start, *(c.new_global_batch for c in batch_changes)]
        top.step(xs, [*ys, ys[-1]], where="post", color="tab:orange", label="global batch used")
    top.set(ylabel="batch size (samples)", title="Critical batch size by branched training")
    top.set_yscale("log", base=2)
    top.grid(alpha=0.3)
    top.legend(fontsize=8)

    multipliers = sorted({float(k) for r in history for k in r.losses})
    colours = colormaps["viridis"]
    drawn = []  # (gap, error bar) of every point, nats
    for i, k in enumerate(multipliers[1:]):
        points = [point for r in history if (point := _gap_to_smaller(r, k)) is not None]
        if not points:
            continue
        drawn += [point[1:] for point in points]
        at, gaps, bars = zip(*points)
        colour = colours(i / max(1, len(multipliers) - 2))
        bottom.errorbar(at, gaps, yerr=bars, fmt="o", capsize=3, color=colour, label=f"k = {k:g}")
    if epsilon is not None:
        bottom.axhline(epsilon, color="tab:red", linestyle="--", linewidth=1, label=f"epsilon = {epsilon:g}")
    bottom.axhline(0.0, color="black", linewidth=0.6)
    linthresh = max(0.05, 2 * (epsilon or 0.0))
    bottom.set_yscale("symlog", linthresh=linthresh)  # linear near epsilon, early gaps compressed
    if drawn:
        ticks = _gap_ticks(linthresh, epsilon, 10 * max(abs(gap) + bar for gap, bar in drawn))
        bottom.yaxis.set_major_locator(FixedLocator(ticks))
        bottom.set_ylim(_gap_limits(bottom, ticks, epsilon, drawn))
    # Plain numbers: symlog's default labels the linear threshold in scientific notation (4.82749x10^-2).
    bottom.yaxis.set_major_formatter(FuncFormatter(lambda value, position: f"{value:.3g}"))
    bottom.yaxis.set_minor_formatter(NullFormatter())
    bottom.set(xlabel="tokens seen", ylabel="L_k - lowest smaller-k loss (nats)\nbars: the confidence bound")
    bottom.grid(alpha=0.3)
    if multipliers[1:]:
        bottom.legend(fontsize=8, ncols=2)
    return figure


def _gap_ticks(linthresh: float, epsilon: float | None, reach: float) -> list[float]:
    """0, +-epsilon, +-linthresh, then +-1, 2 and 5 x 10^n out to ``reach`` (nats): compressed gaps stay readable."""
    magnitudes = {linthresh, *([epsilon] if epsilon else [])}
    decade = 10.0 ** math.floor(math.log10(linthresh))
    while decade <= reach:
        magnitudes |= {value for value in (decade, 2 * decade, 5 * decade) if linthresh < value <= reach}
        decade *= 10
    return sorted({0.0, *magnitudes, *(-value for value in magnitudes)})


def _gap_limits(
    ax: Axes, ticks: list[float], epsilon: float | None, drawn: list[tuple[float, float]]
) -> tuple[float, float]:
    """The gap panel's y range: every (gap, error bar) of ``drawn``, 0 and epsilon inside with a tenth to spare,
    out to the ticks beyond the extreme gaps so that every gap lies between two labelled ticks."""
    low = min(0.0, *(gap - bar for gap, bar in drawn))
    high = max(0.0, epsilon or 0.0, *(gap + bar for gap, bar in drawn))
    scale = ax.yaxis.get_transform()
    low_t, high_t = scale.transform([low, high])
    spare = 0.1 * (high_t - low_t)
    low, high = scale.inverted().transform([low_t - spare, high_t + spare])
    lowest, highest = min(gap for gap, _ in drawn), max(gap for gap, _ in drawn)
    below, above = max(tick for tick in ticks if tick <= lowest), min(tick for tick in ticks if tick >= highest)
    return min(low, below), max(high, above)


def _gap_to_smaller(reading: ProbeReading, k: float) -> tuple[float, float, float] | None:
    """(tokens, L_k - min of L_j over measured j < k, its error bar at the reading's confidence), or None."""
    losses = {float(j): loss for j, loss in reading.losses.items() if loss is not None}
    smaller = [j for j in losses if j < k]
    if k not in losses or not smaller:
        return None
    j = min(smaller, key=lambda m: losses[m])
    bar = 0.0
    scores = reading.scores()
    if scores[k].batch_losses and scores[j].batch_losses:
        gap = difference(scores[k], scores[j])
        if gap.se is not None:
            bar = gap.se * one_sided_quantile(reading.confidence, gap.dof)
    elif j == min(losses) and (se := reading.loss_se.get(f"{k:g}")) is not None:
        bar = se * one_sided_quantile(reading.confidence, math.inf)
    return reading.tokens, losses[k] - losses[j], bar
