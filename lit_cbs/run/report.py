"""What a run leaves in its folder: batch_history.json, summary.json, the plots, report.html (``-m`` RUN_DIR)."""

from __future__ import annotations

import argparse
import base64
import dataclasses
import html
import json
import os
import re
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np

from lit_cbs.analysis.curves import METRICS_FILE, read_metrics_csv, tokens_at
from lit_cbs.callbacks.accounting import trainer_callbacks
from lit_cbs.callbacks.checkpoint import stop_signal
from lit_cbs.callbacks.logs import log_figures
from lit_cbs.callbacks.warmup import BatchWarmup
from lit_cbs.metrics import FIT_SECONDS, GLOBAL_BATCH, GNS_B_SIMPLE, LR, TOKENS_SEEN, TRAIN_LOSS, VAL_LOSS, gns_group
from lit_cbs.probe.callback import JSONL_FILE, PLOT_FILE, CBSProbeCallback
from lit_cbs.probe.reading import read_readings
from lit_cbs.rules.warmup_core import BatchChange

__all__ = ["main", "write_report"]

Metrics = dict[str, tuple[np.ndarray, np.ndarray]]  # a CSVLogger's column -> (steps, values)
WALL_CLOCK_FILE = "wall_clock.png"  # the page's own figure: the run draws none against wall-clock time
# summary.json's batch change key -> BatchChange's field; a reading's keys are ProbeReading's fields
_CHANGE_KEYS = dict(step="step", tokens="tokens_seen", old="old_global_batch", new="new_global_batch")
_CHANGE_KEYS.update(lr_factor="lr_factor", micro_batch_size="new_micro_batch_size", accumulate="new_accumulate")
_READING_KEYS = ("tokens", "batch_size", "k_star", "cbs_lower", "cbs_upper", "determined", "window_tokens")


def run_summary(trainer: pl.Trainer, warmup: BatchWarmup, run_name: str, fit_seconds: float) -> dict[str, Any]:
    """summary.json (``fit_seconds``: this ``trainer.fit`` call, setup included)."""
    val_loss, accounting, signum = trainer.callback_metrics.get(VAL_LOSS), warmup.accounting, stop_signal(trainer)
    assert accounting is not None, "run_summary: call it after fit, once the Trainer has set the BatchWarmup up"
    summary: dict[str, Any] = {
        "run_name": run_name,
        "tokens": accounting.tokens_seen,
        "tokens_this_fit": accounting.tokens_seen - accounting.tokens_at_fit_start,
        "optimizer_steps": trainer.global_step,
        "first_batch": warmup.history[0].old_global_batch if warmup.history else warmup.global_batch,
        "final_batch": warmup.global_batch,
        # Trainer.datamodule is set by Lightning's data connector, undeclared in its class
        "seq_len": accounting.seq_len or trainer.datamodule.seq_len,  # type: ignore[attr-defined]
        "batch_changes": [{key: getattr(c, field) for key, field in _CHANGE_KEYS.items()} for c in warmup.history],
        "final_val_loss": float(val_loss) if val_loss is not None else None,
        "fit_seconds": fit_seconds,
        "run_seconds": accounting.fit_seconds,
        "stopped_by": signal.Signals(signum).name if signum else None,
        "probe": None,
    }
    for probe in [c for c in trainer_callbacks(trainer) if isinstance(c, CBSProbeCallback)][:1]:
        history, status = probe.history, probe.status()
        summary["probe"] = {
            "tokens": probe.tokens_spent,
            "optimizer_steps": sum(reading.branch_steps for reading in history),
            "readings": [{key: getattr(r, key) for key in _READING_KEYS} for r in history],
            "points": {key: status[key] for key in ("read", "determined", "failed", "pending")},
            "adaptive": status.get("adaptive"),
            "side_jobs": status.get("side_jobs"),  # what the main run waited for its side jobs (seconds)
        }
    return summary


_waits = "{checkpoint:.1f} s writing {checkpoints} checkpoint(s), {poll:.1f} s in {polls:,} looks for results, "
_waits += "{at_end:.1f} s for the last readings at the end"


def summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """summary.json as (label, value) rows: the lines a run ends with, and report.html's table."""
    steps, tokens, first = summary["optimizer_steps"], summary["tokens"], summary["first_batch"]
    fewer = 1 - steps / (tokens / (first * summary["seq_len"]))  # than at the starting batch throughout
    changes = ", ".join(
        f"{c['old']} -> {c['new']} after step {c['step']:,} ({c['tokens']:,} tokens, "
        f"micro {c['micro_batch_size']} x accumulate {c['accumulate']}, LR x{c['lr_factor']:.3g})"
        for c in summary["batch_changes"]
    )
    val_loss, seconds, this_fit = summary["final_val_loss"], summary["fit_seconds"], summary["tokens_this_fit"]
    resumed = this_fit != tokens
    throughput = f"{this_fit / seconds:,.0f} tokens/s over this fit"
    throughput += f", which trained {this_fit:,} of them" if resumed else ""
    wall = f"{seconds:,.1f} s (trainer.fit, setup included)"
    if resumed:  # every fit of the run counted without its setup
        wall += f"; {summary['run_seconds']:,.1f} s over the whole run, every fit counted without its setup"
    probe = summary["probe"] or {}
    readings, points, waits, adaptive = (probe.get(key) for key in ("readings", "points", "side_jobs", "adaptive"))
    cbs = points_said = None
    if readings:
        cbs = "; ".join(
            (f"[{r['cbs_lower']:g}, {r['cbs_upper']:g}]" if r["cbs_upper"] is not None else f">= {r['cbs_lower']:g}")
            + f" at {r['tokens']:,} tokens, "
            + ("determined" if r["determined"] else "undetermined")
            for r in readings
        )
        cost = f"{probe['tokens']:,} tokens ({probe['tokens'] / tokens:.0%} of training)"
        cbs += f"; probes trained {cost} in {probe['optimizer_steps']:,} optimizer steps"
    failed, pending = (points[key] if points else [] for key in ("failed", "pending"))
    if points:
        points_said = f"{points['read']} read ({points['determined']} determined), {len(failed)} failed, "
        points_said += f"{len(pending)} pending"
        if failed:
            reasons = "; ".join(dict.fromkeys(failure["reason"] for failure in failed))
            at = ", ".join(f"{failure['tokens']:,}" for failure in failed)
            points_said += f". FAILED at {at} tokens: {reasons}"
        if pending:
            points_said += f". Pending at {', '.join(f'{t:,}' for t in pending)} tokens (last.ckpt collects them)"
    stopped, resume = summary.get("stopped_by"), "resume from checkpoints/last.ckpt (ckpt_path=...)"
    rows = [  # the troubles first
        ("CBSAdaptive", adaptive and adaptive["why_not"] and f"NEVER GREW THE BATCH: {adaptive['why_not']}"),
        ("probe points", points_said if failed or pending else None),
        ("tokens", f"{tokens:,} ({throughput})"),
        ("optimizer steps", f"{steps:,} ({fewer:.0%} fewer than at the starting batch {first})"),
        ("batch changes", changes or "none"),
        ("CBS (samples)", cbs),
        ("probe points", None if failed or pending else points_said),
        ("final val/loss", f"{val_loss:.4f} nats per token" if val_loss is not None else "(not evaluated)"),
        ("wall time", wall),
        ("side-job waits", waits and _waits.format(**waits)),
        ("stopped by", stopped and f"{stopped} after step {steps:,}: {resume}"),
    ]
    return [(label, value) for label, value in rows if value]


def summary_text(summary: dict[str, Any]) -> str:
    """summary.json as the lines a run ends with."""
    return "\n".join(f"{label:<17}{value}" for label, value in summary_rows(summary))


def write_run_summary(
    output_dir: str | os.PathLike[str],
    run_name: str,
    trainer: pl.Trainer,
    warmup: BatchWarmup,
    fit_seconds: float,
    plots: bool,
) -> tuple[dict[str, Any], str]:
    """Write batch_history.json, summary.json and the plots; return the summary and the closing lines."""
    output_dir, accounting = Path(output_dir), warmup.accounting
    history = {
        "schedule": repr(warmup.schedule),
        "lr_rule": repr(warmup.lr_rule),
        "changes": [dataclasses.asdict(change) for change in warmup.history],
        "guard_verdicts": [dataclasses.asdict(verdict) for verdict in warmup.guard.verdicts] if warmup.guard else None,
        "final": {
            **{name: getattr(accounting, name) if accounting else 0 for name in ("samples_seen", "tokens_seen")},
            **{name: getattr(warmup, name) for name in ("global_batch", "accumulate", "micro_batch_size", "lr_factor")},
        },
    }
    (output_dir / "batch_history.json").write_text(json.dumps(history, indent=2))
    summary = run_summary(trainer, warmup, run_name, fit_seconds)
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    metrics_csv = output_dir / METRICS_FILE
    if plots and metrics_csv.is_file():
        log_figures(trainer.loggers, plot_run(metrics_csv, output_dir, title=run_name), trainer.global_step)
    ending = "stopped" if summary["stopped_by"] else "done"
    return summary, f"lit_cbs: {run_name} {ending}\n{summary_text(summary)}\noutputs          {output_dir}"


