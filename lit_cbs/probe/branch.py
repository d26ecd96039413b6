"""A probe branch: batch k*B trained from the window's start over the recorded window through the module's hooks."""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.loops.utilities import _block_parallel_sync_behavior
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning_utilities.core.apply_func import apply_to_collection

from lit_cbs._internals import tree_leaves, tree_map
from lit_cbs.callbacks.accounting import BatchAccounting, loss_of, mean_over_ranks
from lit_cbs.callbacks.checkpoint import stop_signal
from lit_cbs.callbacks.module_state import ModuleState, side_effects_undone
from lit_cbs.errors import LitCBSConfigError
from lit_cbs.probe.reading import BranchScore
from lit_cbs.rules.lr_schedules import TokenLRScheduler

if TYPE_CHECKING:
    from lightning.pytorch.core.optimizer import LightningOptimizer

    from lit_cbs.callbacks.warmup import BatchWarmup
    from lit_cbs.probe.engine import ProbeConfig, ProbePoint

__all__: list[str] = []  # the probe's own parts

T = TypeVar("T")


def known(value: T | None, what: str) -> T:
    """``value``, a count ``BatchAccounting`` learns at the first batch; RuntimeError naming ``what`` before."""
    if value is None:
        raise RuntimeError(f"{what} is not known yet: it is read before the first training batch told it")
    return value


class BranchFailed(Exception):
    """A branch diverged (non-finite loss) or ran out of memory on some rank: it counts as not recovered."""


class ProbeAborted(Exception):
    """A stop signal arrived during a probe: the main state is restored and the run stops at that step."""


class ProbeUnusable(Exception):
    """The run cannot be probed: its ``optimizer_step`` writes the LR a branch must train at (``written``: which)."""

    def __init__(self, written: str):
        super().__init__(
            f"the module's optimizer_step set the learning rate inside a probe branch ({written}), so no branch trains "
            "at lr_rule(k) x the run's LR: set the LR with an LR scheduler (configure_optimizers, TokenLRScheduler) "
            "instead of writing param_groups in optimizer_step"
        )
        self.written = written


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _reshard(pl_module: pl.LightningModule) -> None:
    """FSDP2 parameters back in sharded form (a forward without backward leaves some unsharded)."""
    from torch.distributed.fsdp import FSDPModule

    for module in pl_module.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _copy_to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return _local(value).detach().to(device, copy=True)
    return copy.deepcopy(value)


