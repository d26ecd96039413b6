"""Loss curves of constant-batch runs read from their metrics CSVs, and the tokens E and steps S at which each
reaches a target loss (McCandlish et al. 2018, arXiv 1812.06162; Zhou et al. 2026, arXiv 2601.05034). S is E over
the run's constant tokens per step, so E / S is the run's global batch in tokens. numpy and scipy only."""

from __future__ import annotations

import csv
import math
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lit_cbs import metrics
from lit_cbs.rules.smoothing import ema

# The columns lit_cbs logs (BatchWarmup, CausalLM, GradientNoiseScale), named in lit_cbs.metrics, and Lightning's steps.
TOKENS_COLUMN = metrics.TOKENS_SEEN
STEP_COLUMN = metrics.STEP
LOSS_COLUMN = metrics.TRAIN_LOSS
VAL_LOSS_COLUMN = metrics.VAL_LOSS
LR_COLUMN = metrics.LR
BATCH_COLUMN = metrics.GLOBAL_BATCH
GNS_COLUMN = metrics.GNS_B_SIMPLE
METRICS_FILE = "metrics.csv"
# Tokens per step may vary this much (relative) between logged rows before a run counts as not constant-batch.
CONSTANT_BATCH_TOLERANCE = 0.01

PathLike = str | os.PathLike[str]


@dataclass
class RunCurve:
    """One constant-batch run's loss curve: ``steps``, ``tokens`` (all ranks) and the unsmoothed ``loss`` per logged
    point; ``batch_size`` in samples if logged; ``gns_tokens``, ``gns``: where B_simple (samples) was logged."""

    name: str
    path: Path
    steps: np.ndarray
    tokens: np.ndarray
    loss: np.ndarray
    tokens_per_step: float
    batch_size: int | None = None
    gns_tokens: np.ndarray = field(default_factory=lambda: np.empty(0))
    gns: np.ndarray = field(default_factory=lambda: np.empty(0))

    @property
    def tokens_per_sample(self) -> float | None:
        """Tokens per sample (the sequence length), if the batch column is logged."""
        return None if self.batch_size is None else self.tokens_per_step / self.batch_size


@dataclass(frozen=True)
class Crossing:
    """Where one run's smoothed loss first reaches ``target`` (interpolated linearly between logged points)."""

    run: str
    target: float
    steps: float
    tokens: float
    tokens_per_step: float
    batch_size: int | None


def read_metrics_csv(path: PathLike, step_column: str = STEP_COLUMN) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each metric of a ``CSVLogger`` file as (steps, values), in file order, empty cells skipped and ``epoch`` left
    out; each value is paired with its own row's step. Raises ValueError for a missing or non-numeric step."""
    series: dict[str, tuple[list[float], list[float]]] = {}
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if step_column not in (reader.fieldnames or []):
            raise ValueError(
                f"{path} has no {step_column!r} column (columns: {reader.fieldnames}); is it a CSVLogger metrics file?"
            )
        for row in reader:
            cells = {name: cell for name, cell in row.items() if name not in (step_column, "epoch") and cell}
            if not cells:
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


def tokens_at(metrics: dict[str, tuple[np.ndarray, np.ndarray]], steps: np.ndarray) -> np.ndarray:
    """Tokens seen at ``steps``, interpolated from ``read_metrics_csv``'s logged ``tokens_seen`` (exact at logged
    steps)."""
    logged_steps, tokens = metrics[TOKENS_COLUMN]
    interpolated: np.ndarray = np.interp(steps, logged_steps, tokens)
    return interpolated


def _natural_key(path: Path) -> tuple[int, int, str]:
    head = path.name.split("_", 1)[0]
    return (0, int(head), path.name) if head.isdigit() else (1, 0, path.name)


def _metrics_file(run: PathLike, metrics_file: str = METRICS_FILE) -> Path:
    """The one metrics CSV of a run: ``run`` itself if it is a file, else the only ``metrics_file`` under it."""
    run = Path(run)
    if run.is_file():
        return run
    if not run.is_dir():
        raise ValueError(f"run folder {run} does not exist")
    found = sorted(run.rglob(metrics_file))
    if not found:
        raise ValueError(
            f"run folder {run} holds no {metrics_file}; pass metrics_file=... if the logger names it otherwise"
        )
    if len(found) > 1:
        listed = ", ".join(str(p.relative_to(run)) for p in found)
        raise ValueError(
            f"run folder {run} holds {len(found)} {metrics_file} files ({listed}); pass each run's own folder or CSV"
        )
    return found[0]


