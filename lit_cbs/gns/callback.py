"""``GradientNoiseScale``: the simple noise scale B_simple = tr(Sigma) / |G|^2 (``estimator``), measured online.

The big batch is the global batch of an optimizer step (after gradient accumulation and the DDP
all-reduce); the small batch is read in one of three modes:

- accumulation: one micro-batch on one rank, its gradient read off as the change of the
  accumulated ``.grad`` across its backward pass (times ``accumulate``, because Lightning divides
  the loss by ``accumulate_grad_batches``);
- DDP: for the micro-batch whose backward all-reduces, the same change read from inside a DDP
  communication hook, before the all-reduce;
- per-example (Gray et al. 2024, arXiv:2411.00999): B_small = 1, from per-sample gradients
  computed with ``torch.func``.

Batch sizes are counted in samples from each micro-batch (Lightning's ``extract_batch_size``), so
the estimate stays right when ``BatchWarmup`` changes the accumulation or an epoch ends on a short
micro-batch. Each group of parameters (``groups``) gets its own estimate.

A CBS probe's branches (``BatchAccounting.in_branch``) are not the main run: their backward
passes and steps, hooks and DDP communication alike, are not measured.

Merrill et al. 2025 find that under Adam this noise scale underestimates the critical batch size
by orders of magnitude: log it as a monitor next to ``CBSProbeCallback``, not as the CBS.
What each mode costs and when to pick it: docs/guides/gns_cost.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.data import extract_batch_size
from torch.nn.parallel import DistributedDataParallel

from lit_cbs._internals import foreach_copy_, foreach_norm, foreach_sub_, should_accumulate, tree_map
from lit_cbs.callbacks.accounting import BatchAccounting
from lit_cbs.callbacks.logs import log_to_loggers
from lit_cbs.errors import LitCBSConfigError, require_automatic_optimization
from lit_cbs.gns.config import GNSConfig
from lit_cbs.gns.estimator import NoiseAverages, NoiseMeasurement, StepSums, squared_norm
from lit_cbs.gns.groups import assign_groups

__all__ = ["GradientNoiseScale"]


class _LossOfBatch(torch.nn.Module):
    """Wraps ``per_example_loss(module, batch)`` as a module so ``torch.func.functional_call`` can swap its
    parameters."""

    def __init__(self, module: torch.nn.Module, loss: Callable[[torch.nn.Module, Any], torch.Tensor]):
        super().__init__()
        self.module = module
        self.loss = loss

    def forward(self, batch: Any) -> torch.Tensor:
        return self.loss(self.module, batch)


class GradientNoiseScale(Callback):
    """Log the gradient noise scale B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018), in samples.

    Small batch: one micro-batch on one rank (under gradient accumulation, or each rank's batch
    under DDP without accumulation); big batch: the global batch of the optimizer step. So at least
    one of ``accumulate_grad_batches >= 2`` or 2+ DDP processes is needed, or per-example mode
    (``per_example_loss``, B_small = 1). Steps with a single micro-batch in all (e.g. while
    ``BatchWarmup`` still runs at accumulate 1 on one process) are not measured. The loss must be
    the mean over the micro-batch's samples (as ``training_step`` returns it for Lightning's
    accumulation), and ``automatic_optimization`` must be on.

    Measured at every optimizer step (before gradient clipping, after AMP unscaling) and written
    straight to the trainer's loggers every ``log_every_n_steps`` steps, in the row of the step's
    other metrics (as LearningRateMonitor does; cheaper than ``self.log`` at every step):
    ``gns/b_simple`` (samples), ``gns/trace_sigma`` and
    ``gns/grad_sq`` (squared gradient norms, per sample and true respectively), from bias-corrected
    EMAs; with ``groups`` also ``gns/<group>/b_simple``, ``gns/<group>/trace_sigma`` and
    ``gns/<group>/grad_sq`` per group of parameters (the groups' ``grad_sq`` and ``trace_sigma`` add
    up to the whole model's when the groups hold every trained parameter). ``b_simple`` and
    ``metrics()`` give the current values. Steps whose gradients are not finite (an AMP overflow)
    leave the averages unchanged.

    Cost: one copy of the gradients when a rank accumulates 2+ micro-batches and about three
    gradient-sized memory passes per micro-batch; per-example mode instead one extra forward and
    backward per micro-batch. What each mode costs and when to pick it: docs/guides/gns_cost.md.

    Args:
        config: the settings (``GNSConfig``); or give its fields as keyword arguments
            (``GradientNoiseScale(groups="blocks")``), not both.

    Attributes:
        config: the ``GNSConfig`` in use.
        last_measurement: the latest ``NoiseMeasurement`` (None before the first measured step).
        num_updates: optimizer steps measured so far.
        group_names: the measured groups in the order of ``NoiseMeasurement``'s entries (set when
            the fit starts); ``None`` stands for the parameters in no group.

    Raises:
        LitCBSConfigError: both ``config`` and keyword fields, an unknown field, or an invalid setting
            (``GNSConfig``); when the fit starts, a strategy other than single-device or DDP, manual
            optimization, or a run with a single batch size to compare (see above).

    Examples:
        >>> callback = GradientNoiseScale(groups="blocks", ema_decay=0.95)  # Trainer(callbacks=[callback])
        >>> callback.config.groups, callback.b_simple, callback.num_updates
        ('blocks', None, 0)
        >>> GradientNoiseScale(ema_decay=1.0)
        Traceback (most recent call last):
        ...
        lit_cbs.errors.LitCBSConfigError: ema_decay=1.0 must be a float in [0, 1) (decay per optimizer step)
    """

    def __init__(self, config: GNSConfig | None = None, **kwargs: Any):
        if config is not None and kwargs:
            raise LitCBSConfigError(
                f"GradientNoiseScale takes config=GNSConfig(...) or its fields as keyword arguments, not both "
                f"(got config and {', '.join(kwargs)}): move {', '.join(kwargs)} into the GNSConfig"
            )
        if config is not None and not isinstance(config, GNSConfig):
            raise LitCBSConfigError(
                f"GradientNoiseScale(config={config!r}) must be a GNSConfig; pass its fields by keyword, "
                "e.g. GradientNoiseScale(ema_decay=0.99)"
            )
        fields = [field.name for field in dataclasses.fields(GNSConfig)]
        unknown = [name for name in kwargs if name not in fields]
        if unknown:
            raise LitCBSConfigError(
                f"GradientNoiseScale got {unknown[0]}={kwargs[unknown[0]]!r}, which is not a setting: "
                f"use the GNSConfig fields {fields}"
            )
        self.config = config if config is not None else GNSConfig(**kwargs)

        self._stepped = False  # a step was measured and its metrics are not written yet
        self.last_measurement: NoiseMeasurement | None = None
        self._averages: NoiseAverages | None = None  # created when the fit starts, or by a checkpoint before

        self.group_names: list[str | None] = []
        self._restored_group_names: list[str | None] | None = None  # from a checkpoint, checked when the fit starts
        self._group_of: dict[torch.Tensor, int] = {}  # parameter -> index in group_names
        self._group_index: dict[tuple[int, ...], torch.Tensor] = {}  # ids of parameters -> their group indices
        self._named_params: dict[str, torch.Tensor] = {}
        self._loss_module: _LossOfBatch | None = None
        self._world_size = 1
        self._device = torch.device("cpu")
        self._accounting: BatchAccounting | None = None  # the Trainer's: says when a CBS probe's branch runs
        self._said_unmeasured = False  # a step it could not measure was reported
        # Since the last optimizer step (this rank): what its micro-batches add up to, and the gradient copies.
        self._sums: StepSums | None = None
        self._accumulated: dict[torch.Tensor, torch.Tensor] = {}  # parameter -> copy of its accumulated .grad
        self._held: set[torch.Tensor] = set()  # parameters whose copy holds this step's accumulated gradient
        self._micro_batch_size = 0
        self._pending_small: torch.Tensor | None = None  # per-example mode: squared norms summed per group
        self._hook_grad_sq: torch.Tensor | None = None  # DDP hook: the syncing micro-batch's squared norms

    @property
    def num_updates(self) -> int:
        """Optimizer steps measured so far (restored from a checkpoint on resume)."""
        return 0 if self._averages is None else self._averages.updates

    # ------------------------------------------------------------------ validation and setup
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        require_automatic_optimization(pl_module, "GradientNoiseScale", "it reads Lightning's gradient accumulation")
        strategy = trainer.strategy
        if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)):
            raise LitCBSConfigError(
                f"GradientNoiseScale supports single-device and DDP strategies, got {type(strategy).__name__}: "
                "it reads whole local gradients, which sharded strategies (FSDP, DeepSpeed, model parallel) split "
                "across ranks; use strategy='ddp' or a single device"
            )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._world_size = trainer.world_size
        self._accounting = BatchAccounting.attach(trainer)
        if not self.config.per_example and self._world_size == 1 and not self._accumulation_will_exceed_one(trainer):
            raise LitCBSConfigError(
                f"GradientNoiseScale needs two batch sizes, but accumulate_grad_batches="
                f"{trainer.accumulate_grad_batches} on {self._world_size} process gives one: set "
                "Trainer(accumulate_grad_batches=2 or more), train on 2+ DDP processes, or pass "
                "per_example_loss=... for per-example mode (B_small = 1 sample)"
            )
        (optimizer,) = trainer.optimizers  # automatic optimization: exactly one
        self.group_names, self._group_of = assign_groups(self.config.groups, optimizer, pl_module)
        self._group_index = {}
        self._device = pl_module.device
        if self._averages is None:
            self._averages = NoiseAverages.zeros(self.config.ema_decay, len(self.group_names), self._device)
        else:  # restored from a checkpoint before the strategy's setup
            self._check_restored_groups()
            self._averages.to(self._device)
        self._restart_sums()
        per_example_loss = self.config.per_example_loss
        if per_example_loss is not None:  # config.per_example
            self._named_params = {f"module.{n}": p for n, p in pl_module.named_parameters() if p in self._group_of}
            self._loss_module = _LossOfBatch(pl_module, per_example_loss)
        elif isinstance(trainer.strategy, DDPStrategy):
            # Lightning types the strategy's model as a Module; once the fit starts DDPStrategy has wrapped it.
            self._register_comm_hook(cast(DistributedDataParallel, trainer.strategy.model))

    @staticmethod
    def _accumulation_will_exceed_one(trainer: pl.Trainer) -> bool:
        """True if accumulation is or will become >= 2 (the trainer's, a BatchWarmup or a
        GradientAccumulationScheduler)."""
        from lit_cbs.callbacks.warmup import BatchWarmup

        if trainer.accumulate_grad_batches > 1:
            return True
        ranks = BatchAccounting.attach(trainer).data_parallel_size
        for callback in trainer.callbacks:  # type: ignore[attr-defined]  # set by Lightning's callback connector
            # The accumulation BatchWarmup will use at each size to come (it grows the micro-batch first).
            if isinstance(callback, BatchWarmup) and any(
                size // (callback.micro_batch_for(size) * ranks) > 1
                for size in callback.schedule.sizes(callback.consumed)
            ):
                return True
            if isinstance(callback, GradientAccumulationScheduler) and max(callback.scheduling.values()) > 1:
                return True
        return False

    def _register_comm_hook(self, model: DistributedDataParallel) -> None:
        try:
            model.register_comm_hook(state=model.process_group, hook=self._comm_hook)
        except RuntimeError as error:
            raise LitCBSConfigError(
                "GradientNoiseScale installs a DDP communication hook to read each rank's gradient before the "
                "all-reduce, but one is already registered: remove DDPStrategy(ddp_comm_hook=...) or "
                "GradientNoiseScale"
            ) from error

    # ------------------------------------------------------------------ per micro-batch
    def _restart_sums(self) -> None:
        """A new optimizer step: nothing summed yet, no gradient copy current."""
        self._sums = StepSums(len(self.group_names), self._device)
        self._held.clear()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._micro_batch_size = extract_batch_size(batch)
        if self.config.per_example and self._micro_batch_size:
            self._pending_small = self._per_example_grad_sq(batch)

    @property
    def _step_sums(self) -> StepSums:
        """What this step's micro-batches add up to so far (``on_fit_start`` creates them)."""
        if self._sums is None:
            raise RuntimeError("GradientNoiseScale: on_fit_start has not run, so there are no step sums to add to")
        return self._sums

    @property
    def _noise_averages(self) -> NoiseAverages:
        """The running averages (``on_fit_start`` creates them, or a checkpoint restores them)."""
        if self._averages is None:
            raise RuntimeError("GradientNoiseScale: on_fit_start has not run, so there are no averages to update")
        return self._averages

    @property
    def _in_branch(self) -> bool:
        """A CBS probe's branch runs: its gradients, hooks and steps are not the main run's."""
        return self._accounting is not None and self._accounting.in_branch

    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        if self._in_branch:
            return
        self._held.clear()  # the accumulated gradient restarts from zero

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._in_branch:
            return
        if self._accounting is not None and self._accounting.step_tokens.active:
            raise LitCBSConfigError(
                "GradientNoiseScale measures each micro-batch's mean loss, but this training_step returns "
                "lit_cbs.token_mean_loss(...), whose micro-batch gradients are sums over tokens until the step "
                "rescales them: remove GradientNoiseScale, or return the micro-batch's mean loss"
            )
        b = float(self._micro_batch_size)
        if not b:  # no sample (an epoch's last round left this rank none): no gradient of its own to measure
            self._hook_grad_sq = None
            self._step_sums.add_micro_batch(b)
            return
        if self.config.per_example:
            pending = self._pending_small
            assert pending is not None  # on_train_batch_start measured this micro-batch (it has b > 0 samples)
            self._step_sums.add_small_batches(pending, count=b, inverse_size_sum=b)  # b samples, each a batch of 1
        else:
            if self._hook_grad_sq is not None:  # this backward all-reduced: the hook measured it before
                grad_sq, self._hook_grad_sq = self._hook_grad_sq, None
            else:
                more_follow = should_accumulate(trainer)
                grad_sq = self._micro_batch_grad_sq(((p, p.grad) for p in self._group_of), keep=more_follow)
            # Lightning divided this micro-batch's loss by accumulate_grad_batches.
            self._step_sums.add_small_batches(
                grad_sq * trainer.accumulate_grad_batches**2, count=1.0, inverse_size_sum=1.0 / b
            )
        self._step_sums.add_micro_batch(b)

    def _micro_batch_grad_sq(self, params_and_grads, keep: bool) -> torch.Tensor:
        """Squared norm per group of (accumulated gradient - its copy before this backward); keep: update the copy.

        Fused over the parameters (torch's ``_foreach_*`` kernels): per-parameter kernels cost more than the
        arithmetic on a small model.
        """
        held: list[tuple[torch.Tensor, torch.Tensor]] = []  # (param, grad)
        fresh: list[
            tuple[torch.Tensor, torch.Tensor]
        ] = []  # (param, grad): with a copy of the gradient before this backward, or the first one
        for param, grad in params_and_grads:
            if grad is not None:
                (held if param in self._held else fresh).append((param, grad))
        held_copies = [self._accumulated[param] for param, _ in held]
        if held:
            foreach_sub_(held_copies, [grad for _, grad in held])  # minus this micro-batch's contribution
        grad_sq = self._group_squared_norms(
            [param for param, _ in held] + [param for param, _ in fresh], held_copies + [grad for _, grad in fresh]
        )
        if keep:
            if held:
                foreach_copy_(held_copies, [grad for _, grad in held])
            for param, grad in fresh:
                copy = self._accumulated.get(param)
                if copy is None:
                    self._accumulated[param] = grad.detach().clone()
                else:
                    copy.copy_(grad)
                self._held.add(param)
        return grad_sq

    def _group_squared_norms(self, params: list, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Per measured group (``group_names``), the sum of the squared norms of ``tensors`` (``tensors[i]`` belongs to
        ``params[i]``), in float32; half-precision tensors are reduced in float32 so their norm is not rounded."""
        grad_sq = torch.zeros(len(self.group_names), device=self._device)
        half = [i for i, tensor in enumerate(tensors) if tensor.dtype in (torch.float16, torch.bfloat16)]
        full = [i for i, tensor in enumerate(tensors) if tensor.dtype not in (torch.float16, torch.bfloat16)]
        for indices, dtype in ((half, {"dtype": torch.float32}), (full, {})):
            if not indices:
                continue
            norms = foreach_norm([tensors[i] for i in indices], 2, **dtype)
            key = tuple(id(params[i]) for i in indices)
            index = self._group_index.get(key)
            if index is None:
                index = torch.tensor([self._group_of[params[i]] for i in indices], device=self._device)
                self._group_index[key] = index
            grad_sq.index_add_(0, index, torch.stack(norms).float().square())
        return grad_sq

    def _comm_hook(self, process_group, bucket):
        """DDP communication hook: measure this rank's last micro-batch in ``bucket``, then all-reduce as DDP would.
        A CBS probe's branch is all-reduced unmeasured.

        Unannotated: DDP compares annotations with ``dist.GradBucket``, and this module's are strings.
        """
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        if self._in_branch:
            return allreduce_hook(process_group, bucket)
        pairs = [(p, g) for p, g in zip(bucket.parameters(), bucket.gradients()) if p in self._group_of]
        grad_sq = self._micro_batch_grad_sq(pairs, keep=False)
        self._hook_grad_sq = grad_sq if self._hook_grad_sq is None else self._hook_grad_sq + grad_sq
        return allreduce_hook(process_group, bucket)

    def _per_example_grad_sq(self, batch: Any) -> torch.Tensor:
        """Sum over the micro-batch's samples of each sample's squared gradient norm, per group."""
        size = self._micro_batch_size
        names = list(self._named_params)
        params = {name: p.detach() for name, p in self._named_params.items()}
        group_index = torch.tensor([self._group_of[self._named_params[n]] for n in names], device=self._device)

        def sample_grad_sq(params, sample):
            grads = torch.func.grad(
                lambda p: torch.func.functional_call(self._loss_module, p, (sample,), strict=False)
            )(params)
            norms = torch.stack([squared_norm(grads[n]) for n in names])
            return torch.zeros(len(self.group_names), device=norms.device).index_add(0, group_index, norms)

        def per_sample(leaf):
            return isinstance(leaf, torch.Tensor) and leaf.ndim > 0 and leaf.shape[0] == size

        # vmap over dim 0 of every per-sample tensor, each sample kept as a batch of one.
        samples = tree_map(lambda leaf: leaf.unsqueeze(1) if per_sample(leaf) else leaf, batch)
        in_dims = tree_map(lambda leaf: 0 if per_sample(leaf) else None, batch)
        devices = [self._device.index or 0] if self._device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):  # dropout here must not move the training RNG streams
            per_sample_sq = torch.func.vmap(
                sample_grad_sq,
                in_dims=(None, in_dims),
                randomness="different",
                chunk_size=self.config.per_example_chunk_size,
            )(params, samples)
        return per_sample_sq.sum(0)

    # ------------------------------------------------------------------ per optimizer step
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        if self._in_branch:
            return
        sums = self._step_sums
        self._restart_sums()
        if not self.config.per_example and self._world_size * sums.micro_batches < 2:
            if not self._said_unmeasured:  # one micro-batch on one process: no second batch size this step
                self._said_unmeasured = True
                why = (
                    "the micro-batch is the whole batch: cap BatchWarmup's max_micro_batch_size below it, train on 2+ "
                    "processes, or pass per_example_loss=..."
                    if trainer.accumulate_grad_batches == 1
                    else "an epoch ended inside the step"
                )
                rank_zero_warn(
                    f"GradientNoiseScale: step {trainer.global_step + 1} is one micro-batch on one process, "
                    f"which leaves no smaller batch to compare with, so steps like it are not measured ({why})"
                )
            return
        with_grads = [(param, param.grad) for param in self._group_of if param.grad is not None]
        big_grad_sq = self._group_squared_norms([param for param, _ in with_grads], [grad for _, grad in with_grads])
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and not self.config.per_example:
            sums.unscale(scaler.get_scale())  # micro-batch gradients were read before unscaling
        reduce = (lambda values: trainer.strategy.reduce(values, reduce_op="sum")) if self._world_size > 1 else None
        # A step cut short by the epoch's end is still divided by accumulate_grad_batches (and the ranks): the
        # measurement rescales it to the mean over its micro-batches.
        averaged_over = trainer.accumulate_grad_batches * self._world_size
        self.last_measurement = sums.measurement(big_grad_sq, reduce, averaged_over)
        if not self._noise_averages.update(self.last_measurement):
            return  # an AMP overflow: the optimizer skips this step, the averages skip it too
        self._stepped = True

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        # After the optimizer step, so the row is the one Lightning and BatchWarmup write for this step.
        if not self._stepped:
            return
        self._stepped = False
        log_to_loggers(trainer, lambda _: self.metrics())

    def metrics(self) -> dict[str, float]:
        """The logged metrics' current values (empty before the first measured step).

        Returns:
            By metric name (``gns/b_simple`` and the rest): B_simple in samples, tr(Sigma) and |G|^2.
        """
        return {} if self._averages is None else self._averages.metrics(self.group_names)

    @property
    def b_simple(self) -> float | None:
        """The current estimate of B_simple in samples (None before the first measured step)."""
        return None if self._averages is None else self._averages.b_simple

    # ------------------------------------------------------------------ checkpointing
    def _check_restored_groups(self) -> None:
        restored = self._restored_group_names
        if restored is not None and restored != self.group_names:
            raise LitCBSConfigError(
                f"the checkpoint's GradientNoiseScale measured the groups {restored} but groups={self.config.groups!r} "
                f"gives {self.group_names} (None: the parameters in no group); resume with the groups the "
                "checkpoint was written with"
            )

    def state_dict(self) -> dict[str, Any]:
        averages = self._averages
        if averages is None:
            return {}
        return {
            "group_names": list(self.group_names),
            "num_updates": averages.updates,
            "ema_grad_sq": averages.grad_sq.detach().cpu(),
            "ema_trace_sigma": averages.trace_sigma.detach().cpu(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        self._restored_group_names = list(state_dict["group_names"])
        if self.group_names:  # loaded after the fit started: check now
            self._check_restored_groups()
        self._averages = NoiseAverages(
            self.config.ema_decay,
            state_dict["ema_grad_sq"].to(self._device, torch.float32),
            state_dict["ema_trace_sigma"].to(self._device, torch.float32),
            updates=state_dict["num_updates"],
        )
