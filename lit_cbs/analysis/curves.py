"""Constant-batch runs' loss curves from their metrics CSVs; the tokens E and steps S at which each reaches a loss."""

from __future__ import annotations

import csv
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lit_cbs import metrics

METRICS_FILE = "metrics.csv"
_TOLERANCE = 0.01  # relative spread of tokens per step (or tokens per sample) within which a run is constant-batch

Series = dict[str, tuple[np.ndarray, np.ndarray]]  # metric -> (steps, values)
PathLike = str | os.PathLike[str]


@dataclass
class RunCurve:
    """One constant-batch run's unsmoothed loss per logged point, with its ``steps`` and ``tokens`` (all ranks);
    ``batch_size`` in samples; ``gns``: the noise scale B_simple (samples) at ``gns_tokens``."""

    name: str
    steps: np.ndarray
    tokens: np.ndarray
    loss: np.ndarray
    tokens_per_step: float
    batch_size: int
    gns_tokens: np.ndarray = field(default_factory=lambda: np.empty(0))
    gns: np.ndarray = field(default_factory=lambda: np.empty(0))

    @property
    def tokens_per_sample(self) -> float:
        return self.tokens_per_step / self.batch_size


@dataclass(frozen=True)
class Crossing:
    """Where one run's smoothed loss first reaches ``target`` (interpolated linearly between logged points)."""

    run: str
    target: float
    steps: float
    tokens: float
    tokens_per_step: float
    batch_size: int


def read_metrics_csv(path: PathLike) -> Series:
    """Each metric of a ``CSVLogger`` file as (steps, values) in file order, empty cells and ``epoch`` left out."""
    series: dict[str, tuple[list[float], list[float]]] = {}
    step_column = metrics.STEP
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if step_column not in (reader.fieldnames or []):
            raise ValueError(
                f"{path} has no {step_column!r} column (columns: {reader.fieldnames}); is it a CSVLogger metrics file?"
            )
        for row in reader:
            if not (cells := {name: cell for name, cell in row.items() if name not in (step_column, "epoch") and cell}):
                continue
            try:
                step = float(row[step_column])
            except (TypeError, ValueError):
                raise ValueError(
                    f"{path}: {step_column}={row[step_column]!r} in a row logging {sorted(cells)}; "
                    "steps must be numbers"
                ) from None
            for name, cell in cells.items():
                steps, values = series.setdefault(name, ([], []))
                steps.append(step)
                values.append(float(cell))
    return {name: (np.asarray(steps), np.asarray(values)) for name, (steps, values) in series.items()}


def tokens_at(series: Series, steps: np.ndarray) -> np.ndarray:
    """Tokens seen at ``steps``, interpolated from the logged ``tokens_seen`` (exact at logged steps)."""
    logged_steps, tokens = series[metrics.TOKENS_SEEN]
    return np.asarray(np.interp(steps, logged_steps, tokens))


def _metrics_file(run: Path, metrics_file: str) -> Path:
    """``run`` itself if it is a file, else the only ``metrics_file`` under it."""
    if run.is_file():
        return run
    if not run.is_dir():
        raise ValueError(f"run folder {run} does not exist")
    if not (found := sorted(run.rglob(metrics_file))):
        raise ValueError(
            f"run folder {run} holds no {metrics_file}; pass metrics_file=... if the logger names it otherwise"
        )
    if len(found) > 1:
        listed = ", ".join(str(p.relative_to(run)) for p in found)
        raise ValueError(
            f"run folder {run} holds {len(found)} {metrics_file} files ({listed}); pass each run's own folder or CSV"
        )
    return found[0]


def _hydra_overrides(run: Path) -> list[str]:
    import yaml

    overrides = (run if run.is_dir() else run.parent) / ".hydra" / "overrides.yaml"
    return [str(item) for item in yaml.safe_load(overrides.read_text()) or []] if overrides.is_file() else []


def _run_label(run: Path, common: Sequence[str] = ()) -> str:
    folder = run if run.is_dir() else run.parent
    own = [item for item in _hydra_overrides(run) if item not in common and item not in folder.name]
    return f"{folder.name} ({' '.join(own)})" if own else folder.name


def _not_constant(name: str, spread: str) -> ValueError:
    return ValueError(f"run {name} is not a constant-batch run: {spread}; E(S) fits need runs at one global batch")


