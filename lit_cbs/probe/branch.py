"""A probe branch: train batch k*B on the main run's recorded window from its start, and score it.

``BranchTrainer.loss(window, k)``: input, a ``RecordedWindow`` (the start snapshot and the
micro-batches the main run trained on over the window) and a multiplier k; output, the branch's
loss, scored as the main run's window is (``BranchTrainer.score``). A branch runs inside the
Trainer without re-entering Lightning's loops: through the strategy's wrapped model (DDP/FSDP
reduce gradients as in training), the precision plugin's grad scaler and gradient clipping,
stepping the step-interval LR schedulers as the main run does.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import apply_to_collection, move_data_to_device

from lit_cbs._internals import block_ddp_gradient_sync
from lit_cbs.accounting import BatchAccounting, mean_over_ranks
from lit_cbs.lr_rules import LRRule, scale_learning_rate
from lit_cbs.lr_schedules import TokenLRScheduler
from lit_cbs.probe.reading import ema_last
from lit_cbs.probe.snapshot import TrainingSnapshot


class BranchFailed(Exception):
    """A branch diverged (non-finite loss) or ran out of memory; it counts as not recovered."""


class ProbeAborted(Exception):
    """SIGTERM arrived during a probe: the main state is restored and Lightning shuts down as usual."""


@dataclass
class RecordedWindow:
    """The main run's window since a probe point, as this rank trained it.

    Batches in samples, token counts global (all ranks), losses in nats.
    """

    tokens: int  # tokens seen at the window's start
    step: int  # optimizer steps taken at the window's start
    batch_size: int  # the global batch B
    accumulate: int  # micro-batches per rank and optimizer step at B
    micro_batch_size: int  # samples per micro-batch and rank
    data_parallel_size: int
    seq_len: int  # tokens per sample
    multipliers: list[float]  # the ks whose batch k*B fits this window
    window_samples: int  # samples every branch trains on (global; whole steps of the largest branch)
    start: TrainingSnapshot
    batches: list[Any] = field(default_factory=list)  # micro-batches as the main run trained on them
    step_losses: list[float] = field(default_factory=list)  # the main run's, one per optimizer step
    micro_losses: list[float] = field(default_factory=list)  # of the optimizer step in progress

    @property
    def window_tokens(self) -> int:
        return self.window_samples * self.seq_len

    @property
    def samples_per_rank(self) -> int:
        return self.window_samples // self.data_parallel_size

    @property
    def complete(self) -> bool:
        """Whether the main run has trained on the whole window."""
        return len(self.batches) * self.micro_batch_size >= self.samples_per_rank

    def record_batch(self, batch: Any, device: str | torch.device) -> None:
        """Keep a micro-batch the main run trains on, detached, on ``device``."""
        self.batches.append(move_data_to_device(apply_to_collection(batch, torch.Tensor, torch.Tensor.detach), device))

    def record_micro_loss(self, loss: float) -> None:
        self.micro_losses.append(loss)

    def end_step(self) -> None:
        """The optimizer step stepped: its loss is the mean of its micro-batches' losses."""
        self.step_losses.append(sum(self.micro_losses) / len(self.micro_losses))
        self.micro_losses = []


def loss_of(output: Any) -> torch.Tensor:
    """The loss tensor of a training_step's output (a tensor or a dict with "loss")."""
    loss = output["loss"] if isinstance(output, dict) else output
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"training_step must return a loss tensor or a dict with 'loss' for CBS probing, got {output!r}")
    return loss


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
def logging_muted(pl_module: pl.LightningModule):
    """Branches call the user's training_step; its self.log calls must not reach the main run's logs."""
    if "log" in vars(pl_module):  # already muted by an enclosing block
        yield
        return
    pl_module.log = lambda *args, **kwargs: None
    pl_module.log_dict = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del pl_module.log
        del pl_module.log_dict


