"""Where a run will end, in tokens, so a probe can plan its readings inside it.

A Lightning run stops at the first of three limits: ``max_tokens`` (``BatchAccounting``: after the
optimizer step that reaches it), ``Trainer(max_steps=...)`` and ``Trainer(max_epochs=...)``.
``run_end_tokens`` counts the tokens each allows from where the run is, as Lightning will train
them: steps of ``accumulate`` micro-batches, a shorter step at the end of an epoch, an epoch's
last micro-batch holding fewer samples when the loader keeps a partial batch, ``min_steps`` and
``min_epochs`` holding off the stop at ``max_tokens``, and the changes a ``BatchWarmup`` makes to
the accumulation (at aligned steps or epoch ends), which it walks step by step while the schedule
still changes.
"""

from __future__ import annotations

import bisect
import dataclasses
import math

import lightning.pytorch as pl
from lightning.fabric.utilities.data import sized_len
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from torch.utils.data import DataLoader

from lit_cbs.accounting import BatchAccounting
from lit_cbs.schedules import CBSAdaptive
from lit_cbs.warmup import BatchWarmup


def run_end_tokens(trainer: pl.Trainer, accounting: BatchAccounting, warmup: BatchWarmup | None = None) -> tuple[int | None, str | None]:
    """The tokens (global, all ranks) trained on when the run ends, and the limit that ends it.

    Of ``"max_tokens"`` (the accounting's), ``"max_steps"`` and ``"max_epochs"`` (the Trainer's), the
    one the run reaches first (on a tie, the first in that order); ``(None, None)`` when no limit
    is known: none is set, or only ``max_epochs`` with a train loader of unknown length (an iterable
    dataset; for such a loader ``max_steps`` and ``max_tokens`` are counted as if it never runs out).
    ``max_tokens`` ends the run at the end of the optimizer step that reaches it, so that end may lie
    up to one step past the budget.

    Call it during ``fit`` once the accounting knows the micro-batch and ``seq_len``: from
    ``on_train_batch_start`` of the first batch on, in any training hook (in ``on_train_batch_end``
    after BatchWarmup's own, which may change the accumulation there), and pass the Trainer's
    ``BatchWarmup`` if it has one. Returns ``(None, None)`` for data without tokens
    (``accounting.seq_len`` is None).

    The batch to come is foreseen, and the count exact, without a BatchWarmup or with one whose
    schedule is open-loop (not ``CBSAdaptive``), with no ``guard`` and no ``max_micro_batch_size``,
    and without a ``GradientAccumulationScheduler``. Otherwise the batch depends on what training
    will measure: ``max_steps`` is then not known (the run may end earlier by it), ``max_tokens``
    counts as the budget itself, and ``max_epochs`` (whose tokens do not depend on the batch) stays
    exact.
    """
    if accounting.seq_len is None or accounting.micro_batch_size is None:
        return None, None
    walk, limits = _Walk(trainer, accounting), _Limits.of(trainer, accounting)
    foreseen = not any(isinstance(callback, GradientAccumulationScheduler) for callback in trainer.callbacks) and (
        warmup is None
        or (warmup.guard is None and warmup.max_micro_batch_size is None and not isinstance(warmup.schedule, CBSAdaptive))
    )
    if not foreseen:
        return _first({"max_tokens": limits.max_tokens, "max_epochs": walk.epoch_end_tokens(limits.max_epochs)})
    if limits.max_tokens is None and limits.max_steps is None and walk.epoch_end_tokens(limits.max_epochs) is None:
        return None, None  # nothing known ends the run: nothing to walk to
    if warmup is not None:
        end = walk.until_batch_constant(warmup, limits)
        if end is not None:
            return end
    return _first(walk.ends_at_constant_batch(limits))


def _first(ends: dict[str, int | None]) -> tuple[int | None, str | None]:
    """The smallest known end and its limit (the first named on a tie), or (None, None)."""
    known = [(tokens, name) for name, tokens in ends.items() if tokens is not None]
    if not known:
        return None, None
    tokens = min(tokens for tokens, _ in known)
    return tokens, next(name for end, name in known if end == tokens)


