"""A probe branch: train batch k*B on the main run's recorded window from its start, and score it.

``BranchTrainer.loss(window, k)``: input, a ``RecordedWindow`` (the start snapshot and the
micro-batches the main run trained on over the window) and a multiplier k; output, the branch's
``BranchScore``, scored as the main run's window is (``BranchTrainer.score``). The window's samples
are regrouped into the branch's own micro-batches (``micro_batch_for(k)``: with a BatchWarmup that
grows the micro-batch, the one it would train batch k*B with), so a branch trains as fast as the
main run would at its batch, and the main run's micro-batch may change inside the window.

A branch runs inside the Trainer without re-entering Lightning's loops, but through the same hooks
a training step goes through: the module's ``optimizer_zero_grad``, ``training_step`` (through the
strategy's wrapped model, so DDP/FSDP reduce gradients as in training), ``backward`` (with
``on_before_backward``/``on_after_backward`` and the precision plugin's loss scaling),
``optimizer_step`` (the precision plugin's unscaling, ``on_before_optimizer_step`` and
``configure_gradient_clipping``) and ``lr_scheduler_step``. Callbacks are hidden from branches:
none of them (gradient noise scale, LR monitor, checkpointing, the user's) sees a branch step.

A failure in a branch is agreed across ranks before any rank goes on, so that no rank is left
waiting in a collective the others never reach: out of memory on any rank fails the branch on all
(the probe goes on with the next k); any other exception aborts the probe on all ranks and is
raised again.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import apply_to_collection, move_data_to_device
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.model_helpers import is_overridden

from lit_cbs._internals import block_ddp_gradient_sync, tree_leaves, tree_map
from lit_cbs.callbacks.accounting import BatchAccounting, loss_of, mean_over_ranks
from lit_cbs.callbacks.checkpoint import stop_signal
from lit_cbs.callbacks.module_state import logging_muted, side_effects_undone
from lit_cbs.errors import LitCBSConfigError
from lit_cbs.probe.limits import known
from lit_cbs.probe.reading import BranchScore, measure_losses
from lit_cbs.probe.snapshot import TrainingSnapshot
from lit_cbs.rules.lr_schedules import TokenLRScheduler
from lit_cbs.rules.scaling import OptimizerRules

if TYPE_CHECKING:
    from lightning.pytorch.core.optimizer import LightningOptimizer

    from lit_cbs.callbacks.warmup import BatchWarmup

__all__ = ["BranchError", "BranchFailed", "BranchTrainer", "ProbeAborted", "RecordedWindow"]


class BranchFailed(Exception):
    """A branch diverged (non-finite loss) or ran out of memory on some rank; it counts as not recovered.

    Examples:
        >>> from lit_cbs.probe.reading import BranchScore
        >>> try:
        ...     raise BranchFailed("non-finite loss at branch step 3")
        ... except BranchFailed:
        ...     score = BranchScore(float("inf"))  # what BranchMeasurer records for that k
        >>> score.failed
        True
    """


class ProbeAborted(Exception):
    """A stop signal arrived during a probe: the main state is restored and the run stops at that step.

    Examples:
        >>> issubclass(ProbeAborted, BranchFailed)  # not a failed branch: no reading at all
        False
    """


class ProbeUnusable(Exception):
    """The run cannot be probed as it is (its ``optimizer_step`` writes the LR a branch must train at):
    no reading can mean anything, now or at a later probe point."""


class BranchError(RuntimeError):
    """Another rank raised inside a probe branch; this rank stops with it (the probe is aborted everywhere).

    Examples:
        >>> str(BranchError("another rank raised inside a CBS probe branch (its log has the error); probe aborted"))
        'another rank raised inside a CBS probe branch (its log has the error); probe aborted'
    """


class _ProbeLossModule(Protocol):
    """A module with the optional ``probe_loss(batch)`` hook ``HeldoutLoss`` prefers."""

    def probe_loss(self, batch: Any) -> Any: ...


def _module_optimizer(pl_module: pl.LightningModule) -> LightningOptimizer:
    """The module's optimizer as its ``optimizer_step`` receives it: one, under the automatic optimization a
    probe requires (Lightning refuses more there)."""
    optimizer = pl_module.optimizers()
    assert not isinstance(optimizer, list), "automatic optimization has a single optimizer"
    return optimizer


@dataclass
class BranchProgress:
    """A branch trained over the first ``steps`` steps of a window, kept to be trained on from there
    (a window that ends early if the reading is decided: ``CBSProbeCallback(early_stop=...)``)."""

    state: TrainingSnapshot  # the branch's training state after `steps` steps
    step_losses: list[float]  # this rank's, one per step
    steps: int


@dataclass
class RecordedWindow:
    """The main run's window since a probe point, as this rank trained it.

    Batches in samples, token counts global (all ranks), losses in nats.

    Args:
        tokens: tokens seen at the window's start.
        step: optimizer steps taken at the window's start.
        batch_size: the global batch B (samples).
        accumulate: micro-batches per rank and optimizer step at B.
        micro_batch_size: samples per micro-batch and rank at the window's start.
        data_parallel_size: ranks that read their own micro-batches.
        seq_len: tokens per sample.
        multipliers: the ks whose batch k*B fits this window.
        window_samples: samples every branch trains on (global; whole steps of the largest branch).
        start: the snapshot every branch starts from.
        replicates: disjoint windows of ``window_samples`` recorded one after the other, each trained from ``start``.
        batches: micro-batches as the main run trained on them (filled by ``record_batch``).
        recorded_samples: samples per rank in ``batches``.
        step_losses: the main run's loss (nats), one per optimizer step.
        micro_losses: the micro-batch losses (nats) of the optimizer step in progress.
        early_stop_samples: samples (per rank) where the probe may end early.
        progress: branches trained up to an early-stop point, by k.
        interrupted_at_tokens: this probe was stopped once; its first window began there (tokens).

    Examples:
        A window of 8 samples of 8 tokens at batch 4 (2 micro-batches of 2), recorded and regrouped for the
        k = 2 branch (``start``, the snapshot branches begin from, is not needed here):

        >>> import torch
        >>> window = RecordedWindow(tokens=0, step=0, batch_size=4, accumulate=2, micro_batch_size=2,
        ...     data_parallel_size=1, seq_len=8, multipliers=[1.0, 2.0], window_samples=8, start=None)
        >>> for i in range(4):
        ...     window.record_batch(torch.full((2, 8), i), "cpu")
        >>> window.recorded_samples, window.complete, window.window_tokens
        (8, True, 64)
        >>> window.step_samples(2.0)  # samples per rank in one step of batch 2 x 4
        8
        >>> [batch[:, 0].tolist() for batch in window.micro_batches(4, 8)]  # micro-batches of 4 samples
        [[0, 0, 1, 1], [2, 2, 3, 3]]
    """

    tokens: int  # tokens seen at the window's start
    step: int  # optimizer steps taken at the window's start
    batch_size: int  # the global batch B
    accumulate: int  # micro-batches per rank and optimizer step at B
    micro_batch_size: int  # samples per micro-batch and rank at the window's start
    data_parallel_size: int
    seq_len: int  # tokens per sample
    multipliers: list[float]  # the ks whose batch k*B fits this window
    window_samples: int  # samples every branch trains on (global; whole steps of the largest branch)
    start: TrainingSnapshot
    replicates: int = 1  # disjoint windows of window_samples recorded one after the other, each trained from `start`
    batches: list[Any] = field(default_factory=list)  # micro-batches as the main run trained on them
    recorded_samples: int = 0  # samples per rank in `batches`
    step_losses: list[float] = field(default_factory=list)  # the main run's, one per optimizer step
    micro_losses: list[float] = field(default_factory=list)  # of the optimizer step in progress
    early_stop_samples: list[int] = field(default_factory=list)  # samples (per rank) where the probe may end early
    progress: dict[float, BranchProgress] = field(default_factory=dict)  # branches trained up to an early-stop point
    interrupted_at_tokens: int | None = None  # this probe was stopped once; its first window began there

    @property
    def window_tokens(self) -> int:
        """Tokens (global) of one replicate's window."""
        return self.window_samples * self.seq_len

    @property
    def samples_per_rank(self) -> int:
        """Samples of one replicate's window on each rank."""
        return self.window_samples // self.data_parallel_size

    @property
    def complete(self) -> bool:
        """Whether the main run has trained on every replicate's window."""
        return self.recorded_samples >= self.samples_per_rank * self.replicates

    @property
    def first_window_complete(self) -> bool:
        """Whether the main run has just finished the first replicate's window (of 2 or more)."""
        return self.replicates > 1 and self.recorded_samples == self.samples_per_rank

    @property
    def at_early_stop(self) -> bool:
        """Whether the main run has just reached a point where the probe may end early."""
        return self.recorded_samples in self.early_stop_samples

    def tokens_of(self, samples_per_rank: int) -> int:
        """Tokens (global) in ``samples_per_rank`` samples of every rank.

        Args:
            samples_per_rank: samples on each rank.

        Returns:
            Their tokens over all ranks.
        """
        return samples_per_rank * self.data_parallel_size * self.seq_len

    def step_samples(self, k: float) -> int:
        """Samples per rank in one step of batch k*B.

        Args:
            k: the batch multiplier.

        Returns:
            round(k * B) / ranks, in samples.
        """
        return round(k * self.batch_size) // self.data_parallel_size

    def record_batch(self, batch: Any, device: str | torch.device) -> None:
        """Keep a micro-batch the main run trains on, detached, on ``device``.

        Args:
            batch: the micro-batch (tensors, or collections of them, samples along dim 0).
            device: where it is kept (``ProbeConfig.snapshot_device``).
        """
        self.batches.append(move_data_to_device(apply_to_collection(batch, torch.Tensor, torch.Tensor.detach), device))
        self.recorded_samples += extract_batch_size(batch)

    def micro_batches(self, size: int, samples: int, offset: int = 0) -> list[Any]:
        """``samples`` recorded samples (per rank) from the ``offset``-th on, as micro-batches of ``size``:
        the recorded ones where they have that size, else cut anew from them along dim 0.

        Args:
            size: samples per micro-batch (per rank).
            samples: samples wanted (per rank); whole micro-batches of ``size`` are given.
            offset: recorded samples (per rank) skipped first: where a replicate's window begins.

        Returns:
            ``samples // size`` micro-batches.

        Raises:
            LitCBSConfigError: regrouping is needed but the batches are not tensors with samples along dim 0.
        """
        needed = samples // size
        first, seen = 0, 0
        while seen < offset and first < len(self.batches):
            seen += extract_batch_size(self.batches[first])
            first += 1
        chosen = self.batches[first : first + needed]
        if seen == offset and len(chosen) == needed and all(extract_batch_size(batch) == size for batch in chosen):
            return chosen
        if any(not isinstance(leaf, torch.Tensor) for leaf in tree_leaves(self.batches[0])):
            raise LitCBSConfigError(
                "CBSProbeCallback regroups the recorded batches into micro-batches of another size, which needs "
                "batches of tensors (or collections of them) with the samples along dim 0"
            )
        joined = tree_map(lambda *leaves: torch.cat(leaves), *self.batches)
        return [
            tree_map(lambda leaf, first=first: leaf[first : first + size], joined)
            for first in range(offset, offset + needed * size, size)
        ]

    def record_micro_loss(self, loss: float) -> None:
        """Keep a micro-batch's loss (nats) of the optimizer step in progress.

        Args:
            loss: the micro-batch's loss (nats).
        """
        self.micro_losses.append(loss)

    def end_step(self) -> None:
        """The optimizer step stepped: its loss is the mean of its micro-batches' losses."""
        self.step_losses.append(sum(self.micro_losses) / len(self.micro_losses))
        self.micro_losses = []


