"""What lit_cbs 0.1.0 wrote, read as 0.2.0 writes it: the one place that knows the old keys and shapes.

Every reader of a file lit_cbs writes passes what it read through here first: ``cbs_probe.jsonl`` and the
probe's checkpointed history (``ProbeReading.from_record``), the checkpoint's states of ``CBSProbeCallback``,
``BatchWarmup``, its guard and ``BatchAccounting``, and ``batch_history.json`` (``read_batch_history``). Each
function takes a record as read (a dict from JSON or a checkpoint) and returns a new dict with the current
names, leaving what is current as it is; the readers then know only the current shape. Pure Python.

What 0.1.0 wrote differently:

- a probe reading's ``strategy`` is ``search`` (the setting's name); the first readings had no ``seq_len``
  (None here: a resumed run gives its own, a file's reading has none) and none of the fields after
  ``adaptive_batch`` (their defaults in ``ProbeReading``: judged by the means, no error bars, no ``epsilon``);
- a guard verdict's ``window_steps`` is ``watch_steps``, and a watched increase's ``window_until`` is
  ``watch_until`` (the setting is ``watch_span``);
- checkpoints before ``BatchAccounting`` kept the sample and token counts in BatchWarmup's state, without a
  clipping factor, the data-parallel size or the seconds trained;
- the probe's state before stopped probes, failures and side jobs lacks those.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "accounting_state",
    "batch_history",
    "guard_state",
    "guard_verdict",
    "probe_reading",
    "probe_state",
    "warmup_state",
]

# Old key -> current key, per record.
READING_KEYS = {"strategy": "search"}
VERDICT_KEYS = {"window_steps": "watch_steps"}
WATCH_KEYS = {"window_until": "watch_until"}
# BatchWarmup's state kept these before BatchAccounting held them.
COUNTS_IN_WARMUP = ("samples_seen", "tokens_seen", "seq_len")


def _renamed(record: Mapping[str, Any], keys: Mapping[str, str]) -> dict[str, Any]:
    return {keys.get(key, key): value for key, value in record.items()}


def probe_reading(record: Mapping[str, Any]) -> dict[str, Any]:
    """A probe reading (a ``cbs_probe.jsonl`` line, or an entry of ``CBSProbeCallback``'s checkpointed history).

    Args:
        record: the reading as read (a dict from JSON or a checkpoint), of any version.

    Returns:
        A new dict with the current keys (``ProbeReading.from_record`` reads it); ``seq_len`` None where
        the record has none.

    Examples:
        >>> probe_reading({"strategy": "grid", "tokens": 1000})  # as 0.1.0 wrote it
        {'seq_len': None, 'search': 'grid', 'tokens': 1000}
    """
    return {"seq_len": None, **_renamed(record, READING_KEYS)}


def guard_verdict(record: Mapping[str, Any]) -> dict[str, Any]:
    """A ``GuardVerdict`` (the guard's checkpointed state, ``batch_history.json``).

    Args:
        record: the verdict as read (a dict), of any version.

    Returns:
        A new dict with the current keys (``window_steps`` is ``watch_steps``).

    Examples:
        >>> guard_verdict({"window_steps": 12, "reverted": False})
        {'watch_steps': 12, 'reverted': False}
    """
    return _renamed(record, VERDICT_KEYS)


def guard_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """``BatchGuard.state_dict()``: its verdicts, and the increase it watches or reverts.

    Args:
        state: the guard's state as a checkpoint kept it: ``verdicts`` (a list of dicts), ``watch`` and
            ``revert`` (a dict each, or None).

    Returns:
        A new dict with the current keys in each verdict and in the watched and reverted increases.

    Raises:
        KeyError: ``state`` lacks ``verdicts``, ``watch`` or ``revert`` (it is no guard's state).

    Examples:
        >>> guard_state({"verdicts": [{"window_steps": 12, "reverted": False}],
        ...              "watch": {"batch": 64, "window_until": 900}, "revert": None})
        {'verdicts': [{'watch_steps': 12, 'reverted': False}], 'watch': {'batch': 64, 'watch_until': 900},
         'revert': None}
    """
    watched = {key: None if state[key] is None else _renamed(state[key], WATCH_KEYS) for key in ("watch", "revert")}
    return {**state, "verdicts": [guard_verdict(verdict) for verdict in state["verdicts"]], **watched}


def accounting_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """``BatchAccounting.state_dict()``; ``data_parallel_size`` None where the checkpoint does not say it.

    Args:
        state: the accounting's state as a checkpoint kept it (counts in samples and tokens).

    Returns:
        A new dict with ``data_parallel_size`` (None) and ``fit_seconds`` (0.0) where the state lacks them.

    Examples:
        >>> accounting_state({"samples_seen": 64, "tokens_seen": 8192})
        {'data_parallel_size': None, 'fit_seconds': 0.0, 'samples_seen': 64, 'tokens_seen': 8192}
    """
    return {"data_parallel_size": None, "fit_seconds": 0.0, **state}


def warmup_state(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``BatchWarmup.state_dict()``, and the accounting's state where the checkpoint kept the counts in
    BatchWarmup's (None where ``BatchAccounting`` saved its own).

    Args:
        state: BatchWarmup's state as a checkpoint kept it.

    Returns:
        ``(warmup, accounting)``: BatchWarmup's state with the current keys, and ``accounting_state`` of
        the counts (samples, tokens) 0.1.0 kept in it, or None where it kept none.

    Examples:
        >>> warmup, accounting = warmup_state({"lr_factor": 1.0, "samples_seen": 64, "tokens_seen": 8192})
        >>> warmup
        {'clip_factor': 1.0, 'schedule': None, 'guard': None, 'lr_factor': 1.0}
        >>> accounting["tokens_seen"], accounting["data_parallel_size"]
        (8192, None)
    """
    current = {"clip_factor": 1.0, "schedule": None, "guard": None, **state}
    counts = {key: current.pop(key) for key in COUNTS_IN_WARMUP if key in current}
    return current, accounting_state(counts) if counts else None


def probe_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """``CBSProbeCallback.state_dict()`` but its history, whose readings ``probe_reading`` reads.

    Args:
        state: the probe's state as a checkpoint kept it.

    Returns:
        A new dict with the keys later versions added: ``interrupted`` (None), ``side_jobs`` (none),
        ``failures`` (none) and ``unusable`` (True where the state records failures).

    Examples:
        >>> probe_state({"history": []})  # before stopped probes, failures and side jobs
        {'interrupted': None, 'unusable': False, 'side_jobs': [], 'history': [], 'failures': []}
    """
    failures = state.get("failures", [])
    return {"interrupted": None, "unusable": bool(failures), "side_jobs": [], **state, "failures": failures}


def batch_history(record: Mapping[str, Any]) -> dict[str, Any]:
    """``batch_history.json`` (``lit_cbs.recipes.run_report.write_batch_history``).

    Args:
        record: the file's JSON object as read.

    Returns:
        A new dict whose ``guard_verdicts`` (None where the run had no guard) have the current keys.

    Examples:
        >>> batch_history({"changes": [], "guard_verdicts": [{"window_steps": 12, "reverted": True}]})
        {'changes': [], 'guard_verdicts': [{'watch_steps': 12, 'reverted': True}]}
        >>> batch_history({"changes": []})
        {'changes': [], 'guard_verdicts': None}
    """
    verdicts = record.get("guard_verdicts")
    return {**record, "guard_verdicts": None if verdicts is None else [guard_verdict(verdict) for verdict in verdicts]}
