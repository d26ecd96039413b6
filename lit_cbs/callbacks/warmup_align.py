"""Where ``BatchWarmup``'s changes of the batch may start: right after an optimizer step, and only where the samples
consumed this epoch (all ranks) are a multiple of the new global batch (``fits_now``), or between epochs; never after
the run's final optimizer step (``no_step_follows``). The steps where the batch changes therefore depend on the
samples alone, not on the ranks or the micro-batch: a run on any number of ranks, or resumed on another number
(BatchWarmup regroups the batch there with ``fits_now`` too), changes on the same steps.
"""

from __future__ import annotations

import lightning.pytorch as pl

from lit_cbs._internals import shift_epoch_micro_batches
from lit_cbs.callbacks.accounting import BatchAccounting, resizable_train_loader

__all__: list[str] = []  # internal: what other lit_cbs modules use, nothing a user calls


def fits_now(trainer: pl.Trainer, accounting: BatchAccounting, global_batch: int, accumulate: int) -> bool:
    """Whether a step of ``global_batch`` samples (``accumulate`` micro-batches per rank) can start now,
    right after an optimizer step: when the samples consumed this epoch, over all ranks, are a
    multiple of it (from B, at most B' / gcd(B, B') - 1 steps later). This depends on
    the samples alone, not on the ranks or the micro-batch, so a run on any number of ranks
    changes on the same steps, and a token budget of whole batches is met exactly.

    Lightning also needs the epoch's micro-batches to be a multiple of the accumulation. With a
    ``GlobalOrderLoader`` they need not be (the micro-batch may have changed this epoch, or the ranks
    on resume): its count of micro-batches is only Lightning's, so it is moved up to the next
    multiple, here and in the loader. With another loader the micro-batch is fixed, and the
    samples condition implies it. ``accounting``: the Trainer's, with the micro-batch and the ranks.
    """
    loader = resizable_train_loader(trainer)
    ready = trainer.fit_loop.epoch_loop.batch_progress.current.ready
    if loader is not None:
        samples = loader.position
    else:
        micro = accounting.micro_batch_size
        if micro is None:
            raise RuntimeError("BatchWarmup has no micro-batch: its setup(trainer, pl_module, 'fit') has not run")
        samples = ready * micro * accounting.data_parallel_size
    if samples % global_batch:
        return False
    behind = -ready % accumulate
    if behind:
        assert loader is not None  # with another loader the samples condition implies the accumulation's
        shift_epoch_micro_batches(trainer, behind)
        loader.micro_batches += behind
    return True


def no_step_follows(trainer: pl.Trainer) -> bool:
    """True after the run's final optimizer step: a change there would be recorded, logged and
    checkpointed although no step uses it."""
    return trainer.should_stop or (trainer.max_steps >= 0 and trainer.global_step >= trainer.max_steps)
