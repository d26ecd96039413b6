"""A batch-size warmup schedule read off a measured CBS curve: measure on a small model, train a big one.

Merrill et al. 2025 (arXiv 2505.23971) found that OLMo 1B and 7B have nearly the same critical batch
size curve, so a curve measured cheaply on one model can set the warmup of another; they read the
thresholds off the curve by hand. ``schedule_from_probe`` does it from ``CBSProbeCallback``'s
``cbs_probe.jsonl``: the target batch doubles (by ``factor``) as soon as a reading's CBS lower bound
allows it, from the reading's token count on. Pure Python: no Lightning.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lit_cbs.probe.reading import ProbeReading, read_readings
from lit_cbs.rules.batch_schedules import PiecewiseBatch

__all__ = [
    "run_config_value",
    "schedule_from_probe",
]

PathLike = str | os.PathLike
# The configuration a recipe run saves in its folder, beside cbs_probe.jsonl: recipes/train.py's resolved
# copy first, then the one Hydra writes (its interpolations resolved on reading).
RUN_CONFIGS = ("resolved_config.yaml", ".hydra/config.yaml")


def run_config_value(run_dir: PathLike, key: str) -> tuple[Any, Path] | None:
    """The value of ``key`` (a dotted Hydra key, e.g. ``callbacks.cbs_probe.epsilon``) in the configuration
    the recipe run in ``run_dir`` saved (``RUN_CONFIGS``, in that order), and the file it came from; None
    where no such file holds the key or its value cannot be resolved there. A key set to null gives None
    as its value. For what a probe file's readings do not say (written by an earlier version), or what the
    run that wrote them trained with.

    Args:
        run_dir: the recipe run's folder.
        key: a dotted key of its configuration.

    Returns:
        ``(value, path of the file it came from)``, or None.

    Examples:
        >>> import tempfile
        >>> from pathlib import Path
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     _ = Path(folder, "resolved_config.yaml").write_text("callbacks: {cbs_probe: {epsilon: 0.01}}")
        ...     value, path = run_config_value(folder, "callbacks.cbs_probe.epsilon")
        ...     value, path.name, run_config_value(folder, "data.seq_len")
        (0.01, 'resolved_config.yaml', None)
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import InterpolationResolutionError

    absent = object()
    for name in RUN_CONFIGS:
        path = Path(run_dir) / name
        if not path.is_file():
            continue
        try:
            value = OmegaConf.select(OmegaConf.load(path), key, default=absent)
        except InterpolationResolutionError:  # .hydra/config.yaml alone lacks train.py's resolvers
            continue
        if value is not absent:
            return value, path
    return None