def is_out_of_memory(error: BaseException) -> bool:
    """An allocation failure: torch.OutOfMemoryError from an accelerator's caching allocator; the CPU
    allocator's refusal, which torch raises as a plain RuntimeError (a c10::Error without a type of
    its own, so only its message tells it from other errors); or a CUDA API call that ran out of
    memory outside the caching allocator (cuBLAS workspaces, NCCL buffers), raised with CUDA's text."""
    message = str(error)
    return (
        isinstance(error, torch.OutOfMemoryError)
        or "DefaultCPUAllocator: can't allocate memory" in message
        or "CUDA error: out of memory" in message
    )


@contextlib.contextmanager
def callbacks_hidden(trainer: pl.Trainer):
    """No callback hook runs inside: branch steps are not the run's steps. Only ``BatchAccounting``
    stays (its step hook does nothing in a branch), so that ``BatchAccounting.attach(trainer).in_branch``
    can be read."""
    # trainer.callbacks is set by Lightning's callback connector, undeclared on Trainer: hence the ignores
    callbacks = trainer.callbacks  # type: ignore[attr-defined]
    trainer.callbacks = [c for c in callbacks if isinstance(c, BatchAccounting)]  # type: ignore[attr-defined]
    try:
        yield
    finally:
        trainer.callbacks = callbacks  # type: ignore[attr-defined]


