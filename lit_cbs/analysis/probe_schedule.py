"""A batch-size warmup schedule read off a measured CBS curve (Merrill et al. 2025)."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from lit_cbs.probe.reading import ProbeReading, read_readings
from lit_cbs.rules.batch_schedules import PiecewiseBatch

PathLike = str | os.PathLike[str]
# What a recipe run saves beside cbs_probe.jsonl: train.py's resolved copy first, then Hydra's (resolved on reading).
RUN_CONFIGS = ("resolved_config.yaml", ".hydra/config.yaml")


def run_config_value(run_dir: PathLike, key: str) -> tuple[Any, Path] | None:
    """(value, file) of the dotted ``key`` in the configuration the recipe run in ``run_dir`` saved (``RUN_CONFIGS``
    in order); None where no file holds it or it cannot be resolved there."""
    from omegaconf import OmegaConf
    from omegaconf.errors import InterpolationResolutionError

    absent = object()
    for path in (Path(run_dir) / name for name in RUN_CONFIGS if (Path(run_dir) / name).is_file()):
        try:
            if (value := OmegaConf.select(OmegaConf.load(path), key, default=absent)) is not absent:
                return value, path
        except InterpolationResolutionError:  # .hydra/config.yaml alone lacks train.py's resolvers
            continue
    return None


def _number(reading: ProbeReading, key: str, where: str) -> float:
    value = getattr(reading, key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(
            f"{where}: {key}={value!r} is not a number >= 0; every determined probe reading needs {key} "
            f"({'tokens seen at the probe' if key == 'tokens' else 'the CBS lower bound, samples'})"
        )
    return float(value)


def _check_count(name: str, value: object, minimum: int, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum} ({meaning})")


def check_growth(start: int, factor: int, margin: float) -> None:
    """Raise ValueError unless ``start`` >= 1 and ``factor`` >= 2 are ints and ``margin`` a number >= 1."""
    _check_count("start", start, 1, "the first global batch, samples")
    _check_count("factor", factor, 2, "the ratio between consecutive batch sizes; BatchWarmup needs a whole ratio")
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin >= 1:
        raise ValueError(
            f"margin={margin!r} must be a number >= 1 (move to batch B only where the CBS lower bound >= margin x B)"
        )


def grow_batch(
    bounds: Iterable[float], start: int, factor: int, final: int | None, margin: float
) -> list[tuple[int, int]]:
    """(index, batch) where the batch grows along ``bounds`` (CBS lower bounds, samples): from ``start`` the largest
    ``start x factor**n`` (at most ``final``) with ``margin x batch`` at or below the bound, never decreasing."""
    changes = [(-1, start)]
    for index, bound in enumerate(bounds):
        grown = changes[-1][1]
        while margin * grown * factor <= bound and (final is None or grown * factor <= final):
            grown *= factor
        if grown > changes[-1][1]:
            changes.append((index, grown))
    return changes[1:]


def schedule_from_probe(
    source: PathLike | Sequence[ProbeReading],
    start: int,
    *,
    factor: int = 2,
    final: int | None = None,
    margin: float = 1.0,
    seq_len: int | None = None,
    measured_seq_len: int | None = None,
) -> PiecewiseBatch:
    """A token-indexed ``PiecewiseBatch`` following a measured CBS curve: at t tokens the largest ``start x factor**n``
    samples (at most ``final``) with ``margin x batch`` at or below the CBS lower bound of the latest reading at or
    before t, never decreasing.

    Args:
        source: a ``cbs_probe.jsonl`` path or its readings, of one or several runs (at one token count the smallest
            lower bound counts); undetermined readings are skipped.
        seq_len: the target run's tokens per sample; lower bounds convert through tokens (None: the measured run's).
        measured_seq_len: the measured run's, where ``seq_len`` is given and the readings lack theirs.

    Examples:
        >>> from lit_cbs.probe.reading import BranchScore, ProbeReading
        >>> where = dict(step=0, seq_len=1024, window_tokens=10**6, search="grid", evaluate="train_ema", main_loss=3.0,
        ...              branches_trained=[2, 4], failed=[], tokens_spent=0, overhead=0.0)
        >>> def reading(tokens, loss_at_2, loss_at_4):  # k = 1, 2, 4 of B = 32 samples
        ...     scores = {1: BranchScore(3.0), 2: BranchScore(loss_at_2), 4: BranchScore(loss_at_4)}
        ...     return ProbeReading.decide(scores, 0.01, 0.5, [1, 2, 4], 32, tokens=tokens, **where)
        >>> readings = [reading(10**8, 3.1, 3.1), reading(4 * 10**8, 3.0, 3.1), reading(8 * 10**8, 3.0, 3.0)]
        >>> schedule = schedule_from_probe(readings, start=32, final=128)  # CBS lower bounds 32, 64, 128
        >>> schedule.batch_sizes, schedule.thresholds
        ([32, 64, 128], [0, 400000000, 800000000])
    """
    check_growth(start, factor, margin)
    if final is not None:
        _check_count("final", final, start, f"the largest global batch, samples, at least start={start}")
        doublings = math.log(final / start, factor)
        if abs(doublings - round(doublings)) > 1e-9:
            low, high = start * factor ** math.floor(doublings), start * factor ** math.ceil(doublings)
            raise ValueError(
                f"final={final} must be start={start} times a power of factor={factor}; nearest: {low} or {high}"
            )
    for name, value in (("seq_len", seq_len), ("measured_seq_len", measured_seq_len)):
        if value is not None:
            _check_count(name, value, 1, "tokens per sample")

    if isinstance(source, (str, os.PathLike)):
        name, readings = str(source), read_readings(source)
    else:
        name, readings = "probe readings", list(source)
        if not readings:
            raise ValueError("source holds no CBS probe reading; pass a cbs_probe.jsonl path or its readings")

    lowest_at: dict[float, float] = {}  # tokens -> smallest CBS lower bound read there, target samples
    for index, reading in enumerate(readings):
        where = f"{name}[{index}]"
        if not isinstance(reading, ProbeReading):
            raise ValueError(f"{where}: {reading!r} is not a ProbeReading; read a cbs_probe.jsonl with read_readings")
        if not reading.determined:
            continue
        tokens, lower = _number(reading, "tokens", where), _number(reading, "cbs_lower", where)
        if None not in (read_at := reading.seq_len, measured_seq_len) and read_at != measured_seq_len:
            raise ValueError(
                f"{where}: seq_len={read_at} but measured_seq_len={measured_seq_len}; drop measured_seq_len or fix it"
            )
        measured = read_at if read_at is not None else measured_seq_len
        if seq_len is not None:
            if measured is None:
                raise ValueError(
                    f"seq_len={seq_len} needs the measured run's sequence length: pass measured_seq_len "
                    "(data.seq_len of the run that wrote the probe readings)"
                )
            lower = lower * measured / seq_len
        lowest_at[tokens] = min(lower, lowest_at.get(tokens, math.inf))
    if not any(reading.determined for reading in readings):
        warnings.warn(f"every reading in {name} is undetermined; the schedule stays at start={start}", stacklevel=2)

    at = sorted(lowest_at)
    changes = grow_batch((lowest_at[tokens] for tokens in at), start, factor, final, margin)
    batch_sizes, thresholds = [start] + [batch for _, batch in changes], [0] + [int(at[i]) for i, _ in changes]
    if len(thresholds) > 1 and thresholds[1] == 0:  # a reading at 0 tokens sets the first batch itself
        batch_sizes, thresholds = batch_sizes[1:], thresholds[1:]
    return PiecewiseBatch(batch_sizes, thresholds, unit="tokens")
