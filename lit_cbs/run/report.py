"""What a run leaves in its folder: batch_history.json, summary.json, the plots, and report.html
(``python -m lit_cbs.run.report RUN_DIR``)."""

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


def write_batch_history(path: str | os.PathLike[str], warmup: BatchWarmup) -> dict[str, Any]:
    """Write ``warmup``'s batch changes, guard verdicts and final counts as JSON to ``path``."""
    record = {
        "schedule": repr(warmup.schedule),
        "lr_rule": repr(warmup.lr_rule),
        "changes": [dataclasses.asdict(change) for change in warmup.history],
        "guard_verdicts": [dataclasses.asdict(verdict) for verdict in warmup.guard.verdicts] if warmup.guard else None,
        "final": {
            "samples_seen": warmup.accounting.samples_seen if warmup.accounting else 0,
            "tokens_seen": warmup.accounting.tokens_seen if warmup.accounting else 0,
            "global_batch": warmup.global_batch,
            "accumulate": warmup.accumulate,
            "micro_batch_size": warmup.micro_batch_size,
            "lr_factor": warmup.lr_factor,
        },
    }
    Path(path).write_text(json.dumps(record, indent=2))
    return record


def read_batch_history(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What ``write_batch_history`` wrote."""
    record: dict[str, Any] = json.loads(Path(path).read_text())
    return record


def run_summary(trainer: pl.Trainer, warmup: BatchWarmup, run_name: str, fit_seconds: float) -> dict[str, Any]:
    """summary.json. ``fit_seconds``: this ``trainer.fit`` call, setup included (``run_seconds``: every fit of the
    run from its ``on_fit_start``)."""
    val_loss = trainer.callback_metrics.get(VAL_LOSS)
    accounting = warmup.accounting
    if accounting is None:
        raise RuntimeError(
            "run_summary: the BatchWarmup was not set up by a Trainer (no accounting); call it after fit"
        )
    signum = stop_signal(trainer)
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
    callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector, undeclared
    probes = [callback for callback in callbacks if isinstance(callback, CBSProbeCallback)]
    if probes:
        history, status = probes[0].history, probes[0].status()
        summary["probe"] = {
            "tokens": probes[0].tokens_spent,
            "optimizer_steps": sum(reading.branch_steps for reading in history),
            "readings": [{key: getattr(r, key) for key in _READING_KEYS} for r in history],
            "points": {key: status[key] for key in ("read", "determined", "failed", "pending")},
            "adaptive": status.get("adaptive"),
            "side_jobs": status.get("side_jobs"),  # what the main run waited for its side jobs (seconds)
        }
    return summary


def _probe_rows(probe: dict[str, Any], tokens: int, rows: list[tuple[str, str]]) -> None:
    """Insert the probe's rows (readings, points, side-job waits, CBSAdaptive's) into ``rows``."""
    if probe["readings"]:
        readings = "; ".join(
            (f"[{r['cbs_lower']:g}, {r['cbs_upper']:g}]" if r["cbs_upper"] is not None else f">= {r['cbs_lower']:g}")
            + f" at {r['tokens']:,} tokens, "
            + ("determined" if r["determined"] else "undetermined")
            for r in probe["readings"]
        )
        share = probe["tokens"] / tokens
        cost = f"{probe['tokens']:,} tokens ({share:.0%} of training) in {probe['optimizer_steps']:,} optimizer steps"
        rows.insert(3, ("CBS (samples)", f"{readings}; probes trained {cost}"))
    points = probe.get("points")
    if points:
        failed, pending = points["failed"], points["pending"]
        said = (
            f"{points['read']} read ({points['determined']} determined), {len(failed)} failed, {len(pending)} pending"
        )
        if failed:
            reasons = "; ".join(dict.fromkeys(failure["reason"] for failure in failed))
            at = ", ".join(f"{failure['tokens']:,}" for failure in failed)
            said += f". FAILED at {at} tokens: {reasons}"
        if pending:
            said += f". Pending at {', '.join(f'{tokens:,}' for tokens in pending)} tokens (last.ckpt collects them)"
        rows.insert(0 if failed or pending else 4 if probe["readings"] else 3, ("probe points", said))
    waits = probe.get("side_jobs")
    if waits:
        rows.insert(
            [label for label, _ in rows].index("wall time") + 1,
            (
                "side-job waits",
                f"{waits['checkpoint']:.1f} s writing {waits['checkpoints']} checkpoint(s), {waits['poll']:.1f} s in "
                f"{waits['polls']:,} looks for results, {waits['at_end']:.1f} s for the last readings at the end",
            ),
        )
    adaptive = probe.get("adaptive")
    if adaptive and adaptive["why_not"]:
        rows.insert(0, ("CBSAdaptive", f"NEVER GREW THE BATCH: {adaptive['why_not']}"))


def summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """summary.json as (label, value) rows: the lines a run ends with, and report.html's table."""
    steps, tokens, first = summary["optimizer_steps"], summary["tokens"], summary["first_batch"]
    fewer = 1 - steps / (tokens / (first * summary["seq_len"]))  # than at the starting batch throughout
    changes = ", ".join(
        f"{c['old']} -> {c['new']} after step {c['step']:,} ({c['tokens']:,} tokens, "
        f"micro {c['micro_batch_size']} x accumulate {c['accumulate']}, LR x{c['lr_factor']:.3g})"
        for c in summary["batch_changes"]
    )
    val_loss = summary["final_val_loss"]
    seconds, this_fit = summary["fit_seconds"], summary["tokens_this_fit"]
    resumed = this_fit != tokens
    throughput = f"{this_fit / seconds:,.0f} tokens/s over this fit" + (
        f", which trained {this_fit:,} of them" if resumed else ""
    )
    wall = f"{seconds:,.1f} s (trainer.fit, setup included)"
    if resumed:  # every fit of the run counted without its setup
        wall += f"; {summary['run_seconds']:,.1f} s over the whole run, every fit counted without its setup"
    rows = [
        ("tokens", f"{tokens:,} ({throughput})"),
        ("optimizer steps", f"{steps:,} ({fewer:.0%} fewer than at the starting batch {first})"),
        ("batch changes", changes or "none"),
        ("final val/loss", f"{val_loss:.4f} nats per token" if val_loss is not None else "(not evaluated)"),
        ("wall time", wall),
    ]
    if summary.get("stopped_by"):
        resume = "resume from checkpoints/last.ckpt (ckpt_path=...)"
        rows.append(("stopped by", f"{summary['stopped_by']} after step {steps:,}: {resume}"))
    if summary["probe"]:
        _probe_rows(summary["probe"], tokens, rows)
    return rows


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
    """Write batch_history.json, summary.json and, with ``plots`` and a metrics.csv, the plots (also sent to the
    loggers); return the summary and the lines a run ends with."""
    output_dir = Path(output_dir)
    write_batch_history(output_dir / "batch_history.json", warmup)
    summary = run_summary(trainer, warmup, run_name, fit_seconds)
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    metrics_csv = output_dir / METRICS_FILE
    if plots and metrics_csv.is_file():
        log_figures(trainer.loggers, plot_run(metrics_csv, output_dir, title=run_name), trainer.global_step)
    ending = "stopped" if summary["stopped_by"] else "done"
    return summary, f"lit_cbs: {run_name} {ending}\n{summary_text(summary)}\noutputs          {output_dir}"