LR_TRIAL_FACTOR = 0.5  # the LRs an optimizer_step trial starts from, relative to the run's


def optimizer_step_writes_lr(trainer: pl.Trainer, pl_module: pl.LightningModule, batch_idx: int) -> str | None:
    """Try the module's own ``optimizer_step`` once, on a copy of the run's state: with every group's LR
    at ``LR_TRIAL_FACTOR`` x its own and zero gradients (no backward runs). Returns what it wrote if
    it set an LR itself (no probe branch could then train at lr_rule(k) x the LR), else None. What
    the step changed (weights, optimizer and scheduler state, RNG, metrics) is put back
    (``TrainingSnapshot``), the gradients are as before, and no callback sees it."""
    if not is_overridden("optimizer_step", pl_module):
        return None
    accounting = BatchAccounting.attach(trainer)
    snapshot = TrainingSnapshot(trainer, pl_module, "cpu")
    saved = [[group["lr"] for group in optimizer.param_groups] for optimizer in trainer.optimizers]
    parameters = [parameter for parameter in pl_module.parameters() if parameter.requires_grad]
    gradients = [parameter.grad for parameter in parameters]
    written = None
    try:
        for parameter in parameters:
            parameter.grad = torch.zeros_like(parameter)  # every optimizer steps on them (some refuse none at all)
        for optimizer, lrs in zip(trainer.optimizers, saved):
            for group, lr in zip(optimizer.param_groups, lrs):
                group["lr"] = lr * LR_TRIAL_FACTOR
        with accounting.branching(), callbacks_hidden(trainer), logging_muted(pl_module):
            pl_module.optimizer_step(
                trainer.current_epoch,
                batch_idx,
                _module_optimizer(pl_module),
                lambda: torch.zeros((), device=trainer.strategy.root_device),
            )
        for optimizer, lrs in zip(trainer.optimizers, saved):
            for group, lr in zip(optimizer.param_groups, lrs):
                if written is None and group["lr"] != lr * LR_TRIAL_FACTOR:
                    written = f"{group['lr']:.4g} where it was given {lr * LR_TRIAL_FACTOR:.4g}"
    finally:
        snapshot.restore(trainer, pl_module)  # the param groups too: the LRs are the run's again
        for parameter, gradient in zip(parameters, gradients):
            parameter.grad = gradient
    return written


