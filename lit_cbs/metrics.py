"""The names of the metrics lit_cbs logs, defined once for the writers and the readers of ``metrics.csv``."""

from __future__ import annotations

import re

# Lightning's step column of a CSVLogger file: the optimizer steps taken.
STEP = "step"

# BatchWarmup, one row per optimizer step: what the step trained with, and the counts after it.
TOKENS_SEEN = "tokens_seen"  # tokens trained on, all ranks (token data only)
SAMPLES_SEEN = "samples_seen"  # samples trained on, all ranks
FIT_SECONDS = "fit_seconds"  # seconds of training over every fit of the run, setup excluded
LR = "lr"  # the first param group's LR
GLOBAL_BATCH = "batch/global_size"  # samples
MICRO_BATCH = "batch/micro_batch_size"  # samples per rank
ACCUMULATE = "batch/accumulate"  # rounds of micro-batches in the step
LR_FACTOR = "batch/lr_factor"  # the product of every batch change's LR factor
GRADIENT_CLIP_VAL = "batch/gradient_clip_val"  # the Trainer's clipping threshold (with clip_rule)
GUARD_REVERTS = "batch/guard_reverts"  # increases the guard reverted so far
# At the step of each guard verdict, nats.
GUARD_RISE = "batch/guard_rise"
GUARD_THRESHOLD = "batch/guard_threshold"


def batch_setting(key: str) -> str:
    """An optimizer setting a rule moves at batch changes (``weight_decay``, ``beta2``), as BatchWarmup logs it."""
    return f"batch/{key}"


# CausalLM.
TRAIN_LOSS = "train/loss"  # nats per token, the step's mean
VAL_LOSS = "val/loss"  # nats per token
TOKENS_PER_S = "perf/tokens_per_s"  # this process's training throughput
MFU = "perf/mfu"  # model FLOPs utilization, a fraction of the device's peak

# CBSProbeCallback, at the step that ended each probe's window: the reading (samples) and what probes cost.
CBS_LOWER = "cbs/lower"
CBS_UPPER = "cbs/upper"
CBS_ESTIMATE = "cbs/estimate"
CBS_K_STAR = "cbs/k_star"
CBS_DETERMINED = "cbs/determined"  # 1 or 0
PROBE_OVERHEAD = "probe/overhead"  # branch tokens / main-run tokens, all probes so far
PROBE_TOKENS_SPENT = "probe/tokens_spent"  # branch tokens so far


def cbs_gap(k: str) -> str:
    """The loss of branch ``k`` ("2" for k = 2) minus the smallest k's, nats."""
    return f"cbs/gap_k{k}"


def cbs_gap_se(k: str) -> str:
    """The standard error of ``cbs_gap(k)``, nats."""
    return f"cbs/gap_se_k{k}"


# GradientNoiseScale: B_simple (samples) and its parts, for the whole model and per group of parameters.
GNS_QUANTITIES = ("b_simple", "trace_sigma", "grad_sq")
_GNS_GROUP = re.compile(r"gns/(.+)/(\w+)")


def gns(quantity: str, group: str | None = None) -> str:
    """``gns/<quantity>`` for the whole model, ``gns/<group>/<quantity>`` for a group of parameters; ``quantity`` is
    one of ``GNS_QUANTITIES``."""
    return f"gns/{quantity}" if group is None else f"gns/{group}/{quantity}"


def gns_group(name: str, quantity: str = "b_simple") -> str | None:
    """The group whose ``quantity`` the metric ``name`` is (``gns(quantity, group)``); None for any other metric."""
    match = _GNS_GROUP.fullmatch(name)
    return match[1] if match is not None and match[2] == quantity else None


GNS_B_SIMPLE = gns("b_simple")