def _hydra_overrides(folder: Path) -> list[str]:
    overrides = folder / ".hydra" / "overrides.yaml"
    if not overrides.is_file():
        return []
    import yaml

    return [str(item) for item in yaml.safe_load(overrides.read_text()) or []]


def _run_label(folder: Path, common: Sequence[str] = ()) -> str:
    own = [item for item in _hydra_overrides(folder) if item not in common and item not in folder.name]
    return f"{folder.name} ({' '.join(own)})" if own else folder.name


def read_run(
    run: PathLike,
    *,
    name: str | None = None,
    loss_column: str = LOSS_COLUMN,
    tokens_column: str = TOKENS_COLUMN,
    step_column: str = STEP_COLUMN,
    batch_column: str = BATCH_COLUMN,
    gns_column: str = GNS_COLUMN,
    metrics_file: str = METRICS_FILE,
) -> RunCurve:
    """One constant-batch run's loss curve, sorted by tokens, from its folder (holding one ``metrics_file``) or its
    CSV; ``name`` defaults to the folder's name with its Hydra overrides. Loss rows without a token count (e.g.
    ``val/loss``) get their step's tokens from the constant tokens per step; a NaN loss ends the curve (warned).
    Raises ValueError for a missing column, a token count that is NaN or decreases, fewer than two rows logging
    tokens, or tokens per step (or the batch column) changing during the run."""
    csv_path = _metrics_file(run, metrics_file)
    run_path = Path(run)
    name = name or _run_label(run_path.parent if run_path.is_file() else run_path)
    series = read_metrics_csv(csv_path, step_column)
    for column, argument in ((tokens_column, "tokens_column"), (loss_column, "loss_column")):
        if column not in series:
            raise ValueError(
                f"run {name}: {csv_path} has no {column!r} column (columns logged: {sorted(series)}); "
                f"pass {argument}=..."
            )

    token_steps, token_counts = series[tokens_column]
    if not np.all(np.isfinite(token_counts)):
        i = np.nonzero(~np.isfinite(token_counts))[0][0]
        raise ValueError(
            f"run {name}: {tokens_column}={token_counts[i]:g} at {step_column}={token_steps[i]:g} in {csv_path}; "
            "token counts must be finite"
        )
    decreasing = np.nonzero(np.diff(token_counts) < 0)[0]
    if decreasing.size:
        i = decreasing[0]
        raise ValueError(
            f"run {name}: {tokens_column} decreases from {token_counts[i]:g} to {token_counts[i + 1]:g} "
            f"at {step_column} {token_steps[i + 1]:g} in {csv_path} (a restarted run appending to the same CSV?); "
            "give each run its own folder"
        )
    if len(np.unique(token_steps)) < 2:
        raise ValueError(
            f"run {name}: {tokens_column} is logged at fewer than 2 steps in {csv_path}; "
            "the tokens per step are unknown"
        )
    if np.any(np.diff(token_steps) < 0):
        raise ValueError(f"run {name}: {step_column} decreases in {csv_path}; give each run its own folder")
    tokens_per_step = (token_counts[-1] - token_counts[0]) / (token_steps[-1] - token_steps[0])
    advancing = np.diff(token_steps) > 0
    per_row = np.diff(token_counts)[advancing] / np.diff(token_steps)[advancing]
    if tokens_per_step <= 0 or np.any(np.abs(per_row / tokens_per_step - 1) > CONSTANT_BATCH_TOLERANCE):
        raise ValueError(
            f"run {name} is not a constant-batch run: tokens per step range from {per_row.min():g} "
            f"to {per_row.max():g}; E(S) fits need runs at one global batch"
        )
    tokens_at_step_zero = float(np.median(token_counts - tokens_per_step * token_steps))
    logged_tokens = dict(zip(token_steps.tolist(), token_counts.tolist()))

    def tokens_of(step: float) -> float:
        """The tokens logged at ``step``; else (e.g. a ``val/loss`` step) from the constant tokens per step."""
        return float(logged_tokens.get(step, tokens_at_step_zero + tokens_per_step * step))

    loss_tokens, losses = [], []
    for step, loss in zip(*series[loss_column]):
        if not math.isfinite(loss):
            warnings.warn(f"run {name}: {loss_column} is {loss} from {step_column} {step:g} on; its curve ends there")
            break
        loss_tokens.append(tokens_of(step))
        losses.append(loss)
    if not losses:
        raise ValueError(f"run {name}: {csv_path} logs no finite {loss_column} values")
    order = np.argsort(loss_tokens, kind="stable")
    tokens = np.asarray(loss_tokens)[order]

    batch_size = None
    if batch_column in series:
        sizes = sorted(set(series[batch_column][1].tolist()))
        if len(sizes) > 1:
            raise ValueError(
                f"run {name} is not a constant-batch run: {batch_column} takes the values {sizes}; "
                "E(S) fits need runs at one global batch"
            )
        batch_size = int(sizes[0])

    gns_tokens, gns = [], []
    for step, value in zip(*series.get(gns_column, ((), ()))):
        if math.isfinite(value):
            gns_tokens.append(tokens_of(step))
            gns.append(value)
    steps, loss = tokens / tokens_per_step, np.asarray(losses)[order]
    gns_at, gns_values = np.asarray(gns_tokens), np.asarray(gns)
    return RunCurve(name, csv_path, steps, tokens, loss, float(tokens_per_step), batch_size, gns_at, gns_values)