def read_run(
    run: PathLike, *, name: str | None = None, loss_column: str = metrics.TRAIN_LOSS, metrics_file: str = METRICS_FILE
) -> RunCurve:
    """One constant-batch run's loss curve by tokens, from its folder or CSV (``name``: the folder's, with its Hydra
    overrides); a NaN loss ends it (warned). Raises ValueError naming the run for bad or non-constant counts."""
    csv_path = _metrics_file(Path(run), metrics_file)
    name = name or _run_label(Path(run))
    series = read_metrics_csv(csv_path)
    tokens_column, step_column, batch_column = metrics.TOKENS_SEEN, metrics.STEP, metrics.GLOBAL_BATCH
    for column in (loss_column, tokens_column, batch_column):
        if column not in series:
            raise ValueError(
                f"run {name}: {csv_path} has no {column!r} column (columns logged: {sorted(series)})"
                + ("; pass loss_column=..." if column == loss_column else "; add lit_cbs.BatchWarmup to the callbacks")
            )

    token_steps, token_counts = series[tokens_column]
    problem = ""
    if (nonfinite := np.nonzero(~np.isfinite(token_counts))[0]).size:
        i = nonfinite[0]
        problem = (
            f"{tokens_column}={token_counts[i]:g} at {step_column}={token_steps[i]:g}; token counts must be finite"
        )
    elif (decreasing := np.nonzero(np.diff(token_counts) < 0)[0]).size:
        i = decreasing[0]
        problem = (
            f"{tokens_column} decreases from {token_counts[i]:g} to {token_counts[i + 1]:g} at {step_column} "
            f"{token_steps[i + 1]:g} (a restarted run appending to the same CSV?); give each run its own folder"
        )
    elif len(np.unique(token_steps)) < 2:
        problem = f"{tokens_column} is logged at fewer than 2 steps; the tokens per step are unknown"
    elif np.any(np.diff(token_steps) < 0):
        problem = f"{step_column} decreases; give each run its own folder"
    if problem:
        raise ValueError(f"run {name}: {problem} ({csv_path})")
    tokens_per_step = (token_counts[-1] - token_counts[0]) / (token_steps[-1] - token_steps[0])
    advancing = np.diff(token_steps) > 0
    per_row = np.diff(token_counts)[advancing] / np.diff(token_steps)[advancing]
    if tokens_per_step <= 0 or np.any(np.abs(per_row / tokens_per_step - 1) > _TOLERANCE):
        raise _not_constant(name, f"tokens per step range from {per_row.min():g} to {per_row.max():g}")
    tokens_at_step_zero = float(np.median(token_counts - tokens_per_step * token_steps))
    logged_tokens = dict(zip(token_steps.tolist(), token_counts.tolist()))

    def tokens_of(step: float) -> float:
        return float(logged_tokens.get(step, tokens_at_step_zero + tokens_per_step * step))

    loss_steps, losses = series[loss_column]
    if (nan := np.nonzero(~np.isfinite(losses))[0]).size:
        i = nan[0]
        warnings.warn(
            f"run {name}: {loss_column} is {losses[i]} from {step_column} {loss_steps[i]:g} on; its curve ends there"
        )
        loss_steps, losses = loss_steps[:i], losses[:i]
    if not len(losses):
        raise ValueError(f"run {name}: {csv_path} logs no finite {loss_column} values")
    loss_tokens = [tokens_of(step) for step in loss_steps.tolist()]
    order = np.argsort(loss_tokens, kind="stable")
    tokens = np.asarray(loss_tokens)[order]

    sizes = sorted(set(series[batch_column][1].tolist()))
    if len(sizes) > 1:
        raise _not_constant(name, f"{batch_column} takes the values {sizes}")
    gns_steps, gns = series.get(metrics.GNS_B_SIMPLE, (np.empty(0), np.empty(0)))
    gns_steps, gns = gns_steps[np.isfinite(gns)], gns[np.isfinite(gns)]
    gns_tokens = np.asarray([tokens_of(step) for step in gns_steps.tolist()], dtype=float)
    steps, loss = tokens / tokens_per_step, losses[order]
    return RunCurve(name, steps, tokens, loss, float(tokens_per_step), int(sizes[0]), gns_tokens, gns)


def read_sweep(
    source: PathLike | Sequence[PathLike], metrics_file: str = METRICS_FILE, loss_column: str = metrics.TRAIN_LOSS
) -> list[RunCurve]:
    """Every run of a sweep (a Hydra multirun folder, or the runs' folders or CSVs) in job order, labelled by the
    overrides that differ between them. Raises ValueError for no run, or runs disagreeing on tokens per sample."""
    if isinstance(source, (str, os.PathLike)):
        folder = Path(source)
        if not folder.is_dir():
            raise ValueError(f"sweep folder {folder} does not exist")
        found = (
            p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".") and any(p.rglob(metrics_file))
        )
        key = lambda p: (0, int(h), p.name) if (h := p.name.split("_", 1)[0]).isdigit() else (1, 0, p.name)  # noqa: E731
        if not (run_paths := sorted(found, key=key)):
            raise ValueError(f"sweep folder {folder} has no subfolders holding a {metrics_file}")
    elif not (run_paths := [Path(p) for p in source]):
        raise ValueError("no runs given")
    overrides = [set(_hydra_overrides(p)) for p in run_paths]
    common = sorted(set.intersection(*overrides)) if len(run_paths) > 1 else []
    runs = [
        read_run(p, name=_run_label(p, common), metrics_file=metrics_file, loss_column=loss_column) for p in run_paths
    ]
    check_units(runs)
    return runs


