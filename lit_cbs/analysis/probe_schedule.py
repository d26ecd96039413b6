"""A batch-size warmup schedule read off a measured CBS curve: measure on a small model, train a big one.

Merrill et al. 2025 (arXiv 2505.23971) found that OLMo 1B and 7B have nearly the same critical batch
size curve, so a curve measured cheaply on one model can set the warmup of another; they read the
thresholds off the curve by hand. ``schedule_from_probe`` does it from ``CBSProbeCallback``'s
``cbs_probe.jsonl``: the target batch doubles (by ``factor``) as soon as a reading's CBS lower bound
allows it, from the reading's token count on. Pure Python: no Lightning.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lit_cbs import legacy
from lit_cbs.rules.batch_schedules import PiecewiseBatch

PathLike = str | os.PathLike
REQUIRED_FIELDS = ("tokens", "cbs_lower")
# The configuration a recipe run saves in its folder, beside cbs_probe.jsonl: recipes/train.py's resolved
# copy first, then the one Hydra writes (its interpolations resolved on reading).
RUN_CONFIGS = ("resolved_config.yaml", ".hydra/config.yaml")


def read_probe_records(path: PathLike) -> list[dict]:
    """The records of a ``cbs_probe.jsonl`` (one JSON object per line; blank lines skipped), in file order, with
    the current keys whichever version wrote them (``lit_cbs.legacy.probe_reading``).

    Raises:
        ValueError: the file cannot be read, holds no record, or a line is not a JSON object;
            the message names the file and line.
    """
    try:
        with open(path) as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(
            f"cannot read CBS probe records from {path} ({error}); pass the cbs_probe.jsonl a CBSProbeCallback wrote"
        ) from error
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as error:
            raise ValueError(f"{path}:{number}: not JSON ({error}); each line of cbs_probe.jsonl is one probe record") from error
        if not isinstance(record, dict):
            raise ValueError(
                f"{path}:{number}: {line.strip()[:60]!r} is not a probe record (a JSON object with tokens, cbs_lower, ...)"
            )
        records.append(legacy.probe_reading(record))
    if not records:
        raise ValueError(
            f"{path} holds no CBS probe record; run with CBSProbeCallback until a probe finishes, or pass another file"
        )
    return records


def run_config_value(run_dir: PathLike, key: str) -> tuple[Any, Path] | None:
    """The value of ``key`` (a dotted Hydra key, e.g. ``callbacks.cbs_probe.epsilon``) in the configuration
    the recipe run in ``run_dir`` saved (``RUN_CONFIGS``, in that order), and the file it came from; None
    where no such file holds the key or its value cannot be resolved there. A key set to null gives None
    as its value. For what a probe file's records do not say (written by an earlier version), or what the
    run that wrote them trained with."""
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


def _number(record: dict, key: str, where: str) -> float:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(
            f"{where}: {key}={value!r} is not a number >= 0; every determined probe record needs {key} "
            f"({'tokens seen at the probe' if key == 'tokens' else 'the CBS lower bound, samples'})"
        )
    return float(value)


def _check_count(name: str, value, minimum: int, meaning: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum} ({meaning})")
    return value


def schedule_from_probe(
    source: PathLike | Sequence[dict],
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
        source: a ``cbs_probe.jsonl`` path, or its records (dicts), in any order. Several runs' records
            may be mixed (e.g. two seeds): readings at the same token count count by their smallest
            lower bound. Readings with ``determined`` false (the data could not decide k*) are skipped;
            records without it (lit_cbs 0.1) count as determined.
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
            ``seq_len`` is given and the records do not carry ``seq_len``.

    Raises:
        ValueError: an empty or unreadable file, a record without a number ``tokens`` or ``cbs_lower``,
            ``start < 1``, ``factor < 2``, ``final`` below ``start`` or off its ladder, ``margin < 1``,
            or a sequence length missing or not a positive int; the message names the field.
    """
    _check_count("start", start, 1, "the first global batch, samples")
    _check_count("factor", factor, 2, "the ratio between consecutive batch sizes; BatchWarmup needs a whole ratio")
    if final is not None:
        _check_count("final", final, start, f"the largest global batch, samples, at least start={start}")
        doublings = math.log(final / start, factor)
        if abs(doublings - round(doublings)) > 1e-9:
            low, high = start * factor ** math.floor(doublings), start * factor ** math.ceil(doublings)
            raise ValueError(f"final={final} must be start={start} times a power of factor={factor}; nearest: {low} or {high}")
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin >= 1:
        raise ValueError(
            f"margin={margin!r} must be a number >= 1 (move to batch B only where the CBS lower bound >= margin x B)"
        )
    for name, value in (("seq_len", seq_len), ("measured_seq_len", measured_seq_len)):
        if value is not None:
            _check_count(name, value, 1, "tokens per sample")

    if isinstance(source, (str, os.PathLike)):
        name, records = str(source), read_probe_records(source)
    else:
        name, records = "probe records", list(source)
        if not records:
            raise ValueError("source holds no CBS probe record; pass a cbs_probe.jsonl path or its records")

    lowest_at: dict[float, float] = {}  # tokens -> smallest CBS lower bound read there, target samples
    skipped = 0
    for index, record in enumerate(records):
        where = f"{name}[{index}]"
        if not isinstance(record, dict):
            raise ValueError(f"{where}: {record!r} is not a probe record (a dict with tokens, cbs_lower, ...)")
        if record.get("determined", True) is False:
            skipped += 1
            continue
        tokens, lower = _number(record, "tokens", where), _number(record, "cbs_lower", where)
        record_seq_len = record.get("seq_len")
        if record_seq_len is not None and measured_seq_len is not None and record_seq_len != measured_seq_len:
            raise ValueError(
                f"{where}: seq_len={record_seq_len} but measured_seq_len={measured_seq_len}; drop measured_seq_len or fix it"
            )
        measured = record_seq_len if record_seq_len is not None else measured_seq_len
        if seq_len is not None and measured is None:
            raise ValueError(
                f"seq_len={seq_len} needs the measured run's sequence length: pass measured_seq_len "
                "(data.seq_len of the run that wrote the probe records)"
            )
        if seq_len is not None:
            lower = lower * measured / seq_len
        lowest_at[tokens] = min(lower, lowest_at.get(tokens, math.inf))
    if skipped == len(records):
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
