"""``plot_cbs_curve``: the probe's CBS readings against tokens, with the global batch the run used,
and below them each branch's loss difference from the base with its error bar."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

from lit_cbs.analysis.plots import save_figure
from lit_cbs.probe.reading import ProbeReading, difference, one_sided_quantile

__all__ = ["cbs_curve_figure", "plot_cbs_curve"]


def plot_cbs_curve(
    history: Sequence[ProbeReading],
    batch_changes: Sequence,
    path: str | os.PathLike,
    end_tokens: float | None = None,
    epsilon: float | None = None,
) -> Path:
    """``cbs_curve_figure`` as a PNG at ``path``.

    Args:
        history: the readings (``CBSProbeCallback.history``, or ``read_readings`` of a cbs_probe.jsonl).
        batch_changes: BatchWarmup's ``history`` (``BatchChange`` records); empty for a fixed batch.
        path: the PNG file (its folder is created).
        end_tokens: tokens the global batch's line reaches (it reaches just past the last reading at least).
        epsilon: the k* rule's tolerance (nats) drawn in the bottom panel (None: not drawn).

    Returns:
        The path of the PNG.

    Examples:
        >>> import os, tempfile
        >>> from lit_cbs.probe.reading import BranchScore, DecisionRule
        >>> scores = {1: BranchScore(3.1), 2: BranchScore(3.103), 4: BranchScore(3.15)}  # nats
        >>> where = dict(step=100, seq_len=128, window_tokens=262_144, search="grid", evaluate="train_ema",
        ...     main_loss=3.1, branches_trained=[2, 4], failed=[], tokens_spent=524_288, overhead=0.52)
        >>> history = [ProbeReading.decide(scores, DecisionRule(confidence=0.5), [1, 2, 4], 256, tokens=t, **where)
        ...     for t in (1_000_000, 2_000_000)]
        >>> folder = tempfile.TemporaryDirectory()
        >>> png = plot_cbs_curve(history, [], os.path.join(folder.name, "cbs_curve.png"), epsilon=0.01)
        >>> png.name, png.stat().st_size > 0
        ('cbs_curve.png', True)
        >>> folder.cleanup()
    """
    return save_figure(cbs_curve_figure(history, batch_changes, end_tokens, epsilon), path)


def cbs_curve_figure(
    history: Sequence[ProbeReading],
    batch_changes: Sequence,
    end_tokens: float | None = None,
    epsilon: float | None = None,
) -> Figure:
    """Two panels:

    - top: the CBS interval per reading (samples) vs tokens seen (filled: determined; hollow and
      dashed: undetermined at the reading's confidence), with the global batch the run actually used
      up to ``end_tokens`` (default: just past the last reading);
    - bottom: per multiplier k and reading, L_k minus the lowest loss of a smaller k (nats), the
      quantity the k* rule holds against ``epsilon`` (k is within epsilon of every smaller k when
      it is), with an error bar at the reading's one-sided confidence (paired held-out SEs; for
      train_ema, the step-scatter SE against the base k, where that is the lowest).

    ``plot_cbs_curve`` saves it as a PNG; this is the figure itself, to show in a notebook or change first.

    Args:
        history: the readings (``CBSProbeCallback.history``, or ``read_readings`` of a cbs_probe.jsonl).
        batch_changes: BatchWarmup's ``history`` (``BatchChange`` records); empty for a fixed batch.
        end_tokens: tokens the global batch's line reaches (it reaches just past the last reading at least).
        epsilon: the k* rule's tolerance (nats) drawn in the bottom panel (None: not drawn).

    Returns:
        A matplotlib ``Figure`` with the two panels (no pyplot state is touched).

    Examples:
        >>> from lit_cbs.probe.reading import BranchScore, DecisionRule
        >>> scores = {1: BranchScore(3.1), 2: BranchScore(3.103), 4: BranchScore(3.15)}  # nats
        >>> reading = ProbeReading.decide(scores, DecisionRule(confidence=0.5), [1, 2, 4], 256, tokens=1_000_000,
        ...     step=100, seq_len=128, window_tokens=262_144, search="grid", evaluate="train_ema", main_loss=3.1,
        ...     branches_trained=[2, 4], failed=[], tokens_spent=524_288, overhead=0.52)
        >>> figure = cbs_curve_figure([reading], [], epsilon=0.01)
        >>> len(figure.axes), figure.axes[0].get_ylabel()
        (2, 'batch size (samples)')
    """
    figure = Figure(figsize=(7.5, 7))
    top, bottom = figure.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    for determined, style in (
        (True, dict(color="tab:blue", linestyles="solid")),
        (False, dict(color="tab:gray", linestyles="dashed")),
    ):
        readings = [r for r in history if r.determined == determined]
        if not readings:
            continue
        tokens = [r.tokens for r in readings]
        upper = [r.cbs_upper if r.cbs_upper is not None else r.cbs_lower for r in readings]
        label = "CBS interval [k* B, next k B]" if determined else "undetermined reading"
        top.vlines(tokens, [r.cbs_lower for r in readings], upper, alpha=0.7, label=label, **style)
        top.scatter(
            tokens,
            [r.cbs_estimate for r in readings],
            zorder=3,
            color=style["color"],
            facecolors=style["color"] if determined else "none",
        )
    open_ended = [r for r in history if r.cbs_upper is None]
    if open_ended:
        top.scatter(
            [r.tokens for r in open_ended],
            [r.cbs_lower for r in open_ended],
            marker="^",
            color="tab:red",
            zorder=4,
            label="lower bound (top of grid)",
        )
    if history:
        start = history[0].batch_size if not batch_changes else batch_changes[0].old_global_batch
        xs: list[float] = [0]
        ys = [start]
        for change in batch_changes:
            xs += [change.tokens_seen, change.tokens_seen]
            ys += [ys[-1], change.new_global_batch]
        xs.append(max(end_tokens or 0, max(r.tokens for r in history) * 1.05))
        ys.append(ys[-1])
        top.plot(xs, ys, color="tab:orange", label="global batch used")
    top.set_ylabel("batch size (samples)")
    top.set_yscale("log", base=2)
    top.set_title("Critical batch size by branched training")
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
        bottom.errorbar(
            [p[0] for p in points],
            [p[1] for p in points],
            yerr=[p[2] for p in points],
            fmt="o",
            capsize=3,
            color=colours(i / max(1, len(multipliers) - 2)),
            label=f"k = {k:g}",
        )
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
    bottom.set_xlabel("tokens seen")
    bottom.set_ylabel("L_k - lowest smaller-k loss (nats)\nbars: the confidence bound")
    bottom.grid(alpha=0.3)
    if multipliers[1:]:
        bottom.legend(fontsize=8, ncols=2)
    return figure


def _gap_ticks(linthresh: float, epsilon: float | None, reach: float) -> list[float]:
    """The gap panel's ticks (nats): 0, +-epsilon and +-linthresh in its linear part, then 1, 2 and 5 x 10^n
    out to ``reach`` on either side, so that a gap in the compressed part can be read too."""
    magnitudes = {linthresh, *([epsilon] if epsilon else [])}
    decade = 10.0 ** math.floor(math.log10(linthresh))
    while decade <= reach:
        magnitudes |= {value for value in (decade, 2 * decade, 5 * decade) if linthresh < value <= reach}
        decade *= 10
    return sorted({0.0, *magnitudes, *(-value for value in magnitudes)})


def _gap_limits(ax, ticks: list[float], epsilon: float | None, drawn: list[tuple[float, float]]) -> tuple[float, float]:
    """The gap panel's y range (nats): every error bar, 0 and epsilon inside with a tenth of the panel's
    height to spare, and out to the ticks beyond the lowest and the highest gap, so that every gap lies
    between two labelled ticks. ``drawn``: (gap, error bar) per point."""
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
    """(tokens, L_k - min of L_j over the measured j < k, its error bar at the reading's confidence)
    for a reading that measured k and a smaller k; None otherwise."""
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