def check_units(runs: Sequence[RunCurve]) -> float:
    """The sweep's tokens per sample; ValueError where runs differ in it (tokens or samples counted otherwise)."""
    known = {run.name: run.tokens_per_sample for run in runs}
    values = list(known.values())
    if max(values) > min(values) * (1 + _TOLERANCE):
        listed = ", ".join(f"{name}: {value:g}" for name, value in known.items())
        raise ValueError(
            "mismatched units: tokens per sample (tokens per step / global batch in samples) differ between runs "
            f"({listed}); every run must count tokens in tokens and its batch in samples of the same sequence length"
        )
    return float(np.mean(values))


def rolling_mean(values: np.ndarray, window: int) -> np.ndarray:
    """Centered mean over ``window`` (odd) logged points, over fewer at the ends: no lag on a linear trend."""
    if window < 1 or window % 2 == 0:
        raise ValueError(f"window={window} must be a positive odd number of logged points")
    values = np.asarray(values, dtype=float)
    half = window // 2
    cumulative = np.concatenate([[0.0], np.cumsum(values)])
    index = np.arange(len(values))
    lo, hi = np.maximum(index - half, 0), np.minimum(index + half + 1, len(values))
    return np.asarray((cumulative[hi] - cumulative[lo]) / (hi - lo))


def find_crossings(
    runs: Sequence[RunCurve], targets: Sequence[float], *, window: int | None = 9
) -> dict[float, list[Crossing]]:
    """For each target loss (nats), where each run's loss, smoothed over ``window`` logged points (None: not
    smoothed), first reaches it. Runs that never reach a target, or start below it, are left out of it, warned."""
    result: dict[float, list[Crossing]] = {float(t): [] for t in targets}
    never: dict[float, list[str]] = {float(t): [] for t in targets}
    for run in runs:
        smoothed = rolling_mean(run.loss, window) if window is not None else run.loss
        for target in result:
            reached = np.nonzero(smoothed <= target)[0]
            if not reached.size:
                never[target].append(f"{run.name} (lowest smoothed loss {smoothed.min():.4g})")
                continue
            i = int(reached[0])
            if i == 0:
                warnings.warn(
                    f"target loss {target:g}: run {run.name} is already at or below it at its first logged point, "
                    "so where it crossed is unknown; left out (log the loss from the start of training)"
                )
                continue
            fraction = (smoothed[i - 1] - target) / (smoothed[i - 1] - smoothed[i])
            tokens = run.tokens[i - 1] + fraction * (run.tokens[i] - run.tokens[i - 1])
            steps = tokens / run.tokens_per_step
            result[target].append(Crossing(run.name, target, steps, float(tokens), run.tokens_per_step, run.batch_size))
    for target, names in never.items():
        if names:
            which = "no run reaches it" if len(names) == len(runs) else "left out runs that never reach it"
            warnings.warn(f"target loss {target:g}: {which}: {'; '.join(names)}")
    return result


def default_targets(
    runs: Sequence[RunCurve], count: int = 6, min_runs: int = 8, *, window: int | None = 9
) -> list[float]:
    """``count`` target losses, highest first, evenly spaced from below the highest loss every run starts at down to
    the lowest loss ``min_runs`` runs (or all) reach, smoothed as ``find_crossings`` does."""
    if not runs:
        raise ValueError("no runs to pick target losses from")
    curves = [rolling_mean(run.loss, window) if window is not None else run.loss for run in runs]
    start = min(curve[0] for curve in curves)
    lowest_reached = sorted(curve.min() for curve in curves)[min(min_runs, len(runs)) - 1]
    if not lowest_reached < start:
        raise ValueError(
            f"the runs' smoothed losses give no target range: {min(min_runs, len(runs))} runs reach at best "
            f"{lowest_reached:.4g} but some run starts at {start:.4g}; pass targets explicitly"
        )
    return [float(t) for t in np.linspace(start, lowest_reached, count + 1)[1:]]
