"""What a training run leaves in its folder besides checkpoints: its summary, the batch/LR history and plots.

``write_run_summary`` writes all of it for recipes/train.py and returns the summary with the lines
that say it (``run_header`` says what the run will do before it starts). ``write_batch_history``
saves ``BatchWarmup``'s record as JSON; ``plot_run`` draws the loss,
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
import signal
from pathlib import Path

import lightning.pytorch as pl
import numpy as np

from lit_cbs.analysis.curves import read_metrics_csv, tokens_at
from lit_cbs.callbacks.logs import log_figures
from lit_cbs.callbacks.warmup import BatchWarmup
from lit_cbs.data import TokenDataModule
from lit_cbs.metrics import GLOBAL_BATCH as BATCH_COLUMN
from lit_cbs.metrics import GNS_B_SIMPLE as GNS_COLUMN
from lit_cbs.metrics import LR as LR_COLUMN
from lit_cbs.metrics import TOKENS_SEEN as TOKENS_COLUMN
from lit_cbs.metrics import TRAIN_LOSS as LOSS_COLUMN
from lit_cbs.metrics import VAL_LOSS, gns_group
from lit_cbs.metrics import VAL_LOSS as VAL_LOSS_COLUMN
from lit_cbs.models.lm import CausalLM
from lit_cbs.probe.callback import CBSProbeCallback
from lit_cbs.recipes.plan import batch_phases
from lit_cbs.rules.batch_schedules import BatchSchedule, CBSAdaptive

__all__: list[str] = []  # recipes/train.py and report.py write the run folder with these


def write_batch_history(path: str | os.PathLike, warmup: BatchWarmup) -> dict:
    """Write ``warmup``'s batch changes and final counts as JSON to ``path``; return what was written.

    Each change has the optimizer step it took effect after, the samples/tokens seen then, the old
    and new global batch (samples), accumulation and micro-batch, its LR factor and its cause
    ("schedule", or "guard" for a revert); ``guard_verdicts`` holds the guard's judgement of each
    increase (lit_cbs.rules.guard.GuardVerdict), or None without a guard.

    Args:
        path: the JSON file to write (``batch_history.json`` in a recipe run's folder).
        warmup: the run's BatchWarmup.

    Returns:
        The record written: ``schedule``, ``lr_rule``, ``changes``, ``guard_verdicts`` and ``final``.

    Examples:
        A BatchWarmup no Trainer has run yet has no change and no count:

        >>> import tempfile
        >>> from pathlib import Path
        >>> from lit_cbs import BatchWarmup
        >>> from lit_cbs.rules.batch_schedules import PiecewiseBatch
        >>> warmup = BatchWarmup(PiecewiseBatch(thresholds=[0, 65536], batch_sizes=[8, 16], unit="tokens"))
        >>> folder = tempfile.TemporaryDirectory()
        >>> record = write_batch_history(Path(folder.name) / "batch_history.json", warmup)
        >>> record["changes"], record["final"]["tokens_seen"]
        ([], 0)
        >>> read_batch_history(Path(folder.name) / "batch_history.json") == record
        True
        >>> folder.cleanup()
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


def read_batch_history(path: str | os.PathLike) -> dict:
    """What ``write_batch_history`` wrote to ``path``.

    Args:
        path: a ``batch_history.json``.

    Returns:
        Its record, in this version's form (see ``write_batch_history``, whose example reads one back).
    """
    return json.loads(Path(path).read_text())


def group_noise_scale_figure(metrics: dict[str, tuple[np.ndarray, np.ndarray]], title: str = ""):
    """B_simple (samples) of every group ``gns/<group>/b_simple`` and of the whole model against tokens
    seen, as a matplotlib ``Figure``; None when the metrics hold no per-group noise scale.

    Args:
        metrics: a CSVLogger's metrics (``read_run_metrics``): column -> (steps, values).
        title: put before the figure's title (the run's name).

    Returns:
        The figure, or None.

    Examples:
        >>> group_noise_scale_figure({}) is None
        True
    """
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
    steps, values = metrics[GNS_COLUMN]
    ax.plot(tokens_at(metrics, steps), values, color="black", ls="--", lw=1.5, label="whole model")
    ax.set(xlabel="tokens seen", ylabel="B_simple (samples)", title=f"{title} gradient noise scale per group".strip())
    ax.legend(fontsize="small", ncol=1 + len(groups) // 8)
    ax.grid(alpha=0.3)
    return figure


def loss_figure(metrics: dict[str, tuple[np.ndarray, np.ndarray]], title: str = ""):
    """Whichever of ``train/loss`` and ``val/loss`` (nats per token) ``metrics`` holds against tokens seen,
    with a dotted line where the global batch changed, as a matplotlib ``Figure``.

    Args:
        metrics: a CSVLogger's metrics (``read_run_metrics``): column -> (steps, values).
        title: put before the figure's title (the run's name).

    Returns:
        The figure.

    Examples:
        >>> import numpy as np
        >>> steps = np.array([0.0, 1.0, 2.0])
        >>> metrics = {"tokens_seen": (steps, np.array([1024.0, 2048.0, 4096.0])),
        ...            "train/loss": (steps, np.array([5.5, 5.25, 5.0]))}
        >>> type(loss_figure(metrics, "demo")).__name__
        'Figure'
    """
    from matplotlib.figure import Figure

    batch_changes = []
    if BATCH_COLUMN in metrics:
        steps, sizes = metrics[BATCH_COLUMN]
        # A row holds the batch its own step trained with, and the tokens seen after that step: a change took
        # effect after the step before the first row at the new size (exact when every step is logged).
        batch_changes = list(tokens_at(metrics, steps[1:][np.diff(sizes) != 0] - 1))
    figure = Figure(figsize=(7, 4.5))
    ax = figure.add_subplot()
    for name, style in ((LOSS_COLUMN, dict(lw=0.8, alpha=0.6)), (VAL_LOSS_COLUMN, dict(marker="o", lw=1.5))):
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


def batch_lr_figure(metrics: dict[str, tuple[np.ndarray, np.ndarray]], title: str = ""):
    """The global batch (samples) and the LR against tokens seen, one panel each, as a matplotlib
    ``Figure``; None when ``metrics`` holds neither.

    Args:
        metrics: a CSVLogger's metrics (``read_run_metrics``): column -> (steps, values).
        title: put before the figure's title (the run's name).

    Returns:
        The figure, or None.

    Examples:
        >>> batch_lr_figure({}) is None
        True
    """
    from matplotlib.figure import Figure

    panels = [
        (name, label)
        for name, label in ((BATCH_COLUMN, "global batch (samples)"), (LR_COLUMN, "learning rate"))
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


# The PNGs a run writes into its folder, each drawn from a CSVLogger's metrics and a title (None: nothing to draw).
RUN_FIGURES = {
    "loss_vs_tokens.png": loss_figure,
    "batch_lr_vs_tokens.png": batch_lr_figure,
    "gns_groups_vs_tokens.png": group_noise_scale_figure,
}


def read_run_metrics(metrics_csv: str | os.PathLike) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """A CSVLogger's file (``read_metrics_csv``), refused (ValueError) without ``tokens_seen`` (logged by
    BatchWarmup), which every figure of the run is drawn against.

    Args:
        metrics_csv: the CSVLogger's ``metrics.csv``.

    Returns:
        Column -> (steps, values), each a float array over the rows that hold the column.

    Raises:
        ValueError: the file has no ``tokens_seen`` column.

    Examples:
        >>> import tempfile
        >>> from pathlib import Path
        >>> folder = tempfile.TemporaryDirectory()
        >>> csv = Path(folder.name) / "metrics.csv"
        >>> _ = csv.write_text("step,tokens_seen,train/loss\\n0,1024,5.5\\n1,2048,5.25\\n")
        >>> metrics = read_run_metrics(csv)
        >>> sorted(metrics), metrics["train/loss"][1].tolist()
        (['tokens_seen', 'train/loss'], [5.5, 5.25])
        >>> _ = csv.write_text("step,train/loss\\n0,5.5\\n")
        >>> read_run_metrics(csv)
        Traceback (most recent call last):
        ...
        ValueError: '.../metrics.csv' has no tokens_seen column: add lit_cbs.BatchWarmup to the callbacks
        >>> folder.cleanup()
    """
    metrics = read_metrics_csv(metrics_csv)
    if TOKENS_COLUMN not in metrics:
        problem = f"{str(metrics_csv)!r} has no {TOKENS_COLUMN} column"
        raise ValueError(f"{problem}: add lit_cbs.BatchWarmup to the callbacks")
    return metrics


def plot_run(metrics_csv: str | os.PathLike, output_dir: str | os.PathLike, title: str = "") -> list[Path]:
    """Write ``RUN_FIGURES`` of a CSVLogger's file into ``output_dir``: ``loss_vs_tokens.png`` (``loss_figure``),
    ``batch_lr_vs_tokens.png`` (``batch_lr_figure``) and ``gns_groups_vs_tokens.png``
    (``group_noise_scale_figure``); return the paths of those written.

    Needs ``tokens_seen`` in the CSV (logged by BatchWarmup). Drawn on ``Figure`` objects with the Agg
    canvas: no pyplot state, no display.

    Args:
        metrics_csv: the CSVLogger's ``metrics.csv``.
        output_dir: the folder to write the PNGs into.
        title: put before each figure's title (the run's name).

    Returns:
        The paths of the PNGs written.

    Raises:
        ValueError: the file has no ``tokens_seen`` column.

    Examples:
        Only the loss is logged here, so only its figure is drawn:

        >>> import tempfile
        >>> from pathlib import Path
        >>> folder = tempfile.TemporaryDirectory()
        >>> csv = Path(folder.name) / "metrics.csv"
        >>> _ = csv.write_text("step,tokens_seen,train/loss\\n0,1024,5.5\\n1,2048,5.25\\n")
        >>> [path.name for path in plot_run(csv, folder.name, title="demo")]
        ['loss_vs_tokens.png']
        >>> folder.cleanup()
    """
    from lit_cbs.analysis.plots import save_figure

    metrics = read_run_metrics(metrics_csv)
    figures = {name: draw(metrics, title) for name, draw in RUN_FIGURES.items()}
    return [save_figure(figure, Path(output_dir) / name) for name, figure in figures.items() if figure is not None]


@dataclasses.dataclass
class Run:
    """A recipe run's objects, built and checked, before ``trainer.fit``."""

    trainer: pl.Trainer
    model: CausalLM
    datamodule: TokenDataModule
    batch_warmup: BatchWarmup
    ckpt_path: str | None = None  # the checkpoint trainer.fit resumes from (lit_cbs.recipes.job.resume_checkpoint)


def batches_reached(schedule: BatchSchedule, max_tokens: int, seq_len: int) -> str:
    """The global batches (samples) the run trains at within max_tokens, and any of the schedule's it ends before.

    Args:
        schedule: the run's batch schedule.
        max_tokens: the run's token budget.
        seq_len: tokens per sample.

    Returns:
        The batches, for the line a run starts with.

    Examples:
        >>> from lit_cbs.rules.batch_schedules import PiecewiseBatch
        >>> schedule = PiecewiseBatch(thresholds=[0, 65536], batch_sizes=[8, 16], unit="tokens")
        >>> batches_reached(schedule, 200_000, 128)
        '8 -> 16 samples'
        >>> batches_reached(schedule, 32_768, 128)
        '8 samples (not 16: batch.schedule asks for it after max_tokens=32,768)'
    """
    if isinstance(schedule, CBSAdaptive):  # its batches come from the probe's readings
        return f"{schedule.start} -> up to {schedule.final} samples (batch.schedule, by CBS readings)"
    phases = batch_phases(schedule, max_tokens, seq_len, 1, 1, lambda ratio: 1.0)
    reached = list(dict.fromkeys(phase.global_batch for phase in phases))
    text = f"{' -> '.join(map(str, reached))} samples"
    never = [size for size in schedule.sizes(0) if size not in reached]
    if never:
        them = "it" if len(never) == 1 else "them"
        text += f" (not {', '.join(map(str, never))}: batch.schedule asks for {them} after max_tokens={max_tokens:,})"
    return text


def run_header(run: Run, run_name: str, accelerator: str, output_dir: str | os.PathLike) -> str:
    """The line a run starts with: its model, processes, precision, batches and token budget.

    Args:
        run: the run's objects (``recipes/train.py``'s ``build_run``).
        run_name: the run's name.
        accelerator: the Trainer's accelerator, as configured.
        output_dir: the run's folder.

    Returns:
        The line.
    """
    dims, datamodule, warmup = run.model.dims, run.datamodule, run.batch_warmup
    max_tokens = warmup.max_tokens
    assert max_tokens is not None  # job.batch_warmup_of gives the run's BatchWarmup its max_tokens
    return (
        f"lit_cbs: {run_name}: model {dims.n_layers} layers x d_model {dims.d_model} "
        f"({run.model.num_parameters():,} parameters), {run.trainer.world_size} process(es) on {accelerator}, "
        f"precision {run.trainer.precision}, micro-batch {datamodule.batch_size} x {datamodule.seq_len} tokens, "
        f"global batch {batches_reached(warmup.schedule, max_tokens, datamodule.seq_len)}, "
        f"budget {max_tokens:,} tokens; output {output_dir}"
    )


def run_summary(trainer: pl.Trainer, warmup: BatchWarmup, run_name: str, fit_seconds: float) -> dict:
    """What the run did, as written to summary.json: tokens, optimizer steps, batch changes (global
    batches in samples), final val/loss (nats per token) and, with a CBS probe, its readings and what
    the probe branches cost (their tokens and optimizer steps, which the main run's step count does not
    include). Two wall times, in seconds: ``fit_seconds``, the whole ``trainer.fit`` call of this process
    (setup included: data, the model's build, the checkpoint's load); ``run_seconds``, the training over
    every fit of the run, each counted from its ``on_fit_start`` (after that setup), as the metrics'
    ``fit_seconds`` column. One fit: ``run_seconds`` is the smaller, by the setup.

    Args:
        trainer: the Trainer, after ``fit``.
        warmup: the run's BatchWarmup.
        run_name: the run's name.
        fit_seconds: wall time of this process's ``trainer.fit`` call (seconds).

    Returns:
        The summary, as written to summary.json.

    Raises:
        RuntimeError: ``warmup`` was not set up by a Trainer.
    """
    val_loss = trainer.callback_metrics.get(VAL_LOSS)
    accounting = warmup.accounting
    if accounting is None:
        raise RuntimeError(
            "run_summary: the BatchWarmup was not set up by a Trainer (no accounting); call it after fit"
        )
    stop_signal = accounting.stop_signal
    summary = {
        "run_name": run_name,
        "tokens": warmup.tokens_seen,
        "tokens_this_fit": warmup.tokens_seen - accounting.tokens_at_fit_start,
        "optimizer_steps": trainer.global_step,
        "first_batch": warmup.history[0].old_global_batch if warmup.history else warmup.global_batch,
        "final_batch": warmup.global_batch,
        # Trainer.datamodule is set by Lightning's data connector, undeclared in its class
        "seq_len": warmup.seq_len or trainer.datamodule.seq_len,  # type: ignore[attr-defined]
        "batch_changes": [
            {
                "step": c.step,
                "tokens": c.tokens_seen,
                "old": c.old_global_batch,
                "new": c.new_global_batch,
                "lr_factor": c.lr_factor,
                "micro_batch_size": c.new_micro_batch_size,
                "accumulate": c.new_accumulate,
            }
            for c in warmup.history
        ],
        "final_val_loss": float(val_loss) if val_loss is not None else None,
        "fit_seconds": fit_seconds,
        "run_seconds": accounting.fit_seconds,
        "stopped_by": signal.Signals(stop_signal).name if stop_signal else None,
        "probe": None,
    }
    callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector, undeclared
    probes = [callback for callback in callbacks if isinstance(callback, CBSProbeCallback)]
    if probes:
        history = probes[0].history
        status = probes[0].status()
        summary["probe"] = {
            "tokens": probes[0].tokens_spent,
            "optimizer_steps": sum(reading.branch_steps for reading in history),
            "readings": [
                {
                    "tokens": r.tokens,
                    "batch_size": r.batch_size,
                    "k_star": r.k_star,
                    "cbs_lower": r.cbs_lower,
                    "cbs_upper": r.cbs_upper,
                    "determined": r.determined,
                    "window_tokens": r.window_tokens,
                }
                for r in history
            ],
            # How the probe points fared: read (determined), failed with the reason, pending; and, beside a
            # CBSAdaptive schedule, its decisions and why it never acted where it did not.
            "points": {key: status[key] for key in ("read", "determined", "failed", "pending")},
            "adaptive": status.get("adaptive"),
            "side_jobs": status.get("side_jobs"),  # what the main run waited for its side jobs (seconds)
        }
    return summary


def summary_rows(summary: dict) -> list[tuple[str, str]]:
    """summary.json as (label, value) rows for people: the lines a run ends with, and report.html's table.

    Args:
        summary: ``run_summary``'s dict (summary.json).

    Returns:
        The rows: tokens, optimizer steps, batch changes, the CBS readings (with a probe), final val/loss,
        wall time, and what stopped a run a signal ended. ``summary_text`` has an example.
    """
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
    if resumed:
        whole = f"{summary['run_seconds']:,.1f} s over the whole run"
        wall += f"; {whole}, every fit it resumed from counted without its setup"
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
    probe = summary["probe"]
    if probe and probe["readings"]:
        readings = "; ".join(
            (f"[{r['cbs_lower']:g}, {r['cbs_upper']:g}]" if r["cbs_upper"] is not None else f">= {r['cbs_lower']:g}")
            + f" at {r['tokens']:,} tokens, "
            + ("determined" if r["determined"] else "undetermined")
            for r in probe["readings"]
        )
        share = probe["tokens"] / tokens
        cost = f"{probe['tokens']:,} tokens ({share:.0%} of training) in {probe['optimizer_steps']:,} optimizer steps"
        rows.insert(3, ("CBS (samples)", f"{readings}; probes trained {cost}"))
    points = probe.get("points") if probe else None
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
    waits = probe.get("side_jobs") if probe else None
    if waits:
        rows.insert(
            rows.index(next(row for row in rows if row[0] == "wall time")) + 1,
            (
                "side-job waits",
                f"{waits['checkpoint']:.1f} s writing {waits['checkpoints']} checkpoint(s), {waits['poll']:.1f} s in "
                f"{waits['polls']:,} looks for results, {waits['at_end']:.1f} s for the last readings at the end",
            ),
        )
    adaptive = probe.get("adaptive") if probe else None
    if adaptive and adaptive["why_not"]:
        rows.insert(0, ("CBSAdaptive", f"NEVER GREW THE BATCH: {adaptive['why_not']}"))
    return rows


def summary_text(summary: dict) -> str:
    """summary.json as the lines printed at the end of a run (``summary_rows``).

    Args:
        summary: ``run_summary``'s dict (summary.json).

    Returns:
        One line per row.

    Examples:
        >>> summary = {"tokens": 200_704, "tokens_this_fit": 200_704, "optimizer_steps": 130, "first_batch": 8,
        ...            "seq_len": 128, "final_val_loss": 4.1234, "fit_seconds": 20.0, "run_seconds": 18.0,
        ...            "stopped_by": None, "probe": None,
        ...            "batch_changes": [{"step": 64, "tokens": 65_536, "old": 8, "new": 16, "lr_factor": 1.4142,
        ...                               "micro_batch_size": 8, "accumulate": 2}]}
        >>> print(summary_text(summary))
        tokens           200,704 (10,035 tokens/s over this fit)
        optimizer steps  130 (34% fewer than at the starting batch 8)
        batch changes    8 -> 16 after step 64 (65,536 tokens, micro 8 x accumulate 2, LR x1.41)
        final val/loss   4.1234 nats per token
        wall time        20.0 s (trainer.fit, setup included)
    """
    return "\n".join(f"{label:<17}{value}" for label, value in summary_rows(summary))


def write_run_summary(
    output_dir: str | os.PathLike,
    run_name: str,
    trainer: pl.Trainer,
    warmup: BatchWarmup,
    fit_seconds: float,
    plots: bool,
) -> tuple[dict, str]:
    """Write into ``output_dir`` batch_history.json, summary.json and, with ``plots`` and a metrics.csv
    there, the plots (``plot_run``; also sent to the Trainer's loggers), which ``lit_cbs.recipes.report``'s
    report.html embeds; return the summary and the lines a run ends with: whether it finished,
    ``summary_text`` and where its outputs are.

    Args:
        output_dir: the run's folder.
        run_name: the run's name.
        trainer: the Trainer, after ``fit``.
        warmup: the run's BatchWarmup.
        fit_seconds: wall time of this process's ``trainer.fit`` call (seconds).
        plots: whether to draw the plots.

    Returns:
        The summary, and the lines a run ends with.

    Raises:
        RuntimeError: ``warmup`` was not set up by a Trainer.
    """
    output_dir = Path(output_dir)
    write_batch_history(output_dir / "batch_history.json", warmup)
    summary = run_summary(trainer, warmup, run_name, fit_seconds)
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    metrics_csv = output_dir / "metrics.csv"
    if plots and metrics_csv.is_file():
        log_figures(trainer.loggers, plot_run(metrics_csv, output_dir, title=run_name), trainer.global_step)
    ending = "stopped" if summary["stopped_by"] else "done"
    return summary, f"lit_cbs: {run_name} {ending}\n{summary_text(summary)}\noutputs          {output_dir}"
