"""A reading's record in a run: the metrics logged on the row of the step its window ended, the line it is said in,
``cbs_probe.jsonl`` (rewritten from the history, so a resumed run never writes a reading twice) and the curve."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info

from lit_cbs import metrics
from lit_cbs.callbacks.logs import log_figures, log_to_loggers
from lit_cbs.probe.reading import ProbeReading

__all__: list[str] = []  # the probe callback's own parts

JSONL_FILE = "cbs_probe.jsonl"
PLOT_FILE = "cbs_curve.png"


def log_reading(trainer: pl.Trainer, reading: ProbeReading, tokens_spent: int, log_step: int | None) -> None:
    """Log ``reading``'s metrics (at ``log_step``, default this step) and say it in one line; ``tokens_spent``: the
    branch tokens of every reading so far."""
    logged = {
        metrics.CBS_LOWER: float(reading.cbs_lower),
        metrics.CBS_ESTIMATE: float(reading.cbs_estimate),
        metrics.CBS_K_STAR: float(reading.k_star),
        metrics.CBS_DETERMINED: float(reading.determined),
        metrics.PROBE_OVERHEAD: float(reading.overhead),
        metrics.PROBE_TOKENS_SPENT: float(tokens_spent),
    }
    if reading.cbs_upper is not None:
        logged[metrics.CBS_UPPER] = float(reading.cbs_upper)
    base = min(reading.losses, key=float)
    base_loss = reading.losses[base]
    for k, loss in reading.losses.items():  # each branch's loss gap to the smallest k, and its standard error
        if k != base and loss is not None and base_loss is not None:
            logged[metrics.cbs_gap(k)] = float(loss - base_loss)
            gap_se = reading.loss_se.get(k)
            if gap_se is not None:
                logged[metrics.cbs_gap_se(k)] = float(gap_se)
    log_to_loggers(trainer, lambda _: logged, every_step=True, step=log_step)

    def gap(k: str) -> str:
        se = reading.loss_se.get(k)
        if se is None:
            return ""
        windows = reading.replicate_se.get(k)
        spread = f"; from the spread between data windows alone {windows:.4f}" if windows is not None else ""
        return f" (SE of the difference from k={base}: {se:.4f}{spread})"

    losses = ", ".join(
        f"k={k}: " + (f"{v:.4f}{gap(k)}" if v is not None else "failed") for k, v in reading.losses.items()
    )
    rank_zero_info(
        f"CBS probe at {reading.tokens:,} tokens (batch {reading.batch_size}): k*={reading.k_star:g}, "
        f"CBS in {reading.bracket} samples at {reading.confidence * 100:g}% confidence; {losses}; "
        f"{reading.tokens_spent:,} branch tokens"
        + (f" over {reading.replicates} data windows" if reading.replicates > 1 else "")
        + f"; probe overhead {reading.overhead:.2f}"
    )


def write_history(folder: Path, history: list[ProbeReading]) -> None:
    """Make ``folder``/cbs_probe.jsonl hold exactly ``history`` (none: no file)."""
    path = folder / JSONL_FILE
    if not history:
        path.unlink(missing_ok=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(dataclasses.asdict(reading)) + "\n" for reading in history))


def draw(
    trainer: pl.Trainer, history: list[ProbeReading], changes: list, folder: Path, tokens: int, epsilon: float
) -> None:
    """``folder``/cbs_curve.png of the readings so far, with the batch ``changes``, up to ``tokens``, sent to the
    loggers that take images."""
    from lit_cbs.analysis.plots import plot_cbs_curve  # matplotlib only where a curve is drawn

    path = plot_cbs_curve(history, changes, folder / PLOT_FILE, tokens, epsilon)
    log_figures(trainer.loggers, [path], trainer.global_step)