def _number(reading: ProbeReading, key: str, where: str) -> float:
    value = getattr(reading, key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(
            f"{where}: {key}={value!r} is not a number >= 0; every determined probe reading needs {key} "
            f"({'tokens seen at the probe' if key == 'tokens' else 'the CBS lower bound, samples'})"
        )
    return float(value)


def _check_count(name: str, value, minimum: int, meaning: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum} ({meaning})")
    return value


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
    """A token-indexed ``PiecewiseBatch`` that follows a measured CBS curve.

    At ``t`` tokens the global batch is the largest ``start x factor**n`` (samples) with
    ``margin x batch <= L``, where ``L`` is the CBS lower bound (``cbs_lower``) of the latest reading at
    or before ``t``; never below ``start`` nor above ``final``, and never decreasing: a reading that
    dips below an earlier one keeps the batch (a noisy dip is not a reason to shrink it). The batch
    changes at the token counts of the readings (``tokens``) that raise it.

    Args:
        source: a ``cbs_probe.jsonl`` path, or its readings (``read_readings``), in any order. Several runs'
            readings may be mixed (e.g. two seeds): readings at the same token count count by their smallest
            lower bound. Readings with ``determined`` false (the data could not decide k*) are skipped.
        start: the target run's first global batch (samples).
        factor: the ratio between consecutive batch sizes, an int >= 2 (BatchWarmup changes the batch
            by whole ratios).
        final: the largest global batch (samples), ``start x factor**n``; None: no cap.
        margin: a safety factor >= 1: the batch moves to B only where the lower bound is at least
            ``margin x B``. 1 follows the curve itself (Merrill et al. 2025 double once the CBS reaches
            the doubled batch); 2 switches one reading later on a curve that doubles between readings,
            at the price of more small-batch steps.
        seq_len: the target run's sequence length (tokens per sample). A reading's lower bound is in
            samples of the measured run's sequences; it is converted through tokens, so a CBS of 64
            samples of 128 tokens is 16 samples of 512. None: the same as the measured run's.
        measured_seq_len: the measured run's sequence length (tokens per sample), needed when
            ``seq_len`` is given and the readings do not carry ``seq_len``.

    Raises:
        ValueError: an empty or unreadable file, a reading without a number ``tokens`` or ``cbs_lower``,
            ``start < 1``, ``factor < 2``, ``final`` below ``start`` or off its ladder, ``margin < 1``,
            or a sequence length missing or not a positive int; the message names the field.

    Returns:
        The schedule: sizes in samples, thresholds in tokens.

    Examples:
        CBS lower bounds of 40, 70 and 140 samples at 0.1B, 0.4B and 0.8B tokens, from a batch of 32:

        >>> from lit_cbs.probe.reading import ProbeReading
        >>> def reading(tokens, cbs_lower):  # a determined reading at B = 32 samples
        ...     return ProbeReading(
        ...         tokens=tokens, step=0, batch_size=32, seq_len=1024, window_tokens=10**6, search="grid",
        ...         evaluate="train_ema", losses={"1": 3.0, "2": 3.0}, main_loss=3.0, branches_trained=[2.0],
        ...         failed=[], k_star=cbs_lower / 32, cbs_lower=cbs_lower, cbs_upper=None,
        ...         tokens_spent=0, overhead=0.0)
        >>> readings = [reading(10**8, 40), reading(4 * 10**8, 70), reading(8 * 10**8, 140)]
        >>> schedule = schedule_from_probe(readings, start=32, final=128)
        >>> schedule.batch_sizes, schedule.thresholds  # 64 once 64 <= 70, 128 once 128 <= 140
        ([32, 64, 128], [0, 400000000, 800000000])
    """
    _check_count("start", start, 1, "the first global batch, samples")
    _check_count("factor", factor, 2, "the ratio between consecutive batch sizes; BatchWarmup needs a whole ratio")
    if final is not None:
        _check_count("final", final, start, f"the largest global batch, samples, at least start={start}")
        doublings = math.log(final / start, factor)
        if abs(doublings - round(doublings)) > 1e-9:
            low, high = start * factor ** math.floor(doublings), start * factor ** math.ceil(doublings)
            raise ValueError(
                f"final={final} must be start={start} times a power of factor={factor}; nearest: {low} or {high}"
            )
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin >= 1:
        raise ValueError(
            f"margin={margin!r} must be a number >= 1 (move to batch B only where the CBS lower bound >= margin x B)"
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
    skipped = 0
    for index, reading in enumerate(readings):
        where = f"{name}[{index}]"
        if not isinstance(reading, ProbeReading):
            raise ValueError(f"{where}: {reading!r} is not a ProbeReading; read a cbs_probe.jsonl with read_readings")
        if not reading.determined:
            skipped += 1
            continue
        tokens, lower = _number(reading, "tokens", where), _number(reading, "cbs_lower", where)
        read_at = reading.seq_len
        if read_at is not None and measured_seq_len is not None and read_at != measured_seq_len:
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
    if skipped == len(readings):
        warnings.warn(f"every reading in {name} is undetermined; the schedule stays at start={start}", stacklevel=2)

    batch_sizes, thresholds = [start], [0]
    for tokens in sorted(lowest_at):
        batch = batch_sizes[-1]
        while margin * batch * factor <= lowest_at[tokens] and (final is None or batch * factor <= final):
            batch *= factor
        if batch > batch_sizes[-1]:
            batch_sizes.append(batch)
            thresholds.append(int(tokens))
    if len(thresholds) > 1 and thresholds[1] == 0:  # a reading at 0 tokens sets the first batch itself
        batch_sizes, thresholds = batch_sizes[1:], thresholds[1:]
    return PiecewiseBatch(batch_sizes, thresholds, unit="tokens")