def cooldown_factor(step: int, steps: int, cooldown_steps: int) -> float:
    """The LR factor of a branch's ``step`` (0-based) of ``steps``: 1, then over the last
    ``cooldown_steps`` a linear decay towards 0 (1 - 1/(c+1), ..., 1 - c/(c+1))."""
    if step < steps - cooldown_steps:
        return 1.0
    return 1.0 - (step - (steps - cooldown_steps) + 1) / (cooldown_steps + 1)


@contextlib.contextmanager
def lr_scaled_for_step(optimizers: list[torch.optim.Optimizer], factor: float, k: float):
    """Every param group's LR times ``factor`` for the one step run inside (a branch's cooldown), then
    the LRs as they were. The step must leave the LR where it was set: a module whose optimizer_step
    writes it makes the run unprobeable (``ProbeUnusable``), as no branch k would train at
    lr_rule(k) x the run's LR."""
    saved = [[group["lr"] for group in optimizer.param_groups] for optimizer in optimizers]
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] *= factor
    yield
    for optimizer, lrs in zip(optimizers, saved):
        for group, lr in zip(optimizer.param_groups, lrs):
            if group["lr"] != lr * factor:
                raise ProbeUnusable(
                    f"the module's optimizer_step set the learning rate inside a probe branch "
                    f"({group['lr']:.4g} where the k={k:g} branch trains at {lr * factor:.4g}), so no branch trains at "
                    "lr_rule(k) x the run's LR: set the LR with an LR scheduler (configure_optimizers, "
                    "TokenLRScheduler) instead of writing param_groups in optimizer_step"
                )
            group["lr"] = lr


