"""``plot_cbs_curve``: the probe's CBS readings against tokens, with the global batch the run used."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from matplotlib.figure import Figure

from lit_cbs.analysis.plots import save_figure
from lit_cbs.probe.reading import ProbeReading


def plot_cbs_curve(
    history: Sequence[ProbeReading], batch_changes: Sequence, path: str | os.PathLike, end_tokens: float | None = None
) -> Path:
    """CBS interval per reading (samples) vs tokens seen, with the global batch the run actually used
    up to ``end_tokens`` (default: just past the last reading), as a PNG at ``path``.

    ``batch_changes``: BatchWarmup's ``history`` (``BatchChange`` records); empty for a fixed batch.
    """
    figure = Figure(figsize=(7, 4.2))
    ax = figure.add_subplot()
    tokens = [r.tokens for r in history]
    upper = [r.cbs_upper if r.cbs_upper is not None else r.cbs_lower for r in history]
    ax.vlines(tokens, [r.cbs_lower for r in history], upper, color="tab:blue", alpha=0.6,
              label="CBS interval [k* B, next k B]")
    ax.scatter(tokens, [r.cbs_estimate for r in history], color="tab:blue", zorder=3,
               label="CBS estimate (geometric mean)")
    open_ended = [r for r in history if r.cbs_upper is None]
    if open_ended:
        ax.scatter([r.tokens for r in open_ended], [r.cbs_lower for r in open_ended], marker="^",
                   color="tab:red", zorder=4, label="lower bound (top of grid)")
    if history:
        start = history[0].batch_size if not batch_changes else batch_changes[0].old_global_batch
        xs, ys = [0], [start]
        for change in batch_changes:
            xs += [change.tokens_seen, change.tokens_seen]
            ys += [ys[-1], change.new_global_batch]
        xs.append(max(end_tokens or 0, max(tokens) * 1.05))
        ys.append(ys[-1])
        ax.plot(xs, ys, color="tab:orange", label="global batch used")
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("batch size (samples)")
    ax.set_yscale("log", base=2)
    ax.set_title("Critical batch size by branched training")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(figure, path)