def read_sweep(
    source: PathLike | Sequence[PathLike], metrics_file: str = METRICS_FILE, **columns: str
) -> list[RunCurve]:
    """Every run of a sweep (a Hydra multirun folder, or the runs' folders or CSVs) in job order, labelled by the
    overrides that differ between them; ``columns`` go to ``read_run``. Raises ValueError for no run, or runs that
    disagree on tokens per sample.

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> sweep = tempfile.TemporaryDirectory()
        >>> for job, batch in enumerate((8, 16)):  # a Hydra multirun: one numbered folder per job, as CSVLogger logs
        ...     rows = ["step,tokens_seen,train/loss,batch/global_size"]
        ...     rows += [f"{step},{(step + 1) * batch * 128},{4 - step * batch / 64},{batch}" for step in range(4)]
        ...     Path(sweep.name, str(job)).mkdir()
        ...     _ = Path(sweep.name, str(job), "metrics.csv").write_text(chr(10).join(rows))
        >>> [(run.name, run.batch_size, run.tokens_per_step, run.loss.tolist()) for run in read_sweep(sweep.name)]
        [('0', 8, 1024.0, [4.0, 3.875, 3.75, 3.625]), ('1', 16, 2048.0, [4.0, 3.75, 3.5, 3.25])]
        >>> sweep.cleanup()
    """
    if isinstance(source, (str, os.PathLike)):
        folder = Path(source)
        if not folder.is_dir():
            raise ValueError(f"sweep folder {folder} does not exist")
        run_paths = sorted(
            (p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".") and any(p.rglob(metrics_file))),
            key=_natural_key,
        )
        if not run_paths:
            raise ValueError(f"sweep folder {folder} has no subfolders holding a {metrics_file}")
    else:
        run_paths = [Path(p) for p in source]
        if not run_paths:
            raise ValueError("no runs given")
    # Label runs by the overrides that differ between them (e.g. the batch size), not the shared ones.
    overrides = [set(_hydra_overrides(p if p.is_dir() else p.parent)) for p in run_paths]
    common = set.intersection(*overrides) if len(run_paths) > 1 else set()
    names = [_run_label(p if p.is_dir() else p.parent, sorted(common)) for p in run_paths]
    runs = [read_run(p, name=name, metrics_file=metrics_file, **columns) for p, name in zip(run_paths, names)]
    check_units(runs)
    return runs