class HeldoutLoss:
    """The module's loss on one held-out batch, with no side effect on the module.

    Uses, in this order: the module's ``probe_loss(batch)`` if it has one; its ``validation_step``
    if overridden and it returns a loss (a tensor or a dict with "loss"); else its
    ``training_step``. Whichever runs, torchmetrics states, RNG streams and logs are left as they
    were (``side_effects_undone``), in eval mode without gradients.
    """

    def __init__(self, pl_module: pl.LightningModule):
        self.pl_module = pl_module
        if callable(getattr(pl_module, "probe_loss", None)):
            self.hook = "probe_loss"
        elif is_overridden("validation_step", pl_module):
            self.hook = "validation_step"
        else:
            self.hook = "training_step"

    def __call__(self, batch: Any, index: int) -> torch.Tensor:
        module = self.pl_module
        if self.hook == "probe_loss":
            return loss_of(cast(_ProbeLossModule, module).probe_loss(batch), "probe_loss")
        if self.hook == "validation_step":
            output = module.validation_step(batch, index)
            if isinstance(output, torch.Tensor) or (isinstance(output, dict) and "loss" in output):
                return loss_of(output, "validation_step")
            self.hook = "training_step"  # it returns no loss: its training_step is the loss
        return loss_of(module.training_step(batch, index))


