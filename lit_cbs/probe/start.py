"""Whether a due probe starts, and on what: pure arithmetic on the run's numbers, no Lightning.

At a probe point ``CBSProbeCallback`` (and a probe of a saved checkpoint) asks ``plan_probe`` with what the run
is (its global batch, tokens per sample, data-parallel ranks), what it may still train (where it ends at the
earliest, where its epoch ends), what the probe is set to measure (``ProbeConfig``) and which multipliers' batches
the micro-batches can make. The answer is a ``ProbePlan`` (the multipliers to measure, the window in samples, where
it may end early) or a ``ProbeSkip`` saying why not, and whether the point stays due (a window the run's end would
cut is left to a run resumed from this one's last checkpoint; one an epoch's uneven end would cut, to the next
epoch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lit_cbs.probe.config import ProbeConfig
from lit_cbs.probe.reading import max_branches

__all__ = ["EpochEnd", "ProbePlan", "ProbeSkip", "plan_probe", "window_at"]


@dataclass(frozen=True)
class ProbePlan:
    """What a probe that starts measures (``plan_probe``'s answer). Samples are global (all ranks) unless said
    otherwise.

    Args:
        multipliers: the ks whose batch k*B the micro-batches make and the window holds.
        window_samples: samples of each replicate window: whole steps of the largest branch.
        early_stop_samples: samples per rank into the window where the reading may be judged early.

    Examples:
        A window of 4096 tokens at 16 tokens per sample is 256 samples, 8 steps of the k = 4 branch (32 samples);
        early stops at 1/4 and 1/2 of it fall on whole steps of that branch:

        >>> plan = plan_probe(ProbeConfig(at_tokens=[1024], multipliers=(1, 2, 4), window_tokens=4096,
        ...                               early_stop=[0.25, 0.5]),
        ...                   tokens=1024, batch_size=8, seq_len=16, data_parallel_size=1,
        ...                   branch_micro_batch=lambda k: 8)
        >>> plan
        ProbePlan(multipliers=[1.0, 2.0, 4.0], window_samples=256, early_stop_samples=[64, 128])
    """

    multipliers: list[float]  # the ks whose batch k*B the micro-batches make and the window holds
    window_samples: int  # each replicate window: whole steps of the largest branch
    early_stop_samples: list[int]  # samples per rank into the window where the reading may be judged early


@dataclass(frozen=True)
class ProbeSkip:
    """A due probe that does not start: ``reason`` in words; ``stays_due``: the point is probed later (by a run
    resumed from this one's last checkpoint) instead of being passed over.

    Args:
        reason: why the probe does not start, in words.
        stays_due: the point is probed later (by a run resumed from this one's last checkpoint).
        warn: the reason is a problem with the settings (a warning), not a plan (an info line).
        next_epoch: asked again after every step: it starts early in the next epoch.

    Examples:
        Only k = 1 makes whole micro-batches of 8 here, so no probe starts (a warning: the settings cannot work):

        >>> skip = plan_probe(ProbeConfig(at_tokens=[1024], multipliers=(1, 1.5)), tokens=1024, batch_size=8,
        ...                   seq_len=16, data_parallel_size=1, branch_micro_batch=lambda k: 8 if k == 1 else None)
        >>> skip.reason, skip.warn, skip.stays_due
        ('fewer than two multipliers, k = 1 among them, fit batch 8', True, False)
    """

    reason: str
    stays_due: bool = False
    warn: bool = False  # the reason is a problem with the settings (a warning), not a plan (an info line)
    next_epoch: bool = False  # asked again after every step: it starts early in the next epoch


@dataclass(frozen=True)
class EpochEnd:
    """This epoch of a loader whose last round leaves the ranks different numbers of samples
    (``GlobalOrderLoader.deals_unevenly``). Samples global (all ranks).

    Args:
        samples: samples in the epoch.
        position: samples consumed so far this epoch.

    Examples:
        An epoch of 1000 samples, 900 of them consumed: a window of 256 samples waits for the next epoch.

        >>> skip = plan_probe(ProbeConfig(at_tokens=[1024], multipliers=(1, 2, 4), window_tokens=4096), tokens=1024,
        ...                   batch_size=8, seq_len=16, data_parallel_size=3, branch_micro_batch=lambda k: 8,
        ...                   epoch_end=EpochEnd(samples=1000, position=900))
        >>> skip.next_epoch, skip.reason
        (True, "its window would reach this epoch's last micro-batches, which leave the 3 ranks different numbers
        of samples")
    """

    samples: int  # in the epoch
    position: int  # consumed so far this epoch


def usable_multipliers(
    multipliers: Sequence[float],
    batch_size: int,
    window_samples: int,
    branch_micro_batch: Callable[[float], int | None],
) -> list[float]:
    """The ks whose batch k*B is a whole number of micro-batches on every rank (``branch_micro_batch(k)`` is not
    None) and fits in ``window_samples``."""
    return [k for k in multipliers if branch_micro_batch(k) is not None and k * batch_size <= window_samples]


def window_at(
    config: ProbeConfig, batch_size: int, seq_len: int, branch_micro_batch: Callable[[float], int | None]
) -> tuple[list[float], int]:
    """The multipliers a probe at global batch ``batch_size`` (samples) trains, and the samples each of its windows
    holds: ``window_tokens`` rounded down to whole steps of its largest branch, so that every branch trains the same
    number of its own steps; 0 samples where fewer than two multipliers, or not k = 1, fit (no probe runs there).

    Args:
        config: the probe's settings (``multipliers``, ``window_tokens``).
        batch_size: the main run's global batch B (samples).
        seq_len: tokens per sample.
        branch_micro_batch: samples per rank in a micro-batch of branch k, None where k*B is no whole number of
            them on every rank.

    Returns:
        The usable multipliers and the samples (global) of each window.

    Examples:
        >>> window_at(ProbeConfig(multipliers=(1, 2, 4)), 8, 16, lambda k: 8)
        ([1.0, 2.0, 4.0], 62496)
        >>> window_at(ProbeConfig(multipliers=(1, 2, 4)), 8, 16, lambda k: 8 if k == 1 else None)  # only k = 1
        ([1.0], 0)
    """
    window_samples = config.window_tokens // seq_len
    ks = usable_multipliers(config.multipliers, batch_size, window_samples, branch_micro_batch)
    if len(ks) < 2 or 1.0 not in ks:
        return ks, 0
    largest = max(ks) * batch_size
    return ks, int(window_samples // largest * largest)


def plan_probe(
    config: ProbeConfig,
    *,
    tokens: int,
    batch_size: int,
    seq_len: int,
    data_parallel_size: int,
    branch_micro_batch: Callable[[float], int | None],
    run_end_tokens: int | None = None,
    run_end: str = "the run's end",
    tokens_spent: int = 0,
    main_span_tokens: int | None = None,
    adaptive_final: int | None = None,
    epoch_end: EpochEnd | None = None,
    largest_batch: int | None = None,
) -> ProbePlan | ProbeSkip:
    """The probe due at ``tokens`` (tokens trained so far, global) on a run at global batch ``batch_size``
    (samples) of ``seq_len`` tokens per sample, or why it is skipped.

    Args:
        config: the probe's settings.
        tokens: tokens trained when the probe is due.
        batch_size: the main run's global batch B (samples).
        seq_len: tokens per sample.
        data_parallel_size: ranks that read their own micro-batches.
        branch_micro_batch: samples per rank in a micro-batch of branch k, None where k*B is no whole number of
            them on every rank.
        run_end_tokens: the earliest token count at which the run may end (None: unknown, or a probe of a saved
            checkpoint, which trains no main run); ``run_end`` says what ends it there, in words.
        tokens_spent: branch tokens of earlier probes (for ``config.max_overhead``).
        main_span_tokens: tokens of the main run the probe needs after ``tokens`` (None: the whole span,
            ``replicates`` windows; side jobs read their data themselves and need only the first window).
        adaptive_final: the final batch (samples) of the run's ``CBSAdaptive`` schedule, where it is and no reading
            can move it (``CBSAdaptive.wants_readings`` false); None otherwise.
        epoch_end: where this epoch ends, when its last round leaves the ranks different numbers of samples.
        largest_batch: the largest global batch (samples) the run may reach (None: ``batch_size``), by which the
            main run may pass the window's end.

    Returns:
        A ``ProbePlan``, or a ``ProbeSkip`` with the reason.

    Examples:
        >>> plan = plan_probe(ProbeConfig(at_tokens=[1024], multipliers=(1, 2, 4), window_tokens=4096),
        ...                   tokens=1024, batch_size=8, seq_len=16, data_parallel_size=1,
        ...                   branch_micro_batch=lambda k: 8)
        >>> plan.multipliers, plan.window_samples
        ([1.0, 2.0, 4.0], 256)
    """
    if adaptive_final is not None:
        return ProbeSkip(
            f"CBSAdaptive is at its final batch {adaptive_final}, where no reading can move it "
            "(CBSAdaptive(probe_after_final=True) keeps probing)"
        )
    ks, window_samples = window_at(config, batch_size, seq_len, branch_micro_batch)
    if not window_samples:
        return ProbeSkip(f"fewer than two multipliers, k = 1 among them, fit batch {batch_size}", warn=True)
    largest = max(ks) * batch_size
    window_tokens = window_samples * seq_len
    span = window_tokens * config.replicates if main_span_tokens is None else min(main_span_tokens, window_tokens)
    if run_end_tokens is not None and tokens + span > run_end_tokens:
        return ProbeSkip(
            f"its window of {span:,} tokens would end past {run_end}; a run resumed from this one's last checkpoint "
            "starts it there",
            stays_due=True,
        )
    if config.max_overhead is not None:
        expected = max_branches(config.search, len(ks)) * window_tokens * config.replicates
        overhead = (tokens_spent + expected) / max(1, tokens + window_tokens * config.replicates)
        if overhead > config.max_overhead:
            return ProbeSkip(f"it would bring probe overhead to {overhead:.2f} > max_overhead={config.max_overhead}")
    if epoch_end is not None:
        # Each rank records its own micro-batches and the branches need as many samples on every rank, so a window
        # stays clear of an epoch's last round. The main run may change its batch inside the window and go past it
        # by up to one step.
        reach = window_samples * config.replicates + max(batch_size, largest_batch or batch_size)
        uneven = f"leave the {data_parallel_size} ranks different numbers of samples"
        if reach > epoch_end.samples:
            return ProbeSkip(
                f"its window and a step ({reach:,} samples) do not fit in an epoch of {epoch_end.samples:,} samples, "
                f"whose last micro-batches {uneven}: shorten window_tokens",
                warn=True,
            )
        if epoch_end.position + reach > epoch_end.samples:
            return ProbeSkip(f"its window would reach this epoch's last micro-batches, which {uneven}", next_epoch=True)
    largest_step = round(largest) // data_parallel_size  # samples per rank
    length = window_samples // data_parallel_size
    fractions = config.early_stop
    assert fractions is not None, "ProbeConfig makes early_stop a list"
    early_stop = sorted({int(f * length) // largest_step * largest_step for f in fractions} - {0, length})
    return ProbePlan(ks, window_samples, early_stop)
