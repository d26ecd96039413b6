"""``BatchChange``: the record of one change of the global batch that ``BatchWarmup`` applied (its ``history``, and
``batch_history.json`` of a recipe run)."""

from __future__ import annotations

import dataclasses

import lightning.pytorch as pl

from lit_cbs.callbacks.accounting import BatchAccounting

__all__ = ["BatchChange"]


@dataclasses.dataclass
class BatchChange:
    """One applied change of the global batch. Batches in samples, consumed counts global.

    Attributes:
        step: optimizer steps taken before the new batch's first step.
        epoch: the epoch of that step.
        samples_seen, tokens_seen: samples and tokens trained on before it (all ranks).
        old_global_batch, new_global_batch: samples per optimizer step before and after.
        old_accumulate, new_accumulate: micro-batches per rank and step before and after.
        old_micro_batch_size, new_micro_batch_size: samples per micro-batch and rank before and after.
        lr_factor: this change's LR multiplier: ``lr_rule(new / old)``, or for a revert 1 / the reverted change's.
        requested_at_samples, requested_at_tokens: where the schedule (or the guard) first asked for this
            new batch (and micro-batch); the change waits for an aligned step, so these may be earlier.
        cause: ``"schedule"``, or ``"guard"`` for a revert of an increase (``BatchGuard``).
        clip_factor: this change's multiplier of the gradient-clipping threshold (``clip_rule``).

    Examples:
        A change from 64 to 128 samples under the sqrt LR rule, as ``BatchWarmup.history`` records it and
        its checkpoint stores it:

        >>> import dataclasses
        >>> from lit_cbs.callbacks import BatchChange
        >>> change = BatchChange(
        ...     step=100, epoch=0, samples_seen=6400, tokens_seen=819200, old_global_batch=64, new_global_batch=128,
        ...     old_accumulate=2, new_accumulate=4, old_micro_batch_size=8, new_micro_batch_size=8,
        ...     lr_factor=2**0.5, requested_at_samples=6400, requested_at_tokens=819200,
        ... )
        >>> change.new_global_batch // change.old_global_batch, round(change.lr_factor, 4), change.cause
        (2, 1.4142, 'schedule')
        >>> BatchChange(**dataclasses.asdict(change)) == change
        True
    """

    step: int  # optimizer steps taken before the new batch's first step
    epoch: int
    samples_seen: int
    tokens_seen: int
    old_global_batch: int
    new_global_batch: int
    old_accumulate: int
    new_accumulate: int
    old_micro_batch_size: int
    new_micro_batch_size: int
    lr_factor: float  # this change's LR multiplier: lr_rule(new / old), or for a revert 1 / the reverted change's
    requested_at_samples: int  # where the schedule (or the guard) first asked for this new batch (and micro-batch)
    requested_at_tokens: int
    cause: str = "schedule"  # "schedule", or "guard" for a revert of an increase (BatchGuard)
    clip_factor: float = 1.0  # this change's multiplier of the gradient-clipping threshold (clip_rule)

    @classmethod
    def _after_step(
        cls,
        trainer: pl.Trainer,
        accounting: BatchAccounting,
        old: tuple[int, int, int],
        new: tuple[int, int, int],
        factors: tuple[float, float],
        requested_at: tuple[int, int],
        cause: str,
    ) -> BatchChange:
        """The change applied right after the optimizer step just taken, at the counts of ``trainer`` and its
        ``accounting``: ``old`` and ``new`` (global batch, accumulation, micro-batch), ``factors`` (LR, clipping
        threshold), ``requested_at`` (samples, tokens)."""
        return cls(
            step=trainer.global_step,
            epoch=trainer.current_epoch,
            samples_seen=accounting.samples_seen,
            tokens_seen=accounting.tokens_seen,
            old_global_batch=old[0],
            new_global_batch=new[0],
            old_accumulate=old[1],
            new_accumulate=new[1],
            old_micro_batch_size=old[2],
            new_micro_batch_size=new[2],
            lr_factor=factors[0],
            requested_at_samples=requested_at[0],
            requested_at_tokens=requested_at[1],
            cause=cause,
            clip_factor=factors[1],
        )