@dataclass
class BranchTrainer:
    """Trains a probe's branches inside ``trainer`` and scores each like the main run's window.

    A window's score (nats, the mean over ranks, so every rank reaches the same k*) is the EMA of
    its step losses at its last step (``evaluate="train_ema"``, the paper's) or the model's loss at
    the window's end on each ``heldout`` batch (``evaluate="heldout"``).

    Args:
        trainer: the Trainer whose fit the probe runs in (its strategy, optimizers and schedulers).
        pl_module: the module the branches train.
        accounting: the Trainer's ``BatchAccounting``.
        rules: how the LR (and weight decay, betas) move for batch ratio k.
        evaluate: "train_ema" or "heldout".
        ema_alpha: weight in (0, 1] of the newest step loss in the EMA.
        micro_batch_for: samples per rank in a micro-batch of branch k (None: k*B is no whole number of them).
        heldout: the held-out batches of ``evaluate="heldout"``.
        cooldown_fraction: share in [0, 1) of a branch's last steps over which its LR decays towards 0.
        tokens_trained: tokens (global) of every branch step taken so far (it counts on from there).

    ``CBSProbeCallback`` and ``probe_checkpoint`` make one inside a fit; it needs a Trainer whose strategy,
    optimizers and ``BatchAccounting`` are set up, as they are after a fit of one step.

    Examples:
        A tiny LM fitted for one step, then a window of 8 samples (2 steps at B = 4) trained at k = 1 (2 steps
        of 4 samples) and k = 2 (1 step of 8), each from the window's start snapshot:

        >>> import math, lightning.pytorch as pl, torch
        >>> from lit_cbs.callbacks import BatchAccounting
        >>> from lit_cbs.data import RandomTokenData
        >>> from lit_cbs.models import CausalLM
        >>> from lit_cbs.probe import BranchTrainer, RecordedWindow, TrainingSnapshot
        >>> from lit_cbs.rules.scaling import OptimizerRules
        >>> _ = torch.manual_seed(0)
        >>> lm = CausalLM({"vocab_size": 32, "d_model": 16, "n_layers": 1, "n_heads": 2, "mlp_hidden": 32,
        ...                "context_length": 8, "tie_embeddings": True})
        >>> data = RandomTokenData(vocab_size=32, seq_len=8, batch_size=4, samples=16)
        >>> accounting = BatchAccounting(seq_len=8)
        >>> trainer = pl.Trainer(accelerator="cpu", max_steps=1, callbacks=[accounting], logger=False,
        ...     enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
        >>> trainer.fit(lm, data)
        >>> window = RecordedWindow(tokens=accounting.tokens_seen, step=trainer.global_step, batch_size=4,
        ...     accumulate=1, micro_batch_size=4, data_parallel_size=1, seq_len=8, multipliers=[1.0, 2.0],
        ...     window_samples=8, start=TrainingSnapshot(trainer, lm))
        >>> for batch in list(data.train_dataloader())[:2]:
        ...     window.record_batch(batch, "cpu")
        >>> branches = BranchTrainer(trainer, lm, accounting, OptimizerRules.build("sqrt"), evaluate="train_ema",
        ...     ema_alpha=0.5, micro_batch_for=lambda k: 4)
        >>> score = branches.loss(window, 1.0)
        >>> branches.tokens_trained  # 2 steps x 4 samples x 8 tokens
        64
        >>> score.failed, abs(score.loss - math.log(32)) < 0.3  # still near ln(vocab_size) nats
        (False, True)
        >>> _ = branches.loss(window, 2.0)
        >>> branches.tokens_trained  # and 1 step x 8 samples x 8 tokens
        128
    """

    trainer: pl.Trainer
    pl_module: pl.LightningModule
    accounting: BatchAccounting
    rules: OptimizerRules  # how the LR (and weight decay, betas) move for batch ratio k
    evaluate: str
    ema_alpha: float  # weight of the newest step loss in the EMA
    micro_batch_for: Callable[[float], int | None]  # samples per rank in a micro-batch of branch k (None: none fits)
    heldout: list[Any] | None = None  # held-out batches for evaluate="heldout"
    cooldown_fraction: float = 0.0  # share of a branch's last steps over which its LR decays towards 0
    tokens_trained: int = 0  # tokens (global) of every branch step taken so far

    def __post_init__(self):
        self._heldout_loss = HeldoutLoss(self.pl_module)

    def score(self, step_losses: list[float]) -> BranchScore:
        """The score of a window this rank trained with ``step_losses``, the model now at its end.

        Args:
            step_losses: this rank's loss at each optimizer step of the window (nats).

        Returns:
            The score, the same on every rank: the EMA of the step losses averaged over ranks, with an SE from
            their scatter ("train_ema"), or the loss on each held-out batch averaged over ranks ("heldout").
        """
        if self.evaluate == "heldout":
            return BranchScore.heldout(mean_over_ranks(self.trainer, self._agreed(self._local_heldout_losses)))
        return BranchScore.train_ema(mean_over_ranks(self.trainer, step_losses), self.ema_alpha)

    def loss(self, window: RecordedWindow, k: float, keep: bool = False, replicate: int = 0) -> BranchScore:
        """Train batch k*B over the micro-batches ``window`` has recorded so far (of its ``replicate``-th
        window of data), from its start snapshot (or from where this branch stopped at an earlier
        early-stop point), and score it. The model is left in the branch's end state; ``keep`` saves that
        state in ``window.progress``.

        Args:
            window: the main run's recorded window.
            k: the batch multiplier of the branch.
            keep: keep the branch's end state to train on from there (an early-stop point).
            replicate: which replicate window of data (0: the first).

        Returns:
            The branch's score (``score``).

        Raises:
            BranchFailed: a non-finite step loss, or out of memory, on any rank.
            BranchError: another rank raised; this rank's own exception is raised as it is.
            ProbeAborted: SIGTERM arrived on any rank.
        """
        with callbacks_hidden(self.trainer):
            step_losses = self._train(window, k, keep, replicate)
            return self.score(step_losses)

    def _agreed(self, work):
        """Run ``work`` on every rank and agree on whether it failed anywhere; raise on every rank if so."""
        error = None
        try:
            result = work()
        except (BranchFailed, ProbeAborted):
            raise
        except Exception as caught:  # noqa: BLE001 - every exception is agreed, then raised again
            error, result = caught, None
        flags = mean_over_ranks(
            self.trainer,
            [
                float(error is not None and is_out_of_memory(error)),
                float(error is not None and not is_out_of_memory(error)),
            ],
        )
        if flags[1] > 0:
            if error is not None:
                raise error
            raise BranchError("another rank raised inside a CBS probe branch (its log has the error); probe aborted")
        if flags[0] > 0:
            raise BranchFailed("out of memory") from error
        return result

    def _train(self, window: RecordedWindow, k: float, keep: bool, replicate: int) -> list[float]:
        """This rank's per-step losses (nats) of batch k*B (the optimizer moved by ``rules`` for ratio k)."""
        trainer, strategy, module = self.trainer, self.trainer.strategy, self.pl_module
        step_samples, micro = window.step_samples(k), self.micro_batch_for(k)
        assert micro is not None, "only multipliers whose batch is whole micro-batches train"
        micro_per_step = step_samples // micro
        progress = window.progress.pop(k, None)
        if progress is not None:
            progress.state.restore(trainer, module)
        else:
            window.start.restore(trainer, module)
            for opt in trainer.optimizers:
                self.rules.apply(
                    opt,
                    [c.scheduler for c in trainer.lr_scheduler_configs],
                    k,
                    warn=lambda why: rank_zero_warn(f"CBSProbeCallback, branch k={k:g}: {why}"),
                )
        schedulers = [c for c in trainer.lr_scheduler_configs if c.interval == "step" and not c.reduce_on_plateau]
        offset = replicate * window.samples_per_rank
        steps = min(window.recorded_samples - offset, window.samples_per_rank) // step_samples
        batches = window.micro_batches(micro, steps * step_samples, offset)
        cooldown_steps = round(self.cooldown_fraction * steps)
        tokens_per_step = window.tokens_of(step_samples)
        first_step = progress.steps if progress is not None else 0
        tokens = window.tokens + first_step * tokens_per_step
        step_losses: list[float] = list(progress.step_losses) if progress is not None else []
        module.train()
        for step in range(first_step, steps):
            first = step * micro_per_step
            with lr_scaled_for_step(trainer.optimizers, cooldown_factor(step, steps, cooldown_steps), k):
                self._step(step, first, batches[first : first + micro_per_step], step_losses)
            tokens += tokens_per_step
            self.tokens_trained += tokens_per_step
            for config in schedulers:
                if isinstance(config.scheduler, TokenLRScheduler):
                    config.scheduler.tokens_seen = tokens
                module.lr_scheduler_step(config.scheduler, None)
            stopping = trainer.received_sigterm or stop_signal(trainer) is not None
            if strategy.reduce_boolean_decision(stopping, all=False):
                raise ProbeAborted()
        # LightningOptimizer wraps the Optimizer Lightning's hook annotation names (zero_grad delegated to it)
        module.optimizer_zero_grad(trainer.current_epoch, steps, _module_optimizer(module))  # type: ignore[arg-type]
        if keep:
            window.progress[k] = BranchProgress(
                TrainingSnapshot(trainer, module, window.start.device), step_losses, steps
            )
        return step_losses

    def _step(self, step: int, first: int, batches: list[Any], step_losses: list[float]) -> None:
        """One optimizer step of a branch, through the module's hooks: zero the gradients, then its
        ``optimizer_step``, whose closure (``_forward_backward``) runs the step's micro-batches
        (``first``: the index of the first among the branch's) and appends the step's loss to ``step_losses``."""
        trainer, module = self.trainer, self.pl_module
        optimizer = _module_optimizer(module)  # the LightningOptimizer the module's optimizer_step receives
        closure = functools.partial(self._forward_backward, first, batches, step_losses)
        # LightningOptimizer wraps the Optimizer Lightning's hook annotation names (zero_grad delegated to it)
        zero_grad = module.optimizer_zero_grad
        self._agreed(functools.partial(zero_grad, trainer.current_epoch, step, optimizer))  # type: ignore[arg-type]
        self._agreed(functools.partial(module.optimizer_step, trainer.current_epoch, step, optimizer, closure))

    def _forward_backward(self, first: int, batches: list[Any], step_losses: list[float]) -> torch.Tensor:
        """The closure of a branch step: each micro-batch's training_step and backward (gradients
        synchronised on the last only), its loss the mean of theirs (nats). A failure is agreed across
        ranks (``_agreed``); a non-finite loss on any rank fails the branch (``BranchFailed``)."""
        trainer, strategy = self.trainer, self.trainer.strategy
        raw_optimizer = trainer.optimizers[0]
        count = len(batches)
        total = torch.zeros((), dtype=torch.float64, device=strategy.root_device)
        for i, batch in enumerate(batches):
            last = i == count - 1
            batch = move_data_to_device(batch, strategy.root_device)
            self.accounting.set_gradient_sync(last)
            with block_ddp_gradient_sync(strategy, block=not last):
                loss = self._agreed(functools.partial(self._training_loss, batch, first + i))
                self._agreed(functools.partial(strategy.backward, loss / count, raw_optimizer))
            total += loss.detach()
        self.accounting.step_tokens.rescale(trainer, raw_optimizer, count)  # token_mean_loss
        step_loss = total / count
        if strategy.reduce_boolean_decision(not bool(torch.isfinite(step_loss)), all=False):
            raise BranchFailed(f"non-finite loss at branch step {len(step_losses)}")
        step_losses.append(float(step_loss))
        return step_loss

    def _training_loss(self, batch: Any, index: int) -> torch.Tensor:
        """The module's training_step loss on one micro-batch, through the strategy's wrapped model."""
        return loss_of(self.trainer.strategy.training_step(batch, index))

    @torch.no_grad()
    def _local_heldout_losses(self) -> list[float]:
        """The model's loss (nats) on each of this rank's held-out batches; no side effects."""
        trainer, heldout = self.trainer, self.heldout
        assert heldout is not None, "evaluate='heldout' loads the held-out batches"
        losses = []
        with side_effects_undone(self.pl_module), trainer.precision_plugin.forward_context():
            self.pl_module.eval()
            for i, batch in enumerate(heldout):
                # As Lightning prepares a batch: the precision's input conversion and the module's
                # on_before_batch_transfer / transfer_batch_to_device / on_after_batch_transfer.
                batch = trainer.strategy.batch_to_device(trainer.precision_plugin.convert_input(batch))
                losses.append(float(self._heldout_loss(batch, i)))
        return losses