@dataclasses.dataclass(frozen=True)
class _Limits:
    """What ends the run (None: unset): tokens (global), optimizer steps, epochs; and the steps and
    epochs Lightning trains before it lets ``trainer.should_stop`` (the token budget's stop) end it."""

    max_tokens: int | None
    max_steps: int | None
    max_epochs: int | None
    min_steps: int
    min_epochs: int

    @classmethod
    def of(cls, trainer: pl.Trainer, accounting: BatchAccounting) -> _Limits:
        max_epochs = trainer.max_epochs  # Lightning made None 1000 (no max_steps) or -1 when fit started
        return cls(
            max_tokens=accounting.max_tokens,
            max_steps=trainer.max_steps if trainer.max_steps >= 0 else None,
            max_epochs=max_epochs if max_epochs is not None and max_epochs >= 0 else None,
            min_steps=trainer.min_steps or 0,
            min_epochs=trainer.min_epochs or 0,
        )


class _Walk:
    """The run from the start of its current optimizer step on: where it is (epochs processed,
    micro-batches of this epoch, optimizer steps, samples and tokens trained, all global) and what an
    epoch holds; it moves one step at a time, or counts many steps at a constant batch at once."""

    def __init__(self, trainer: pl.Trainer, accounting: BatchAccounting):
        self.micro = accounting.micro_batch_size
        self.data_parallel = accounting.data_parallel_size
        self.seq_len = accounting.seq_len
        self.accumulate = trainer.accumulate_grad_batches
        self.batches = trainer.num_training_batches or math.inf  # micro-batches per epoch and rank (inf: unknown)
        self.last = _last_micro_batch(trainer, self.micro, self.batches)
        # The accounting has counted every micro-batch Lightning made ready; those since the last step
        # (whose start is aligned to accumulate, as Lightning steps when ready % accumulate == 0) belong
        # to the current step.
        progress = trainer.fit_loop.epoch_loop.batch_progress.current
        epoch_done = progress.processed >= self.batches
        start = self.batches if epoch_done else self.accumulate * (progress.processed // self.accumulate)
        pending = self.samples(start, progress.ready)
        self.samples_seen = accounting.samples_seen - pending
        self.tokens_seen = accounting.tokens_seen - pending * self.seq_len
        self.epoch = trainer.current_epoch + epoch_done
        self.batch = 0 if epoch_done else start
        self.steps = trainer.global_step

    def samples(self, start: int, stop: int | float) -> int:
        """Global samples in micro-batches ``start`` to ``stop`` (exclusive) of an epoch."""
        short = self.micro - self.last if start < stop == self.batches else 0
        return int((stop - start) * self.micro - short) * self.data_parallel

    @property
    def epoch_tokens(self) -> int:
        return self.samples(0, self.batches) * self.seq_len

    def epoch_end_tokens(self, epochs: int | None) -> int | None:
        """Tokens trained when ``epochs`` epochs are done (None: ``epochs`` None or epochs of unknown length)."""
        if epochs is None or math.isinf(self.batches):
            return None
        if self.epoch >= epochs:
            return self.tokens_seen
        return self.tokens_seen + self.samples(self.batch, self.batches) * self.seq_len + (epochs - self.epoch - 1) * self.epoch_tokens

    # ------------------------------------------------------------------ while BatchWarmup may change the batch
    def until_batch_constant(self, warmup: BatchWarmup, limits: _Limits) -> tuple[int, str] | None:
        """Walk step by step, changing the accumulation where BatchWarmup will, until a limit ends the
        run (its end) or the schedule's batch can no longer change (None: count on at a constant batch)."""
        per_accumulation = self.micro * self.data_parallel  # samples of one micro-batch on every rank
        while True:
            end = self._limit_reached(limits)
            if end is not None:
                return self.tokens_seen, end
            consumed = self.tokens_seen if warmup.schedule.unit == "tokens" else self.samples_seen
            target = warmup.schedule.batch_size(consumed)
            if target == self.accumulate * per_accumulation and warmup.schedule.sizes(consumed) == [target]:
                return None
            self._step()
            if self.batch == self.batches:
                self.epoch, self.batch = self.epoch + 1, 0
            if limits.max_tokens is not None and self.tokens_seen >= limits.max_tokens:
                continue  # BatchWarmup changes nothing once the run is stopping
            consumed = self.tokens_seen if warmup.schedule.unit == "tokens" else self.samples_seen
            accumulate = warmup.schedule.batch_size(consumed) // per_accumulation
            if self.batch % accumulate == 0:  # at an epoch's start (batch 0) any accumulation fits
                self.accumulate = accumulate

    def _limit_reached(self, limits: _Limits) -> str | None:
        """The limit that stops the run here, between two steps (on a tie max_tokens, then max_steps), or None."""
        if (
            limits.max_tokens is not None
            and self.tokens_seen >= limits.max_tokens
            and self.steps >= limits.min_steps
            and self.epoch >= limits.min_epochs
        ):
            return "max_tokens"
        if limits.max_steps is not None and self.steps >= limits.max_steps:
            return "max_steps"
        if limits.max_epochs is not None and self.epoch >= limits.max_epochs:
            return "max_epochs"
        return None

    def _step(self) -> None:
        stop = min(self.batch + self.accumulate, self.batches)
        samples = self.samples(self.batch, stop)
        self.samples_seen += samples
        self.tokens_seen += samples * self.seq_len
        self.steps += 1
        self.batch = stop

    # ------------------------------------------------------------------ at a constant batch
    def tokens_after(self, steps: int) -> int:
        """Tokens trained after ``steps`` more optimizer steps at the current accumulation."""
        left_in_epoch = math.inf if math.isinf(self.batches) else -(-(self.batches - self.batch) // self.accumulate)
        if steps <= left_in_epoch:
            return self.tokens_seen + self.samples(self.batch, min(self.batch + steps * self.accumulate, self.batches)) * self.seq_len
        epochs, steps = divmod(steps - left_in_epoch, -(-self.batches // self.accumulate))
        tokens = self.tokens_seen + self.samples(self.batch, self.batches) * self.seq_len + epochs * self.epoch_tokens
        return tokens + self.samples(0, steps * self.accumulate) * self.seq_len

    def ends_at_constant_batch(self, limits: _Limits) -> dict[str, int | None]:
        """Each limit's end in tokens (None: unset or unknown), the accumulation staying as it is."""
        ends = {"max_tokens": None, "max_steps": None, "max_epochs": self.epoch_end_tokens(limits.max_epochs)}
        if limits.max_steps is not None:
            ends["max_steps"] = self.tokens_after(max(limits.max_steps - self.steps, 0))
        if limits.max_tokens is not None:
            # The first step that reaches the budget, held off until min_steps and min_epochs are done.
            reached = self.tokens_after(_first_reaching(self.tokens_after, limits.max_tokens))
            min_steps_done = self.tokens_after(max(limits.min_steps - self.steps, 0))
            ends["max_tokens"] = max(reached, min_steps_done, self.epoch_end_tokens(limits.min_epochs) or 0)
        return ends


def _first_reaching(tokens_after, budget: int) -> int:
    """The fewest steps after which ``tokens_after(steps)`` (increasing) reaches ``budget``."""
    high = 1
    while tokens_after(high) < budget:
        high *= 2
    return bisect.bisect_left(range(high + 1), budget, key=tokens_after)


def _last_micro_batch(trainer: pl.Trainer, micro: int, batches: int | float) -> int:
    """Samples per rank in an epoch's last micro-batch: fewer than ``micro`` when the train loader keeps
    a partial batch (``drop_last=False``) and its sampler's length says so; else ``micro``."""
    loader = trainer.train_dataloader
    if not isinstance(loader, DataLoader) or loader.drop_last or loader.batch_size != micro or math.isinf(batches):
        return micro
    length = sized_len(loader.batch_sampler.sampler) if hasattr(loader.batch_sampler, "sampler") else None
    if length is None:
        return micro
    last = min(batches * micro, length) - (batches - 1) * micro
    return last if 0 < last <= micro else micro