@dataclass
class BranchTrainer:
    """Trains a probe's branches inside ``trainer`` and scores each like the main run's window.

    A window's loss (nats, the mean over ranks, so every rank reaches the same k*) is the EMA of its
    step losses at its last step (``evaluate="train_ema"``, the paper's) or the mean loss of the
    model at the window's end on ``heldout`` batches (``evaluate="heldout"``).
    """

    trainer: pl.Trainer
    pl_module: pl.LightningModule
    accounting: BatchAccounting
    lr_rule: LRRule  # LR factor (and optimizer adjustment) for batch ratio k
    evaluate: str
    ema_alpha: float  # weight of the newest step loss in the EMA
    heldout: list[Any] | None = None  # held-out batches for evaluate="heldout"

    def score(self, step_losses: list[float]) -> float:
        """The loss of a window this rank trained with ``step_losses``, the model now at its end."""
        if self.evaluate == "heldout":
            return self._heldout_loss()
        return ema_last(mean_over_ranks(self.trainer, step_losses), self.ema_alpha)

    def loss(self, window: RecordedWindow, k: float) -> float:
        """Train batch k*B over ``window`` from its start snapshot and score it. The model is left in
        the branch's end state.

        Raises:
            BranchFailed: a non-finite step loss on any rank, or out of memory.
            ProbeAborted: SIGTERM arrived on any rank.
        """
        try:
            step_losses = self._train(window, k)
        except RuntimeError as error:
            if is_out_of_memory(error):
                raise BranchFailed("out of memory") from error
            raise
        return self.score(step_losses)

    def _train(self, window: RecordedWindow, k: float) -> list[float]:
        """This rank's per-step losses (nats) of batch k*B (LR scaled by ``lr_rule`` for ratio k)."""
        trainer, strategy = self.trainer, self.trainer.strategy
        window.start.restore(trainer, self.pl_module)
        optimizers = trainer.optimizers
        schedulers = [c for c in trainer.lr_scheduler_configs if c.interval == "step" and not c.reduce_on_plateau]
        factor = self.lr_rule.lr_factor(k)
        for optimizer in optimizers:
            scale_learning_rate(optimizer, [c.scheduler for c in trainer.lr_scheduler_configs], factor)
            self.lr_rule.adjust_optimizer(optimizer, k)
        optimizer = optimizers[0]
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        micro_per_step = round(k * window.accumulate)
        batches = window.batches[: window.samples_per_rank // window.micro_batch_size]
        tokens_per_step = micro_per_step * window.micro_batch_size * window.data_parallel_size * window.seq_len
        tokens = window.tokens
        step_losses: list[float] = []
        self.pl_module.train()
        for start in range(0, len(batches) - micro_per_step + 1, micro_per_step):
            optimizer.zero_grad(set_to_none=True)
            total = torch.zeros((), dtype=torch.float64, device=strategy.root_device)
            for i in range(micro_per_step):
                last = i == micro_per_step - 1
                batch = move_data_to_device(batches[start + i], strategy.root_device)
                self.accounting.set_gradient_sync(last)
                with block_ddp_gradient_sync(strategy, block=not last):
                    loss = loss_of(strategy.training_step(batch, start + i))
                    scaled = loss / micro_per_step
                    (scaler.scale(scaled) if scaler is not None else scaled).backward()
                total += loss.detach()
            step_loss = total / micro_per_step
            if strategy.reduce_boolean_decision(not bool(torch.isfinite(step_loss)), all=False):
                raise BranchFailed(f"non-finite loss at branch step {len(step_losses)}")
            if scaler is not None:
                scaler.unscale_(optimizer)
            if trainer.gradient_clip_val:
                trainer.precision_plugin.clip_gradients(
                    optimizer, trainer.gradient_clip_val, trainer.gradient_clip_algorithm or "norm"
                )
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            tokens += tokens_per_step
            for config in schedulers:
                if isinstance(config.scheduler, TokenLRScheduler):
                    config.scheduler.tokens_seen = tokens
                config.scheduler.step()
            step_losses.append(float(step_loss))
            if strategy.reduce_boolean_decision(trainer.received_sigterm, all=False):
                raise ProbeAborted()
        return step_losses

    @torch.no_grad()
    def _heldout_loss(self) -> float:
        pl_module, trainer = self.pl_module, self.trainer
        was_training = pl_module.training
        pl_module.eval()
        total = 0.0
        with logging_muted(pl_module), trainer.precision_plugin.forward_context():
            for i, batch in enumerate(self.heldout):
                batch = move_data_to_device(batch, trainer.strategy.root_device)
                total += float(loss_of(pl_module.training_step(batch, i)))
        pl_module.train(was_training)
        return mean_over_ranks(trainer, [total / len(self.heldout)])[0]
