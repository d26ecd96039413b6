"""What a training run leaves in its folder besides checkpoints: the batch/LR history and plots.

``write_batch_history`` saves ``BatchWarmup``'s record as JSON; ``plot_run`` draws the loss,
global batch and LR of Lightning's ``CSVLogger`` file (read by
``lit_cbs.analysis.curves.read_metrics_csv``) against tokens seen, and the noise scale per group of
parameters where ``GradientNoiseScale(groups=...)`` logged it. matplotlib is imported only when
plotting, so this module loads where matplotlib is not installed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import numpy as np

from lit_cbs.analysis.curves import (
    BATCH_COLUMN,
    GNS_COLUMN,
    LOSS_COLUMN,
    LR_COLUMN,
    TOKENS_COLUMN,
    VAL_LOSS_COLUMN,
    read_metrics_csv,
    tokens_at,
)
from lit_cbs.callbacks.warmup import BatchWarmup

# GradientNoiseScale(groups=...)'s per-group B_simple (samples)
GROUP_B_SIMPLE = re.compile(r"gns/(.+)/b_simple")


def write_batch_history(path: str | os.PathLike, warmup: BatchWarmup) -> dict:
    """Write ``warmup``'s batch changes and final counts as JSON to ``path``; return what was written.

    Each change has the optimizer step it took effect after, the samples/tokens seen then, the old
    and new global batch (samples), accumulation and micro-batch, its LR factor and its cause
    ("schedule", or "guard" for a revert); ``guard_verdicts`` holds the guard's judgement of each
    increase (lit_cbs.rules.guard.GuardVerdict), or None without a guard.
    """
    record = {
        "schedule": repr(warmup.schedule),
        "lr_rule": repr(warmup.lr_rule),
        "changes": [dataclasses.asdict(change) for change in warmup.history],
        "guard_verdicts": [dataclasses.asdict(verdict) for verdict in warmup.guard.verdicts] if warmup.guard else None,
        "final": {
            "samples_seen": warmup.samples_seen,
            "tokens_seen": warmup.tokens_seen,
            "global_batch": warmup.global_batch,
            "accumulate": warmup.accumulate,
            "micro_batch_size": warmup.micro_batch_size,
            "lr_factor": warmup.lr_factor,
        },
    }
    Path(path).write_text(json.dumps(record, indent=2))
    return record


def group_noise_scale_figure(metrics: dict[str, tuple[np.ndarray, np.ndarray]], title: str = ""):
    """B_simple (samples) of every group ``gns/<group>/b_simple`` and of the whole model against tokens
    seen, as a matplotlib ``Figure``; None when the metrics hold no per-group noise scale."""
    from matplotlib.figure import Figure

    groups = [(match[1], metrics[name]) for name in metrics if (match := GROUP_B_SIMPLE.fullmatch(name))]
    if not groups:
        return None
    # In number order (block2 before block10): CSVLogger sorts its columns as text.
    groups.sort(key=lambda group: [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", group[0])])
    figure = Figure(figsize=(7, 4.5))
    ax = figure.add_subplot()
    for group, (steps, values) in groups:
        ax.plot(tokens_at(metrics, steps), values, lw=1, label=group)
    steps, values = metrics[GNS_COLUMN]
    ax.plot(tokens_at(metrics, steps), values, color="black", ls="--", lw=1.5, label="whole model")
    ax.set(xlabel="tokens seen", ylabel="B_simple (samples)", title=f"{title} gradient noise scale per group".strip())
    ax.legend(fontsize="small", ncol=1 + len(groups) // 8)
    ax.grid(alpha=0.3)
    return figure


def plot_run(metrics_csv: str | os.PathLike, output_dir: str | os.PathLike, title: str = "") -> list[Path]:
    """Write ``loss_vs_tokens.png``, ``batch_lr_vs_tokens.png`` and ``gns_groups_vs_tokens.png`` (see
    ``group_noise_scale_figure``) into ``output_dir``; return the paths of those written.

    Needs ``tokens_seen`` in the CSV (logged by BatchWarmup); plots whichever of ``train/loss``,
    ``val/loss``, ``batch/global_size`` and ``lr`` are there, with a dotted line where the global
    batch changed. Drawn on ``Figure`` objects with the Agg canvas: no pyplot state, no display.
    """
    from matplotlib.figure import Figure

    from lit_cbs.analysis.plots import save_figure

    metrics = read_metrics_csv(metrics_csv)
    if TOKENS_COLUMN not in metrics:
        raise ValueError(f"{str(metrics_csv)!r} has no {TOKENS_COLUMN} column: add lit_cbs.BatchWarmup to the callbacks")
    batch_changes = []
    if BATCH_COLUMN in metrics:
        steps, sizes = metrics[BATCH_COLUMN]
        # A size is logged after the step that precedes it: the change takes effect past that token count.
        batch_changes = list(tokens_at(metrics, steps[1:][np.diff(sizes) != 0]))

    def save(figure: Figure, name: str) -> Path:
        return save_figure(figure, Path(output_dir) / name)

    figure = Figure(figsize=(7, 4.5))
    ax = figure.add_subplot()
    for name, style in ((LOSS_COLUMN, dict(lw=0.8, alpha=0.6)), (VAL_LOSS_COLUMN, dict(marker="o", lw=1.5))):
        if name in metrics:
            steps, values = metrics[name]
            ax.plot(tokens_at(metrics, steps), values, label=name, **style)
    for tokens in batch_changes:
        ax.axvline(tokens, color="gray", ls=":", lw=1)
    ax.set(xlabel="tokens seen", ylabel="loss (nats per token)", title=f"{title} loss".strip())
    if ax.lines:
        ax.legend()
    ax.grid(alpha=0.3)
    written = [save(figure, "loss_vs_tokens.png")]

    panels = [
        (name, label)
        for name, label in ((BATCH_COLUMN, "global batch (samples)"), (LR_COLUMN, "learning rate"))
        if name in metrics
    ]
    if panels:
        figure = Figure(figsize=(7, 2.6 * len(panels)))
        axes = figure.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
        for ax, (name, label) in zip(axes, panels):
            steps, values = metrics[name]
            ax.step(tokens_at(metrics, steps), values, where="post")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[-1].set_xlabel("tokens seen")
        axes[0].set_title(f"{title} batch size and LR".strip())
        written.append(save(figure, "batch_lr_vs_tokens.png"))

    figure = group_noise_scale_figure(metrics, title)
    if figure is not None:
        written.append(save(figure, "gns_groups_vs_tokens.png"))
    return written
