"""One self-contained HTML page per run: ``python -m lit_cbs.recipes.report RUN_DIR`` (``recipes/train.py`` writes
it at the end of a run as ``report.html``).

The page holds, as PNGs embedded in the file (readable offline, nothing fetched): the loss against
tokens and against wall-clock seconds, the global batch and LR schedule, the CBS readings with their
brackets and error bars, the gradient noise scale, and tables of the run's summary, its batch
changes and its CBS readings. Everything is read from what the run wrote: ``metrics.csv``,
``summary.json``, ``batch_history.json`` and ``cbs_probe.jsonl`` (those it has), and the figures: the PNGs
the run drew into its folder (``lit_cbs.recipes.run_report.plot_run``, the probe's ``cbs_curve.png``) are
embedded as they are. One the folder lacks (a run with ``plots=false``, a plain Trainer's run), or one older
than the file it is drawn from (a run that went on after it was drawn), is drawn into the run folder first, so
each figure is drawn once. A small script marks the page once every figure has loaded
(``data-figures-loaded``), so a headless browser can check it.
"""

from __future__ import annotations

import argparse
import base64
import functools
import html
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lit_cbs.analysis.curves import METRICS_FILE, tokens_at
from lit_cbs.callbacks.batch_change import BatchChange
from lit_cbs.metrics import FIT_SECONDS
from lit_cbs.metrics import GNS_B_SIMPLE as GNS_COLUMN
from lit_cbs.metrics import TOKENS_SEEN as TOKENS_COLUMN
from lit_cbs.metrics import TRAIN_LOSS as LOSS_COLUMN
from lit_cbs.metrics import VAL_LOSS as VAL_LOSS_COLUMN
from lit_cbs.probe.reading import read_readings
from lit_cbs.probe.record import JSONL_FILE, PLOT_FILE
from lit_cbs.recipes.run_report import RUN_FIGURES, read_batch_history, read_run_metrics, summary_rows

__all__ = [
    "main",
    "write_report",
]

REPORT_FILE = "report.html"
WALL_CLOCK_FILE = "wall_clock.png"  # the page's own figure: the run draws none against wall-clock time

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


def _table(rows: list[list] | list[tuple], header: list[str] | None = None) -> str:
    cells = "".join(f"<th>{html.escape(str(name))}</th>" for name in header) if header else ""
    lines = "".join("<tr>" + "".join(f"<td>{html.escape(str(value))}</td>" for value in row) + "</tr>" for row in rows)
    return f"<table>{f'<tr>{cells}</tr>' if cells else ''}{lines}</table>"