def check_units(runs: Sequence[RunCurve]) -> float | None:
    """The sweep's tokens per sample (sequence length), None if no run logs its batch in samples. Raises ValueError
    where runs differ in it (tokens and samples counted inconsistently)."""
    known = {run.name: run.tokens_per_sample for run in runs if run.tokens_per_sample is not None}
    if not known:
        return None
    values = list(known.values())
    if max(values) > min(values) * (1 + CONSTANT_BATCH_TOLERANCE):
        listed = ", ".join(f"{name}: {value:g}" for name, value in known.items())
        raise ValueError(
            "mismatched units: tokens per sample (tokens per step / global batch in samples) differ between runs "
            f"({listed}); every run must count tokens in tokens and its batch in samples of the same sequence length"
        )
    missing = [run.name for run in runs if run.tokens_per_sample is None]
    if missing:
        warnings.warn(
            f"runs {missing} log no global batch in samples; assuming {values[0]:g} tokens per sample like the others"
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
    means: np.ndarray = (cumulative[hi] - cumulative[lo]) / (hi - lo)
    return means


def smooth(values: np.ndarray, method: str | None = "rolling", window: int = 9, decay: float = 0.9) -> np.ndarray:
    """``values`` smoothed by ``method``: "rolling" (``rolling_mean`` over ``window``), "ema" (with ``decay``) or
    None (as floats)."""
    if method == "rolling":
        return rolling_mean(values, window)
    if method == "ema":
        return ema(values, decay)
    if method is None:
        return np.asarray(values, dtype=float)
    raise ValueError(f"smoothing method={method!r} is not supported; use 'rolling', 'ema' or None")


def find_crossings(
    runs: Sequence[RunCurve],
    targets: Sequence[float],
    *,
    smoothing: str | None = "rolling",
    window: int = 9,
    decay: float = 0.9,
) -> dict[float, list[Crossing]]:
    """For each target loss (nats), where each run's loss, smoothed as ``smooth`` does, first reaches it. Runs that
    never reach a target, or start below it (where it was crossed is unknown), are left out of it, warned by name.

    Example:
        >>> import numpy as np
        >>> from pathlib import Path
        >>> from lit_cbs.analysis.curves import RunCurve
        >>> tokens = np.array([1024.0, 2048, 3072, 4096])
        >>> run = RunCurve("b8", Path("metrics.csv"), tokens / 1024, tokens, np.array([4.0, 3, 2, 1]), 1024.0, 8)
        >>> [(float(c.steps), c.tokens) for c in find_crossings([run], [2.5], smoothing=None)[2.5]]
        [(2.5, 2560.0)]
    """
    result: dict[float, list[Crossing]] = {float(t): [] for t in targets}
    never: dict[float, list[str]] = {float(t): [] for t in targets}
    for run in runs:
        smoothed = smooth(run.loss, smoothing, window=window, decay=decay)
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
            result[target].append(
                Crossing(
                    run.name, target, tokens / run.tokens_per_step, float(tokens), run.tokens_per_step, run.batch_size
                )
            )
    for target, names in never.items():
        if not names:
            continue
        if len(names) == len(runs):
            warnings.warn(f"target loss {target:g}: no run reaches it: {'; '.join(names)}")
        else:
            warnings.warn(f"target loss {target:g}: left out runs that never reach it: {'; '.join(names)}")
    return result


def default_targets(
    runs: Sequence[RunCurve],
    count: int = 6,
    min_runs: int = 8,
    *,
    smoothing: str | None = "rolling",
    window: int = 9,
    decay: float = 0.9,
) -> list[float]:
    """``count`` target losses, highest first, evenly spaced from below the highest loss every run starts at down to
    the lowest loss ``min_runs`` runs (or all) reach; ``smoothing``, ``window``, ``decay``: as for ``smooth``.
    Raises ValueError for no runs, or curves that leave no range.

    Example:
        >>> import numpy as np
        >>> from pathlib import Path
        >>> from lit_cbs.analysis.curves import RunCurve
        >>> tokens = np.array([1024.0, 2048, 3072, 4096])
        >>> run = RunCurve("b8", Path("metrics.csv"), tokens / 1024, tokens, np.array([4.0, 3, 2, 1]), 1024.0, 8)
        >>> default_targets([run], count=3, smoothing=None)
        [3.0, 2.0, 1.0]
    """
    if not runs:
        raise ValueError("no runs to pick target losses from")
    curves = [smooth(run.loss, smoothing, window=window, decay=decay) for run in runs]
    start = min(curve[0] for curve in curves)
    lowest_reached = sorted(curve.min() for curve in curves)[min(min_runs, len(runs)) - 1]
    if not lowest_reached < start:
        raise ValueError(
            f"the runs' smoothed losses give no target range: {min(min_runs, len(runs))} runs reach at best "
            f"{lowest_reached:.4g} but some run starts at {start:.4g}; pass targets explicitly"
        )
    return [float(t) for t in np.linspace(start, lowest_reached, count + 1)[1:]]