def _axes(panels: int, height: float, **kwargs: Any) -> tuple[Any, Any]:
    """A matplotlib Figure 7 inches wide with ``panels`` axes one above the other, ``height`` inches each."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, height * panels))
    return figure, figure.subplots(panels, 1, squeeze=False, **kwargs)[:, 0]


def _losses(ax: Any, metrics: Metrics, at: Callable[[np.ndarray, np.ndarray], tuple[Any, Any]], xlabel: str) -> None:
    """train/loss and val/loss (nats per token) on ``ax``, at ``at(steps, values)``."""
    for name, style in ((TRAIN_LOSS, dict(lw=0.8, alpha=0.6)), (VAL_LOSS, dict(marker="o", lw=1.5))):
        if name in metrics:
            ax.plot(*at(*metrics[name]), label=name, **style)
    ax.set(xlabel=xlabel, ylabel="loss (nats per token)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    ax.grid(alpha=0.3)


def group_noise_scale_figure(metrics: Metrics, title: str = "") -> Any:
    """B_simple (samples) of each ``gns/<group>/b_simple`` and of the whole model against tokens."""
    groups = [(group, metrics[name]) for name in metrics if (group := gns_group(name)) is not None]
    if not groups:
        return None
    # In number order (block2 before block10): CSVLogger sorts its columns as text.
    groups.sort(key=lambda group: [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", group[0])])
    figure, (ax,) = _axes(1, 4.5)
    for group, (steps, values) in [*groups, ("whole model", metrics[GNS_B_SIMPLE])]:
        style = dict(color="black", ls="--", lw=1.5) if group == "whole model" else dict(lw=1)
        ax.plot(tokens_at(metrics, steps), values, label=group, **style)
    ax.set(xlabel="tokens seen", ylabel="B_simple (samples)", title=f"{title} gradient noise scale per group".strip())
    ax.legend(fontsize="small", ncol=1 + len(groups) // 8)
    ax.grid(alpha=0.3)
    return figure


def loss_figure(metrics: Metrics, title: str = "") -> Any:
    """train/loss and val/loss (nats per token) against tokens, dotted where the global batch changed."""
    figure, (ax,) = _axes(1, 4.5)
    _losses(ax, metrics, lambda steps, values: (tokens_at(metrics, steps), values), "tokens seen")
    if GLOBAL_BATCH in metrics:
        steps, sizes = metrics[GLOBAL_BATCH]
        # A row holds its step's batch and the tokens seen after it: a change took effect after the step before.
        for tokens in tokens_at(metrics, steps[1:][np.diff(sizes) != 0] - 1):
            ax.axvline(tokens, color="gray", ls=":", lw=1)
    ax.set_title(f"{title} loss".strip())
    return figure


def batch_lr_figure(metrics: Metrics, title: str = "") -> Any:
    """The global batch (samples) and the LR against tokens, a panel each."""
    labels = {GLOBAL_BATCH: "global batch (samples)", LR: "learning rate"}
    panels = [name for name in labels if name in metrics]
    if not panels:
        return None
    figure, axes = _axes(len(panels), 2.6, sharex=True)
    for ax, name in zip(axes, panels):
        steps, values = metrics[name]
        # Row i's value held over the tokens its step trained on, from the tokens seen after step i - 1 (0 first).
        ax.step(np.concatenate([[0.0], tokens_at(metrics, steps)]), np.concatenate([values[:1], values]), where="pre")
        ax.set_ylabel(labels[name])
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("tokens seen")
    axes[0].set_title(f"{title} batch size and LR".strip())
    return figure


def wall_clock_figure(metrics: Metrics, title: str = "") -> Any:
    """The loss against seconds of training, and the noise scale (samples) against tokens."""
    if FIT_SECONDS not in metrics or not any(name in metrics for name in (TRAIN_LOSS, VAL_LOSS, GNS_B_SIMPLE)):
        return None
    seconds = dict(zip(*(column.tolist() for column in metrics[FIT_SECONDS])))
    noise = GNS_B_SIMPLE in metrics and TOKENS_SEEN in metrics
    figure, axes = _axes(1 + noise, 3.6)

    def at_seconds(steps: np.ndarray, values: np.ndarray) -> tuple[list[float], list[float]]:
        pairs = [(seconds[step], value) for step, value in zip(steps.tolist(), values.tolist()) if step in seconds]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    _losses(axes[0], metrics, at_seconds, "wall-clock seconds of training")
    if noise:
        steps, values = metrics[GNS_B_SIMPLE]
        axes[1].plot(tokens_at(metrics, steps), values)
        axes[1].set(xlabel="tokens seen", ylabel="gradient noise scale B_simple (samples)", yscale="log")
        axes[1].grid(alpha=0.3)
    return figure


# The PNGs a run writes into its folder: (metrics, title) -> a Figure, or None where there is nothing to draw.
RUN_FIGURES: dict[str, Callable[..., Any]] = {
    "loss_vs_tokens.png": loss_figure,
    "batch_lr_vs_tokens.png": batch_lr_figure,
    "gns_groups_vs_tokens.png": group_noise_scale_figure,
}


def _read_metrics(metrics_csv: str | os.PathLike[str]) -> Metrics:
    metrics = read_metrics_csv(metrics_csv)
    if TOKENS_SEEN not in metrics:
        raise ValueError(f"{str(metrics_csv)!r} has no {TOKENS_SEEN} column: add lit_cbs.BatchWarmup to the callbacks")
    return metrics


def plot_run(metrics_csv: str | os.PathLike[str], output_dir: str | os.PathLike[str], title: str = "") -> list[Path]:
    """Write ``RUN_FIGURES`` of a CSVLogger's file into ``output_dir``; return the paths of those drawn."""
    from lit_cbs._figures import save_figure

    metrics = _read_metrics(metrics_csv)
    figures = {name: draw(metrics, title) for name, draw in RUN_FIGURES.items()}
    return [save_figure(figure, Path(output_dir) / name) for name, figure in figures.items() if figure is not None]


PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>body {{ font-family: sans-serif; max-width: 1100px; margin: 2em auto; color: #222; }}
figure {{ margin: 1.5em 0; }} img {{ max-width: 100%; border: 1px solid #ddd; }} table {{ border-collapse: collapse; \
margin: 1em 0; }} td, th {{ border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }}</style></head>
<body data-figures="{count}">
<h1>{title}</h1>
{body}
<script>
window.addEventListener("error", function (event) {{ document.body.dataset.error = String(event.message); }});
window.addEventListener("load", function () {{
  var images = Array.prototype.slice.call(document.images);
  var loaded = images.filter(function (image) {{ return image.complete && image.naturalWidth > 0; }});
  document.body.dataset.figuresLoaded = String(loaded.length);
}});
</script>
</body></html>
"""
# report.html's figures, in order: file -> caption
CAPTIONS = {
    "loss_vs_tokens.png": "Loss against tokens (dotted: batch changes)",
    WALL_CLOCK_FILE: "Loss against wall-clock seconds",
    "batch_lr_vs_tokens.png": "Global batch and LR against tokens",
    "gns_groups_vs_tokens.png": "Noise scale per group of parameters",
    PLOT_FILE: "CBS readings: brackets [k* B, next k B] (hollow: undetermined), and the loss gaps with error bars",
}


def _table(title: str, rows: list[list[Any]] | list[tuple[str, str]], header: tuple[str, ...] = ()) -> str:
    cells = "".join(f"<th>{html.escape(str(name))}</th>" for name in header)
    lines = "".join("<tr>" + "".join(f"<td>{html.escape(str(value))}</td>" for value in row) + "</tr>" for row in rows)
    return f"<h2>{title}</h2><table>{f'<tr>{cells}</tr>' if cells else ''}{lines}</table>"


def _current(path: Path, source: Path) -> bool:
    return path.is_file() and path.stat().st_mtime_ns >= source.stat().st_mtime_ns


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the run's page (default ``RUN_DIR/report.html``), drawing figures missing or stale."""
    from lit_cbs._figures import save_figure
    from lit_cbs.analysis.probe_schedule import run_config_value
    from lit_cbs.probe.plot import plot_cbs_curve

    run_dir = Path(run_dir)
    metrics_csv = run_dir / METRICS_FILE
    if not metrics_csv.is_file():
        raise ValueError(f"{str(run_dir)!r} has no {METRICS_FILE}: give the folder of a run logged with the CSV logger")
    metrics = _read_metrics(metrics_csv)
    summary, history = (
        json.loads(f.read_text()) if f.is_file() else {}
        for f in (run_dir / "summary.json", run_dir / "batch_history.json")
    )
    changes = [BatchChange(**change) for change in history.get("changes", [])]
    probe_file = min(run_dir.rglob(JSONL_FILE), default=None)
    readings = read_readings(probe_file) if probe_file is not None else []
    draw = {**RUN_FIGURES, WALL_CLOCK_FILE: wall_clock_figure}
    parts = [_table("Summary", summary_rows(summary))] if summary else []
    for file, caption in CAPTIONS.items():
        path = run_dir / file
        if file == PLOT_FILE:  # the CBS curve, beside the probe's readings
            if not readings or probe_file is None:
                continue
            path = probe_file.parent / PLOT_FILE
            if not _current(path, probe_file):
                found = run_config_value(run_dir, "callbacks.cbs_probe.epsilon")  # the plot's tolerance line
                epsilon = float(found[0]) if found is not None and found[0] is not None else None
                plot_cbs_curve(readings, changes, path, summary.get("tokens"), epsilon)
        elif not _current(path, metrics_csv):
            figure = draw[file](metrics, summary.get("run_name", ""))
            if figure is None:
                continue
            save_figure(figure, path)
        if file == WALL_CLOCK_FILE and GNS_B_SIMPLE in metrics:
            caption += "; the gradient noise scale against tokens"
        data, caption = base64.b64encode(path.read_bytes()).decode("ascii"), html.escape(caption)
        image = f'<img alt="{caption}" src="data:image/png;base64,{data}">'
        parts.append(f"<figure>{image}<figcaption>{caption}</figcaption></figure>")
    if changes:
        header = ("after step", "tokens", "global batch", "micro x accumulate", "LR x", "cause")
        rows = [
            [c.step, f"{c.tokens_seen:,}", f"{c.old_global_batch} -> {c.new_global_batch}"]
            + [f"{c.new_micro_batch_size} x {c.new_accumulate}", f"{c.lr_factor:.4g}", c.cause]
            for c in changes
        ]
        parts.append(_table("Batch changes", rows, header))
    if readings:
        rows = [
            [f"{r.tokens:,}", r.batch_size, f"{r.k_star:g}"]
            + [f"[{r.cbs_lower:g}, {'open' if r.cbs_upper is None else f'{r.cbs_upper:g}'}]"]
            + ["yes" if r.determined else "no"]
            for r in readings
        ]
        parts.append(_table("CBS readings", rows, ("tokens", "batch", "k*", "CBS (samples)", "determined")))
    title = html.escape(f"lit_cbs run: {summary.get('run_name', run_dir.name)}")
    page = PAGE.format(title=title, count=sum(part.startswith("<figure") for part in parts), body="\n".join(parts))
    out = Path(out) if out is not None else run_dir / "report.html"
    out.write_text(page)
    return out


def main(argv: list[str] | None = None) -> Path:
    """``python -m lit_cbs.run.report RUN_DIR [--out PATH]``: ``write_report``; print the page's path."""
    parser = argparse.ArgumentParser(description="Write a run's self-contained HTML page (report.html).")
    parser.add_argument("run_dir", type=Path, help="a run folder (any with a CSVLogger's metrics.csv)")
    parser.add_argument("--out", type=Path, default=None, help="where to write it (default: RUN_DIR/report.html)")
    args = parser.parse_args(argv)
    try:
        path = write_report(args.run_dir, args.out)
    except ValueError as error:
        parser.error(str(error))
    print(path)
    return path


if __name__ == "__main__":
    main()