class TrainingSnapshot:
    """An in-memory copy of what a training step changes (rank-local: FSDP2 shards stay shards), restored in place."""

    def __init__(self, trainer: pl.Trainer, pl_module: pl.LightningModule, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        _reshard(pl_module)
        self.tensors = [_copy_to(t, self.device) for t in self._module_tensors(pl_module)]
        self.optimizers = [
            (
                {
                    param: {key: _copy_to(v, self.device) for key, v in state.items()}
                    for param, state in opt.state.items()
                },
                [{key: copy.deepcopy(v) for key, v in group.items() if key != "params"} for group in opt.param_groups],
            )
            for opt in trainer.optimizers
        ]
        self.schedulers = [copy.deepcopy(config.scheduler.state_dict()) for config in trainer.lr_scheduler_configs]
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.scaler = copy.deepcopy(scaler.state_dict()) if scaler is not None else None
        self.module_state = ModuleState(pl_module)

    @staticmethod
    def _module_tensors(pl_module: pl.LightningModule) -> list[torch.Tensor]:
        return list(pl_module.parameters()) + list(pl_module.buffers())

    @torch.no_grad()
    def restore(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Put the copy back into the same tensors (optimizers keep their references); restorable again."""
        _reshard(pl_module)
        for live, saved in zip(self._module_tensors(pl_module), self.tensors):
            _local(live).copy_(saved)
        for opt, (states, groups) in zip(trainer.optimizers, self.optimizers):
            for param in list(opt.state):
                if param not in states:
                    del opt.state[param]  # state created by a branch (e.g. Adam's first step)
            for param, saved_state in states.items():
                live_state = opt.state[param]
                for key in list(live_state):
                    if key not in saved_state:
                        del live_state[key]
                for key, value in saved_state.items():
                    if isinstance(value, torch.Tensor) and isinstance(live_state.get(key), torch.Tensor):
                        _local(live_state[key]).copy_(value)
                    elif isinstance(value, torch.Tensor):
                        live_state[key] = value.to(_local(param).device, copy=True)
                    else:
                        live_state[key] = copy.deepcopy(value)
            for group, saved_group in zip(opt.param_groups, groups):
                group.update(copy.deepcopy(saved_group))
            opt.zero_grad(set_to_none=True)
        for config, state in zip(trainer.lr_scheduler_configs, self.schedulers):
            config.scheduler.load_state_dict(copy.deepcopy(state))
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and self.scaler is not None:
            scaler.load_state_dict(copy.deepcopy(self.scaler))
        self.module_state.restore(pl_module)


def module_optimizer(pl_module: pl.LightningModule) -> LightningOptimizer:
    """The module's one optimizer (automatic optimization), as its ``optimizer_step`` receives it."""
    optimizer = pl_module.optimizers()
    assert not isinstance(optimizer, list), "automatic optimization has a single optimizer"
    return optimizer


@dataclass
class RecordedWindow:
    """The main run's window since ``point``, as this rank trained it (samples global unless said)."""

    point: ProbePoint  # its batch, multipliers, window (whole steps of the largest branch) and replicates
    data_parallel_size: int
    start: TrainingSnapshot  # each of `replicates` disjoint windows one after the other trains from here
    batches: list[Any] = field(default_factory=list)  # micro-batches as the main run trained on them
    recorded_samples: int = 0  # per rank, in `batches`
    early_stop_samples: list[int] = field(default_factory=list)  # per rank, where the probe may end early
    # per k trained up to an early stop: its training state, this rank's step losses, steps taken
    progress: dict[float, tuple[TrainingSnapshot, list[float], int]] = field(default_factory=dict)

    @property
    def samples_per_rank(self) -> int:
        return self.point.window_samples // self.data_parallel_size

    def tokens_of(self, samples_per_rank: int) -> int:
        return samples_per_rank * self.data_parallel_size * self.point.seq_len

    def step_samples(self, k: float) -> int:
        return round(k * self.point.batch_size) // self.data_parallel_size

    def record_batch(self, batch: Any, device: str | torch.device) -> None:
        self.batches.append(move_data_to_device(apply_to_collection(batch, torch.Tensor, torch.Tensor.detach), device))
        self.recorded_samples += extract_batch_size(batch)

    def micro_batches(self, size: int, samples: int, offset: int = 0) -> list[Any]:
        """``samples`` recorded samples (per rank) from the ``offset``-th on, in micro-batches of ``size``."""
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


@contextlib.contextmanager
def callbacks_hidden(trainer: pl.Trainer) -> Iterator[None]:
    """No callback hook runs inside (branch steps are not the run's) but ``BatchAccounting``'s."""
    # trainer.callbacks is set by Lightning's callback connector, undeclared on Trainer: hence the ignores
    callbacks = trainer.callbacks  # type: ignore[attr-defined]
    trainer.callbacks = [c for c in callbacks if isinstance(c, BatchAccounting)]  # type: ignore[attr-defined]
    try:
        yield
    finally:
        trainer.callbacks = callbacks  # type: ignore[attr-defined]


def cooldown_factor(step: int, steps: int, cooldown_steps: int) -> float:
    """The LR factor of a branch's ``step`` of ``steps``: 1, then linear decay over the last ``cooldown_steps``."""
    if step < steps - cooldown_steps:
        return 1.0
    return 1.0 - (step - (steps - cooldown_steps) + 1) / (cooldown_steps + 1)


@contextlib.contextmanager
def lr_scaled_for_step(optimizers: list[torch.optim.Optimizer], factor: float, k: float | None) -> Iterator[None]:
    """Every LR times ``factor`` for branch ``k``'s step (None: a trial); ``ProbeUnusable`` where it wrote the LR."""
    saved = [[group["lr"] for group in optimizer.param_groups] for optimizer in optimizers]
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] *= factor
    yield
    for optimizer, lrs in zip(optimizers, saved):
        for group, lr in zip(optimizer.param_groups, lrs):
            if group["lr"] != lr * factor:
                where = "it was given" if k is None else f"the k={k:g} branch trains at"
                raise ProbeUnusable(f"{group['lr']:.4g} where {where} {lr * factor:.4g}")
            group["lr"] = lr


@dataclass
class BranchTrainer:
    """Trains a probe's branches in ``trainer`` and scores each as the main run's window is scored (nats)."""

    trainer: pl.Trainer
    pl_module: pl.LightningModule
    accounting: BatchAccounting
    config: ProbeConfig  # its rules (how the optimizer moves for batch ratio k), evaluate, ema_alpha, cooldown
    micro_batch_for: Callable[[float], int | None]  # samples per rank in a micro-batch of branch k (None: none fits)
    heldout: list[Any] | None = None  # held-out batches for evaluate="heldout"
    tokens_trained: int = 0  # tokens (global) of every branch step taken so far
    _validation_loss: bool = True  # validation_step returns a loss (else training_step's is the held-out loss)

    def score(self, step_losses: list[float]) -> BranchScore:
        """The score (alike on every rank) of a window trained with ``step_losses``, the model at its end."""
        if self.config.evaluate == "heldout":
            return BranchScore.heldout(mean_over_ranks(self.trainer, self._agreed(self._local_heldout_losses)))
        return BranchScore.train_ema(mean_over_ranks(self.trainer, step_losses), self.config.ema_alpha)

    def loss(self, window: RecordedWindow, k: float, keep: bool = False, replicate: int = 0) -> BranchScore:
        """Train batch k*B over the ``replicate``-th window (``keep``: kept for an early look) and score it."""
        with callbacks_hidden(self.trainer):
            step_losses = self._train(window, k, keep, replicate)
            return self.score(step_losses)

    def _agreed(self, work: Callable[[], T]) -> T:
        """Run ``work`` on every rank and agree on whether it failed anywhere; raise on every rank if so."""
        error: BaseException | None = None
        result: Any = None
        try:
            result = work()
        except (BranchFailed, ProbeAborted):
            raise
        except Exception as caught:  # noqa: BLE001 - every exception is agreed, then raised again
            error = caught
        # An allocation failure (torch's, the CPU allocator's, CUDA's in a library call) fails the branch.
        oom = error is not None and (
            isinstance(error, torch.OutOfMemoryError)
            or any(
                text in str(error)
                for text in ("DefaultCPUAllocator: can't allocate memory", "CUDA error: out of memory")
            )
        )
        flags = mean_over_ranks(self.trainer, [float(oom), float(error is not None and not oom)])
        if flags[1] > 0:
            if error is not None:
                raise error
            raise RuntimeError("another rank raised inside a CBS probe branch (its log has the error); probe aborted")
        if flags[0] > 0:
            raise BranchFailed("out of memory") from error
        return cast("T", result)

    def _train(self, window: RecordedWindow, k: float, keep: bool, replicate: int) -> list[float]:
        """This rank's per-step losses (nats) of batch k*B (the optimizer moved by ``rules`` for ratio k)."""
        trainer, strategy, module = self.trainer, self.trainer.strategy, self.pl_module
        step_samples, micro = window.step_samples(k), self.micro_batch_for(k)
        assert micro is not None, "only multipliers whose batch is whole micro-batches train"
        micro_per_step = step_samples // micro
        state, step_losses, first_step = window.progress.pop(k, (None, [], 0))
        if state is not None:
            state.restore(trainer, module)
        else:
            window.start.restore(trainer, module)
            for opt in trainer.optimizers:
                self.config.rules.apply(
                    opt,
                    [c.scheduler for c in trainer.lr_scheduler_configs],
                    k,
                    warn=lambda why: rank_zero_warn(f"CBSProbeCallback, branch k={k:g}: {why}"),
                )
        schedulers = [c for c in trainer.lr_scheduler_configs if c.interval == "step" and not c.reduce_on_plateau]
        offset = replicate * window.samples_per_rank
        steps = min(window.recorded_samples - offset, window.samples_per_rank) // step_samples
        batches = window.micro_batches(micro, steps * step_samples, offset)
        cooldown_steps = round(self.config.cooldown_fraction * steps)
        tokens_per_step = window.tokens_of(step_samples)
        tokens = window.point.tokens + first_step * tokens_per_step
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
        module.optimizer_zero_grad(trainer.current_epoch, steps, module_optimizer(module))  # type: ignore[arg-type]
        if keep:
            window.progress[k] = (TrainingSnapshot(trainer, module, window.start.device), step_losses, steps)
        return step_losses

    def _step(self, step: int, first: int, batches: list[Any], step_losses: list[float]) -> None:
        trainer, module = self.trainer, self.pl_module
        optimizer = module_optimizer(module)  # the LightningOptimizer the module's optimizer_step receives
        closure = functools.partial(self._forward_backward, first, batches, step_losses)
        # LightningOptimizer wraps the Optimizer Lightning's hook annotation names (zero_grad delegated to it)
        zero_grad = module.optimizer_zero_grad
        self._agreed(functools.partial(zero_grad, trainer.current_epoch, step, optimizer))  # type: ignore[arg-type]
        self._agreed(functools.partial(module.optimizer_step, trainer.current_epoch, step, optimizer, closure))

    def _forward_backward(self, first: int, batches: list[Any], step_losses: list[float]) -> torch.Tensor:
        """A branch step's closure over its micro-batches; ``BranchFailed`` on a non-finite loss."""
        trainer, strategy = self.trainer, self.trainer.strategy
        raw_optimizer = trainer.optimizers[0]
        count = len(batches)
        total = torch.zeros((), dtype=torch.float64, device=strategy.root_device)
        for i, batch in enumerate(batches):
            last = i == count - 1
            batch = move_data_to_device(batch, strategy.root_device)
            self.accounting.gradient_sync.set(last)
            with _block_parallel_sync_behavior(strategy, block=not last):
                loss = self._agreed(lambda: loss_of(strategy.training_step(batch, first + i)))  # noqa: B023 - called here
                self._agreed(functools.partial(strategy.backward, loss / count, raw_optimizer))
            total += loss.detach()
        self.accounting.step_tokens.rescale(trainer, raw_optimizer, count)  # token_mean_loss
        step_loss = total / count
        if strategy.reduce_boolean_decision(not bool(torch.isfinite(step_loss)), all=False):
            raise BranchFailed(f"non-finite loss at branch step {len(step_losses)}")
        step_losses.append(float(step_loss))
        return step_loss

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

    def _heldout_loss(self, batch: Any, index: int) -> torch.Tensor:
        """``probe_loss``, else ``validation_step``'s loss, else ``training_step``'s."""
        module = self.pl_module
        if callable(probe_loss := getattr(module, "probe_loss", None)):
            return loss_of(probe_loss(batch), "probe_loss")
        if self._validation_loss and is_overridden("validation_step", module):
            output = module.validation_step(batch, index)
            if isinstance(output, torch.Tensor) or (isinstance(output, dict) and "loss" in output):
                return loss_of(output, "validation_step")
            self._validation_loss = False  # it returns no loss: its training_step is the loss
        return loss_of(module.training_step(batch, index))


def branch_micro_batch(
    k: float, batch_size: int, accounting: BatchAccounting, warmup: BatchWarmup | None
) -> int | None:
    """Samples per rank in branch k's micro-batch at main batch ``batch_size``; None where none fits."""
    branch, ranks = k * batch_size, accounting.data_parallel_size
    if abs(branch - round(branch)) > 1e-9 or round(branch) % ranks:
        return None
    if warmup is not None and warmup.max_micro_batch_size is not None:
        return warmup.micro_batch_for(round(branch))
    micro = known(accounting.micro_batch_size, "BatchAccounting.micro_batch_size")
    return micro if (round(branch) // ranks) % micro == 0 else None