def _figure(path: Path, caption: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return (
        f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,{data}">'
        f"<figcaption>{html.escape(caption)}</figcaption></figure>"
    )


def wall_clock_figure(metrics: dict):
    """The loss (nats per token) against wall-clock seconds of training, and the noise scale (samples) against
    tokens, as a matplotlib ``Figure``; None where the CSV has no seconds or none of those metrics.

    Args:
        metrics: a CSVLogger's metrics as ``read_run_metrics`` gives them: column -> (steps, values).

    Returns:
        The figure (one panel, and a second for the noise scale where it was logged), or None.

    Examples:
        >>> import numpy as np
        >>> wall_clock_figure({"train/loss": (np.array([0, 1]), np.array([5.5, 5.25]))}) is None  # no seconds
        True
    """
    from matplotlib.figure import Figure

    if FIT_SECONDS not in metrics or not any(name in metrics for name in (LOSS_COLUMN, VAL_LOSS_COLUMN, GNS_COLUMN)):
        return None
    seconds = dict(zip(*(column.tolist() for column in metrics[FIT_SECONDS])))
    panels = [name for name in (GNS_COLUMN,) if name in metrics and TOKENS_COLUMN in metrics]
    figure = Figure(figsize=(7, 3.6 * (1 + len(panels))))
    axes = figure.subplots(1 + len(panels), 1, squeeze=False)[:, 0]
    for name, style in ((LOSS_COLUMN, dict(lw=0.8, alpha=0.6)), (VAL_LOSS_COLUMN, dict(marker="o", lw=1.5))):
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


def _probe_epsilon(run_dir: Path) -> float | None:
    """The probe's epsilon (nats) from a recipe run's saved configuration, for the plot's tolerance line."""
    from lit_cbs.analysis.probe_schedule import run_config_value

    found = run_config_value(run_dir, "callbacks.cbs_probe.epsilon")
    return float(found[0]) if found is not None and found[0] is not None else None


def _current(path: Path, source: Path) -> bool:
    """Whether the PNG at ``path`` shows ``source`` as it is now: it exists and is not older."""
    return path.is_file() and path.stat().st_mtime_ns >= source.stat().st_mtime_ns


def _save(figure, path: Path) -> Path | None:
    from lit_cbs.analysis.plots import save_figure  # matplotlib only where a figure is drawn

    return save_figure(figure, path) if figure is not None else None


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the run's HTML page (default ``RUN_DIR/report.html``) and return its path. Figures the run folder
    lacks, or holds older than the file they are drawn from, are drawn into it first.

    Args:
        run_dir: the run's folder (``recipes/train.py``'s, or any with a CSVLogger's ``metrics.csv``).
        out: where to write the page; default ``run_dir/report.html``.

    Returns:
        The page's path.

    Raises:
        ValueError: ``run_dir`` has no ``metrics.csv`` (not a run folder, or one logged without the CSV logger),
            or one without ``tokens_seen``.

    Examples:
        A run folder with a two-step ``metrics.csv``: its loss figure is drawn into it, then embedded:

        >>> import tempfile
        >>> from pathlib import Path
        >>> folder = tempfile.TemporaryDirectory()
        >>> run = Path(folder.name)
        >>> _ = (run / "metrics.csv").write_text("step,tokens_seen,train/loss\\n0,512,5.5\\n1,1024,5.25\\n")
        >>> write_report(run).name
        'report.html'
        >>> sorted(path.name for path in run.iterdir())
        ['loss_vs_tokens.png', 'metrics.csv', 'report.html']
        >>> write_report(run / "elsewhere")
        Traceback (most recent call last):
        ...
        ValueError: '.../elsewhere' has no metrics.csv: give the folder of a run logged with the CSV logger
        >>> folder.cleanup()
    """
    run_dir = Path(run_dir)
    metrics_csv = run_dir / METRICS_FILE
    if not metrics_csv.is_file():
        raise ValueError(f"{str(run_dir)!r} has no {METRICS_FILE}: give the folder of a run logged with the CSV logger")
    metrics = read_run_metrics(metrics_csv)
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    history = read_batch_history(run_dir / "batch_history.json") if (run_dir / "batch_history.json").is_file() else {}
    changes = [BatchChange(**change) for change in history.get("changes", [])]
    probe_file = next(iter(sorted(run_dir.rglob(JSONL_FILE))), None)
    readings = read_readings(probe_file) if probe_file is not None else []
    title = f"lit_cbs run: {summary.get('run_name', run_dir.name)}"
    noise = "; the gradient noise scale against tokens" if GNS_COLUMN in metrics else ""
    draw: dict[str, Callable[[dict], Any]] = {
        name: functools.partial(figure, title=summary.get("run_name", "")) for name, figure in RUN_FIGURES.items()
    }
    draw[WALL_CLOCK_FILE] = wall_clock_figure
    captions = {
        "loss_vs_tokens.png": "Loss against tokens (dotted: batch changes)",
        WALL_CLOCK_FILE: f"Loss against wall-clock seconds{noise}",
        "batch_lr_vs_tokens.png": "Global batch and LR against tokens",
        "gns_groups_vs_tokens.png": "Noise scale per group of parameters",
    }
    figures = []
    for name, caption in captions.items():
        path = run_dir / name
        if _current(path, metrics_csv) or _save(draw[name](metrics), path) is not None:
            figures.append((path, caption))
    if readings and probe_file is not None:  # readings come from the probe file
        curve = probe_file.parent / PLOT_FILE
        if not _current(curve, probe_file):
            from lit_cbs.analysis.plots import plot_cbs_curve  # matplotlib only where a figure is drawn

            plot_cbs_curve(readings, changes, curve, summary.get("tokens"), _probe_epsilon(run_dir))
        figures.append(
            (curve, "CBS readings: brackets [k* B, next k B] (hollow: undetermined), and the loss gaps with error bars")
        )
    parts = [_figure(path, caption) for path, caption in figures]
    if summary:
        parts.insert(0, "<h2>Summary</h2>" + _table(summary_rows(summary)))
    if changes:
        parts.append(
            "<h2>Batch changes</h2>"
            + _table(
                [
                    [
                        c.step,
                        f"{c.tokens_seen:,}",
                        f"{c.old_global_batch} -> {c.new_global_batch}",
                        f"{c.new_micro_batch_size} x {c.new_accumulate}",
                        f"{c.lr_factor:.4g}",
                        c.cause,
                    ]
                    for c in changes
                ],
                ["after step", "tokens", "global batch", "micro x accumulate", "LR x", "cause"],
            )
        )
    if readings:
        parts.append(
            "<h2>CBS readings</h2>"
            + _table(
                [
                    [
                        f"{r.tokens:,}",
                        r.batch_size,
                        f"{r.k_star:g}",
                        f"[{r.cbs_lower:g}, {'open' if r.cbs_upper is None else f'{r.cbs_upper:g}'}]",
                        "yes" if r.determined else "no",
                    ]
                    for r in readings
                ],
                ["tokens", "batch", "k*", "CBS (samples)", "determined"],
            )
        )
    page = PAGE.format(
        title=html.escape(title), count=sum(part.startswith("<figure") for part in parts), body="\n".join(parts)
    )
    out = Path(out) if out is not None else run_dir / REPORT_FILE
    out.write_text(page)
    return out


def main(argv: list[str] | None = None) -> Path:
    """``python -m lit_cbs.recipes.report RUN_DIR [--out PATH]``: ``write_report``, then print the page's path.

    Args:
        argv: the command line's arguments; default ``sys.argv[1:]``.

    Returns:
        The page's path.

    Raises:
        SystemExit: a bad command line, or a ``run_dir`` ``write_report`` refuses (argparse's exit status 2,
            with its message on stderr).

    Examples:
        A run folder with a two-step ``metrics.csv`` (as in ``write_report``):

        >>> import contextlib, io, tempfile
        >>> from pathlib import Path
        >>> folder = tempfile.TemporaryDirectory()
        >>> run = Path(folder.name)
        >>> _ = (run / "metrics.csv").write_text("step,tokens_seen,train/loss\\n0,512,5.5\\n1,1024,5.25\\n")
        >>> with contextlib.redirect_stdout(io.StringIO()) as printed:
        ...     page = main([str(run)])
        >>> printed.getvalue() == f"{run / 'report.html'}\\n", page.is_file()
        (True, True)
        >>> with contextlib.redirect_stderr(io.StringIO()) as message:  # argparse's refusal, on stderr
        ...     main([str(run / "elsewhere")])
        Traceback (most recent call last):
        ...
        SystemExit: 2
        >>> "has no metrics.csv" in message.getvalue()
        True
        >>> folder.cleanup()
    """
    parser = argparse.ArgumentParser(description="Write a run's self-contained HTML page (report.html).")
    parser.add_argument(
        "run_dir", type=Path, help="a run folder (recipes/train.py's, or any with a CSVLogger's metrics.csv)"
    )
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
