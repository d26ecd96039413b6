"""Where a run ends, in tokens, so that a probe plans its readings inside it.

A run stops at the first of three limits: ``max_tokens`` (``BatchAccounting``, at the end of the
optimizer step that reaches it), ``Trainer(max_steps=...)`` and ``Trainer(max_epochs=...)``. An
epoch's tokens do not depend on the batch, but a step's do, and a ``BatchWarmup`` may grow (or its
guard shrink) the batch: so the end is given as a range, from the batch in use now (``earliest``,
exact for a constant batch) to the largest batch the schedule can reach (``latest``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeVar

import lightning.pytorch as pl

from lit_cbs.callbacks.accounting import BatchAccounting, resizable_train_loader

T = TypeVar("T")

__all__ = ["RunEnd", "run_end"]


def known(value: T | None, what: str) -> T:
    """``value``, which the probe reads only once it is known; RuntimeError naming ``what`` if it is not.

    For the batch counts of ``BatchAccounting`` (``seq_len``, ``micro_batch_size``, ``global_batch``),
    None until the first batch tells them: a probe reads them only after that batch, so this guard
    fires only where the arithmetic on None would have failed anyway.

    Examples:
        >>> known(4, "seq_len")
        4
        >>> known(None, "seq_len")
        Traceback (most recent call last):
        RuntimeError: seq_len is not known yet: it is read before the first training batch told it
    """
    if value is None:
        raise RuntimeError(f"{what} is not known yet: it is read before the first training batch told it")
    return value


@dataclass(frozen=True)
class RunEnd:
    """The tokens (global) at which the run ends: no sooner than ``earliest`` while the batch does
    not shrink, no later than ``latest``; ``limit`` names the limit that ends it soonest. None: no
    limit is known (none set, or only max_epochs over a loader without a length).

    Args:
        earliest: tokens (global) at which the run ends at the batch in use now.
        latest: tokens (global) by which it ends at the latest (at the largest batch it may reach).
        limit: the limit that ends it soonest, e.g. "max_steps=100".

    Examples:
        >>> end = RunEnd(earliest=409_600, latest=819_200, limit="max_steps=100")
        >>> end.describe()
        'max_steps=100, at 409,600 tokens'
        >>> RunEnd(None, None, None).describe()
        'no known limit'
    """

    earliest: int | None
    latest: int | None
    limit: str | None

    def describe(self) -> str:
        """The limit that ends the run soonest and where (see the class example).

        Returns:
            E.g. "max_steps=100, at 409,600 tokens", or "no known limit".
        """
        return f"{self.limit}, at {self.earliest:,} tokens" if self.limit else "no known limit"


def run_end(
    trainer: pl.Trainer,
    accounting: BatchAccounting,
    micro_batches_this_epoch: int,
    micro_batches_into_step: int,
    largest_batch: int,
) -> RunEnd:
    """The run's end, called from a training hook of the current micro-batch: ``micro_batches_this_epoch``
    (``batch_idx + 1``) of this epoch read and counted in ``accounting.tokens_seen``, of which
    ``micro_batches_into_step`` belong to the optimizer step not yet taken (0 right after a step, 1
    at the first micro-batch of a step). ``largest_batch``: the largest global batch (samples) the
    run may reach.

    Args:
        trainer: the Trainer inside its ``fit`` (``max_steps``, ``max_epochs``, its train loader).
        accounting: the Trainer's ``BatchAccounting``, past the first batch (its micro-batch and ``seq_len`` known).
        micro_batches_this_epoch: micro-batches of this epoch read so far, the current one included.
        micro_batches_into_step: of them, those of the optimizer step not yet taken.
        largest_batch: the largest global batch (samples) the run may reach.

    Returns:
        The run's end in tokens (global): the earliest and latest, and the limit that ends it soonest.

    Raises:
        RuntimeError: the accounting does not know the micro-batch or ``seq_len`` yet (before the first batch).

    Examples:
        Called after the first step of a fit with ``max_steps=3`` at batch 4 of 8 tokens (32 tokens seen): 2 steps
        are left, 64 tokens at this batch, 128 if it grew to 8; ``max_tokens=1024`` comes later:

        >>> import lightning.pytorch as pl
        >>> from lit_cbs.callbacks import BatchAccounting
        >>> from lit_cbs.data import RandomTokenData
        >>> from lit_cbs.models import CausalLM
        >>> class End(pl.Callback):
        ...     def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        ...         if batch_idx == 0:
        ...             self.end = run_end(trainer, accounting, batch_idx + 1, 0, largest_batch=8)
        >>> lm = CausalLM({"vocab_size": 32, "d_model": 16, "n_layers": 1, "n_heads": 2, "mlp_hidden": 32,
        ...                "context_length": 8, "tie_embeddings": True})
        >>> accounting, end = BatchAccounting(seq_len=8, max_tokens=1024), End()
        >>> trainer = pl.Trainer(accelerator="cpu", max_steps=3, callbacks=[accounting, end], logger=False,
        ...     enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
        >>> trainer.fit(lm, RandomTokenData(vocab_size=32, seq_len=8, batch_size=4, samples=16))
        >>> end.end
        RunEnd(earliest=96, latest=160, limit='max_steps=3')
    """
    seq_len = known(accounting.seq_len, "BatchAccounting.seq_len")
    micro = known(accounting.micro_batch_size, "BatchAccounting.micro_batch_size")
    global_batch = known(accounting.global_batch, "BatchAccounting.global_batch")
    per_micro_batch = micro * accounting.data_parallel_size * seq_len  # tokens, all ranks
    step_start = accounting.tokens_seen - micro_batches_into_step * per_micro_batch
    ends: dict[str, tuple[int, int]] = {}
    if accounting.max_tokens is not None:
        ends[f"max_tokens={accounting.max_tokens}"] = (accounting.max_tokens, accounting.max_tokens)
    if trainer.max_steps is not None and trainer.max_steps >= 0:
        steps_left = trainer.max_steps - trainer.global_step
        ends[f"max_steps={trainer.max_steps}"] = (
            step_start + steps_left * global_batch * seq_len,
            step_start + steps_left * max(largest_batch, global_batch) * seq_len,
        )
    per_epoch = trainer.num_training_batches
    loader = resizable_train_loader(trainer)
    if trainer.max_epochs is not None and trainer.max_epochs >= 0 and loader is not None:
        # Its epochs train every sample, the last round short: count samples, not micro-batches.
        left = (trainer.max_epochs - trainer.current_epoch) * loader.num_samples - loader.position
        tokens = accounting.tokens_seen + left * seq_len
        ends[f"max_epochs={trainer.max_epochs}"] = (tokens, tokens)
    elif trainer.max_epochs is not None and trainer.max_epochs >= 0 and math.isfinite(per_epoch):
        batches_left = (trainer.max_epochs - trainer.current_epoch) * per_epoch - micro_batches_this_epoch
        tokens = accounting.tokens_seen + int(batches_left) * per_micro_batch
        ends[f"max_epochs={trainer.max_epochs}"] = (tokens, tokens)
    if not ends:
        return RunEnd(None, None, None)
    limit = min(ends, key=lambda name: ends[name][0])
    return RunEnd(ends[limit][0], min(latest for _, latest in ends.values()), limit)