def group_noise_scale_figure(metrics: Metrics, title: str = "") -> Any:
    """B_simple (samples) of each ``gns/<group>/b_simple`` and of the whole model against tokens."""
    from matplotlib.figure import Figure

    groups = [(group, metrics[name]) for name in metrics if (group := gns_group(name)) is not None]
    if not groups:
        return None
    # In number order (block2 before block10): CSVLogger sorts its columns as text.
    groups.sort(key=lambda group: [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", group[0])])
    figure = Figure(figsize=(7, 4.5))
    ax = figure.add_subplot()
    for group, (steps, values) in groups:
        ax.plot(tokens_at(metrics, steps), values, lw=1, label=group)
    steps, values = metrics[GNS_B_SIMPLE]
    ax.plot(tokens_at(metrics, steps), values, color="black", ls="--", lw=1.5, label="whole model")
    ax.set(xlabel="tokens seen", ylabel="B_simple (samples)", title=f"{title} gradient noise scale per group".strip())
    ax.legend(fontsize="small", ncol=1 + len(groups) // 8)
    ax.grid(alpha=0.3)
    return figure


_LOSS_STYLES: dict[str, dict[str, Any]] = {
    TRAIN_LOSS: dict(lw=0.8, alpha=0.6),
    VAL_LOSS: dict(marker="o", lw=1.5),
}


def loss_figure(metrics: Metrics, title: str = "") -> Any:
    """train/loss and val/loss (nats per token) against tokens, dotted where the global batch changed."""
    from matplotlib.figure import Figure

    batch_changes = []
    if GLOBAL_BATCH in metrics:
        steps, sizes = metrics[GLOBAL_BATCH]
        # A row holds its step's batch and the tokens seen after it: a change took effect after the step before.
        batch_changes = list(tokens_at(metrics, steps[1:][np.diff(sizes) != 0] - 1))
    figure = Figure(figsize=(7, 4.5))
    ax = figure.add_subplot()
    for name, style in _LOSS_STYLES.items():
        if name in metrics:
            steps, values = metrics[name]
            ax.plot(tokens_at(metrics, steps), values, label=name, **style)
    for tokens in batch_changes:
        ax.axvline(tokens, color="gray", ls=":", lw=1)
    ax.set(xlabel="tokens seen", ylabel="loss (nats per token)", title=f"{title} loss".strip())
    if ax.get_legend_handles_labels()[0]:  # the batch-change lines have no label
        ax.legend()
    ax.grid(alpha=0.3)
    return figure


def batch_lr_figure(metrics: Metrics, title: str = "") -> Any:
    """The global batch (samples) and the LR against tokens, a panel each."""
    from matplotlib.figure import Figure

    panels = [
        (name, label)
        for name, label in ((GLOBAL_BATCH, "global batch (samples)"), (LR, "learning rate"))
        if name in metrics
    ]
    if not panels:
        return None
    figure = Figure(figsize=(7, 2.6 * len(panels)))
    axes = figure.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (name, label) in zip(axes, panels):
        steps, values = metrics[name]
        # Row i's value held over the tokens its step trained on, from the tokens seen after step i - 1 (0 first).
        ax.step(np.concatenate([[0.0], tokens_at(metrics, steps)]), np.concatenate([values[:1], values]), where="pre")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("tokens seen")
    axes[0].set_title(f"{title} batch size and LR".strip())
    return figure


def wall_clock_figure(metrics: Metrics, title: str = "") -> Any:
    """The loss against seconds of training, and the noise scale (samples) against tokens."""
    from matplotlib.figure import Figure

    if FIT_SECONDS not in metrics or not any(name in metrics for name in (TRAIN_LOSS, VAL_LOSS, GNS_B_SIMPLE)):
        return None
    seconds = dict(zip(*(column.tolist() for column in metrics[FIT_SECONDS])))
    panels = [name for name in (GNS_B_SIMPLE,) if name in metrics and TOKENS_SEEN in metrics]
    figure = Figure(figsize=(7, 3.6 * (1 + len(panels))))
    axes = figure.subplots(1 + len(panels), 1, squeeze=False)[:, 0]
    for name, style in _LOSS_STYLES.items():
        if name in metrics:
            steps, values = metrics[name]
            pairs = [(seconds[step], value) for step, value in zip(steps.tolist(), values.tolist()) if step in seconds]
            axes[0].plot([p[0] for p in pairs], [p[1] for p in pairs], label=name, **style)
    axes[0].set(xlabel="wall-clock seconds of training", ylabel="loss (nats per token)")
    if axes[0].lines:
        axes[0].legend()
    axes[0].grid(alpha=0.3)
    for axis, name in zip(axes[1:], panels):
        steps, values = metrics[name]
        axis.plot(tokens_at(metrics, steps), values)
        axis.set(xlabel="tokens seen", ylabel="gradient noise scale B_simple (samples)", yscale="log")
        axis.grid(alpha=0.3)
    return figure


# The PNGs a run writes into its folder: (metrics, title) -> a Figure, or None where there is nothing to draw.
RUN_FIGURES: dict[str, Callable[..., Any]] = {
    "loss_vs_tokens.png": loss_figure,
    "batch_lr_vs_tokens.png": batch_lr_figure,
    "gns_groups_vs_tokens.png": group_noise_scale_figure,
}


def read_run_metrics(metrics_csv: str | os.PathLike[str]) -> Metrics:
    """A CSVLogger's file; ValueError without ``tokens_seen``, which every figure needs."""
    metrics = read_metrics_csv(metrics_csv)
    if TOKENS_SEEN not in metrics:
        raise ValueError(f"{str(metrics_csv)!r} has no {TOKENS_SEEN} column: add lit_cbs.BatchWarmup to the callbacks")
    return metrics


def plot_run(metrics_csv: str | os.PathLike[str], output_dir: str | os.PathLike[str], title: str = "") -> list[Path]:
    """Write ``RUN_FIGURES`` of a CSVLogger's file into ``output_dir``; return the paths of those drawn."""
    from lit_cbs._figures import save_figure

    metrics = read_run_metrics(metrics_csv)
    figures = {name: draw(metrics, title) for name, draw in RUN_FIGURES.items()}
    return [save_figure(figure, Path(output_dir) / name) for name, figure in figures.items() if figure is not None]


PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: sans-serif; max-width: 1100px; margin: 2em auto; color: #222; }}
figure {{ margin: 1.5em 0; }} img {{ max-width: 100%; border: 1px solid #ddd; }}
table {{ border-collapse: collapse; margin: 1em 0; }} \
td, th {{ border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }}
</style></head>
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
CAPTIONS = {
    "loss_vs_tokens.png": "Loss against tokens (dotted: batch changes)",
    WALL_CLOCK_FILE: "Loss against wall-clock seconds",
    "batch_lr_vs_tokens.png": "Global batch and LR against tokens",
    "gns_groups_vs_tokens.png": "Noise scale per group of parameters",
}


def _table(rows: list[list[Any]] | list[tuple[str, str]], header: list[str] | None = None) -> str:
    cells = "".join(f"<th>{html.escape(str(name))}</th>" for name in header) if header else ""
    lines = "".join("<tr>" + "".join(f"<td>{html.escape(str(value))}</td>" for value in row) + "</tr>" for row in rows)
    return f"<table>{f'<tr>{cells}</tr>' if cells else ''}{lines}</table>"


def _figure(path: Path, caption: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return (
        f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,{data}">'
        f"<figcaption>{html.escape(caption)}</figcaption></figure>"
    )


def _current(path: Path, source: Path) -> bool:
    return path.is_file() and path.stat().st_mtime_ns >= source.stat().st_mtime_ns


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the run's page (default ``RUN_DIR/report.html``); figures missing or older than their source are drawn
    first. ValueError without a metrics.csv."""
    from lit_cbs._figures import save_figure
    from lit_cbs.analysis.probe_schedule import run_config_value

    run_dir = Path(run_dir)
    metrics_csv = run_dir / METRICS_FILE
    if not metrics_csv.is_file():
        raise ValueError(f"{str(run_dir)!r} has no {METRICS_FILE}: give the folder of a run logged with the CSV logger")
    metrics = read_run_metrics(metrics_csv)
    summary, history = (
        json.loads(f.read_text()) if f.is_file() else {}
        for f in (run_dir / "summary.json", run_dir / "batch_history.json")
    )
    changes = [BatchChange(**change) for change in history.get("changes", [])]
    probe_file = min(run_dir.rglob(JSONL_FILE), default=None)
    readings = read_readings(probe_file) if probe_file is not None else []
    name = summary.get("run_name", "")  # the figures' title
    draw = {**RUN_FIGURES, WALL_CLOCK_FILE: wall_clock_figure}
    figures = []
    for file, caption in CAPTIONS.items():
        path = run_dir / file
        if not _current(path, metrics_csv):
            figure = draw[file](metrics, name)
            if figure is None:
                continue
            save_figure(figure, path)
        noise = (
            "; the gradient noise scale against tokens" if file == WALL_CLOCK_FILE and GNS_B_SIMPLE in metrics else ""
        )
        figures.append((path, caption + noise))
    if readings and probe_file is not None:
        curve = probe_file.parent / PLOT_FILE
        if not _current(curve, probe_file):
            from lit_cbs.probe.plot import plot_cbs_curve

            found = run_config_value(run_dir, "callbacks.cbs_probe.epsilon")  # the plot's tolerance line
            epsilon = float(found[0]) if found is not None and found[0] is not None else None
            plot_cbs_curve(readings, changes, curve, summary.get("tokens"), epsilon)
        figures.append(
            (curve, "CBS readings: brackets [k* B, next k B] (hollow: undetermined), and the loss gaps with error bars")
        )
    parts = [_figure(path, caption) for path, caption in figures]
    if summary:
        parts.insert(0, "<h2>Summary</h2>" + _table(summary_rows(summary)))
    if changes:
        header = ["after step", "tokens", "global batch", "micro x accumulate", "LR x", "cause"]
        rows = [
            [c.step, f"{c.tokens_seen:,}", f"{c.old_global_batch} -> {c.new_global_batch}"]
            + [f"{c.new_micro_batch_size} x {c.new_accumulate}", f"{c.lr_factor:.4g}", c.cause]
            for c in changes
        ]
        parts.append("<h2>Batch changes</h2>" + _table(rows, header))
    if readings:
        rows = [
            [f"{r.tokens:,}", r.batch_size, f"{r.k_star:g}"]
            + [f"[{r.cbs_lower:g}, {'open' if r.cbs_upper is None else f'{r.cbs_upper:g}'}]"]
            + ["yes" if r.determined else "no"]
            for r in readings
        ]
        parts.append("<h2>CBS readings</h2>" + _table(rows, ["tokens", "batch", "k*", "CBS (samples)", "determined"]))
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