def branch_micro_batch(
    k: float, batch_size: int, accounting: BatchAccounting, warmup: BatchWarmup | None
) -> int | None:
    """Samples per rank in a micro-batch of branch k at the main batch ``batch_size`` (samples): the one
    ``warmup`` would train batch k*B with (with ``max_micro_batch_size``), else the main run's; None where k*B is
    no whole number of such micro-batches on every rank."""
    branch, ranks = k * batch_size, accounting.data_parallel_size
    if abs(branch - round(branch)) > 1e-9 or round(branch) % ranks:
        return None
    if warmup is not None and warmup.max_micro_batch_size is not None:
        return warmup.micro_batch_for(round(branch))
    micro = known(accounting.micro_batch_size, "BatchAccounting.micro_batch_size")
    return micro if (round(branch) // ranks) % micro == 0 else None


def no_baseline() -> BranchScore | None:
    """k = 1 has no score of the main run's to take: it trains as a branch."""
    return None


@dataclass
class BranchMeasurer:
    """The scores a probe's search asks for, each multiplier over every replicate window of data.

    ``train(k, replicate)`` trains branch k on that window and scores it (raising ``BranchFailed`` when it
    diverges or runs out of memory); ``baseline()`` is the main run's own score over the first window, which
    is k = 1's there (None: k = 1 trains as a branch). A failed window fails k, which counts as not
    recovered. ``trained`` and ``failed`` gather over calls (a window judged early is measured again on more
    data); a k is measured once per measurer.
    """

    train: Callable[..., BranchScore]  # train(k, replicate=r)
    replicates: int
    baseline: Callable[[], BranchScore | None] = no_baseline
    trained: list[float] = field(default_factory=list)  # multipliers trained as branches, once per data window
    failed: list[float] = field(default_factory=list)
    measured: dict[float, BranchScore] = field(default_factory=dict)

    def score(self, k: float) -> BranchScore:
        """k's score over every replicate window (inf if one failed)."""
        if k not in self.measured:
            windows = []
            for replicate in range(self.replicates):
                if k in self.failed:
                    break
                windows.append(self._window(k, replicate))
            self.measured[k] = BranchScore(math.inf) if k in self.failed else BranchScore.replicated(windows)
        return self.measured[k]

    def _window(self, k: float, replicate: int) -> BranchScore:
        if k == 1.0 and replicate == 0:
            main = self.baseline()
            if main is not None:
                return main
        if replicate > 0 or k not in self.trained:
            self.trained.append(k)
        try:
            return self.train(k, replicate=replicate)
        except BranchFailed as error:
            rank_zero_warn(f"CBS probe branch k={k:g} failed ({error}); counted as not recovered")
            self.failed.append(k)
            return BranchScore(math.inf)

    def scores(self, search: str, multipliers: Sequence[float], epsilon: float) -> dict[float, BranchScore]:
        """The score of every k ``search`` ("grid" or "bisect") needs over ``multipliers`` (``measure_losses``)."""
        return measure_losses(search, multipliers, self.score, epsilon)
