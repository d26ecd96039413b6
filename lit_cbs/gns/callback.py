"""``GradientNoiseScale``: B_simple = tr(Sigma) / |G|^2 measured online. Modes and cost: docs/guides/gns_cost.md."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.data import extract_batch_size
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from lit_cbs import metrics
from lit_cbs._internals import foreach_copy_, foreach_norm, foreach_sub_, should_accumulate, tree_map
from lit_cbs.callbacks.accounting import BatchAccounting
from lit_cbs.callbacks.logs import log_to_loggers
from lit_cbs.errors import LitCBSConfigError, positive_int, require_automatic_optimization
from lit_cbs.gns.estimator import NoiseMeasurement, StepSums, squared_norm
from lit_cbs.gns.groups import assign_groups, compiled_groups

PerExampleLoss = Callable[[torch.nn.Module, Any], torch.Tensor]
_EMA_KEYS = ("ema_grad_sq", "ema_trace_sigma")  # the EMAs of |G|^2 and tr(Sigma) in a checkpoint


class _LossOfBatch(torch.nn.Module):
    """``per_example_loss(module, batch)`` as a module, so ``torch.func.functional_call`` can swap its parameters."""

    def __init__(self, module: torch.nn.Module, loss: PerExampleLoss) -> None:
        super().__init__()
        self.module, self.loss = module, loss

    def forward(self, batch: Any) -> torch.Tensor:
        return self.loss(self.module, batch)


class GradientNoiseScale(Callback):
    """Log the gradient noise scale B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018), in samples.

    Logs ``gns/b_simple``, ``gns/trace_sigma``, ``gns/grad_sq`` (and ``gns/<group>/...``) from bias-corrected
    EMAs; a monitor, not the CBS (docs/guides/gns.md).

    Args:
        ema_decay: the EMAs' decay per measured optimizer step, in [0, 1).
        groups: also per group of parameters: ``"param_groups"``, ``"blocks"`` or ``{group: regex}``.
        per_example_loss: ``(module, batch) -> loss`` of a micro-batch, without side effects: per-example mode.
        per_example_chunk_size: samples per ``vmap`` chunk in per-example mode (None: the whole micro-batch).

    Examples:
        >>> callback = GradientNoiseScale(groups="blocks", ema_decay=0.95)  # Trainer(callbacks=[callback])
        >>> callback.groups, callback.b_simple, callback.num_updates
        ('blocks', None, 0)
    """

    def __init__(
        self,
        ema_decay: float = 0.99,
        groups: str | Mapping[str, str] | None = None,
        per_example_loss: PerExampleLoss | None = None,
        per_example_chunk_size: int | None = None,
    ) -> None:
        if isinstance(ema_decay, bool) or not isinstance(ema_decay, (int, float)) or not 0.0 <= ema_decay < 1.0:
            raise LitCBSConfigError(f"ema_decay={ema_decay!r} must be a float in [0, 1) (decay per optimizer step)")
        if per_example_loss is not None and not callable(per_example_loss):
            raise LitCBSConfigError(
                f"per_example_loss must be a callable (module, batch) -> loss, got {per_example_loss!r}"
            )
        positive_int("per_example_chunk_size", per_example_chunk_size, "samples", optional=True)
        if per_example_chunk_size is not None and per_example_loss is None:
            raise LitCBSConfigError(
                "per_example_chunk_size only applies to per-example mode: also pass per_example_loss"
            )
        compiled_groups(groups)
        self.ema_decay, self.groups = float(ema_decay), groups
        self.per_example_loss, self.per_example_chunk_size = per_example_loss, per_example_chunk_size
        self._stepped = self._said_unmeasured = False  # _stepped: a step was measured, its metrics not yet written
        self.last_measurement: NoiseMeasurement | None = None
        self.num_updates = 0  # optimizer steps measured so far
        # Per group, EMAs of |G|^2 and tr(Sigma), bias-corrected when read: made when the fit starts or by a checkpoint.
        self._ema: list[torch.Tensor] = []
        self.group_names: list[str | None] = []
        self._restored_group_names: list[str | None] | None = None  # from a checkpoint, checked when the fit starts

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        require_automatic_optimization(pl_module, "GradientNoiseScale", "it reads Lightning's gradient accumulation")
        if not isinstance(trainer.strategy, (SingleDeviceStrategy, DDPStrategy)):
            raise LitCBSConfigError(
                f"GradientNoiseScale supports single-device and DDP strategies, got {type(trainer.strategy).__name__}: "
                "it reads whole local gradients, which sharded strategies (FSDP, DeepSpeed, model parallel) split "
                "across ranks; use strategy='ddp' or a single device"
            )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Says when a CBS probe's branch runs: its gradients, hooks and steps are not the main run's.
        self._accounting = BatchAccounting.attach(trainer)
        if self.per_example_loss is None and trainer.world_size == 1 and trainer.accumulate_grad_batches == 1:
            from lit_cbs.callbacks.warmup import BatchWarmup

            ranks = self._accounting.data_parallel_size  # BatchWarmup: the accumulation at each size to come
            if not any(
                (
                    isinstance(cb, BatchWarmup)
                    and any(s // (cb.micro_batch_for(s) * ranks) > 1 for s in cb.schedule.sizes(cb.consumed))
                )
                or (isinstance(cb, GradientAccumulationScheduler) and max(cb.scheduling.values()) > 1)
                for cb in trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector
            ):
                raise LitCBSConfigError(
                    "GradientNoiseScale needs two batch sizes, but accumulate_grad_batches=1 on 1 process gives one: "
                    "set Trainer(accumulate_grad_batches=2 or more), train on 2+ DDP processes, or pass "
                    "per_example_loss=... for per-example mode (B_small = 1 sample)"
                )
        (optimizer,) = trainer.optimizers  # automatic optimization: exactly one
        self.group_names, self._group_of = assign_groups(self.groups, optimizer, pl_module)
        self._device = pl_module.device
        self._group_index: dict[tuple[int, ...], torch.Tensor] = {}  # ids of parameters -> their group indices
        # Since the last step (this rank): accumulated gradients' copies, whose are current, the DDP hook's norms.
        self._accumulated: dict[torch.Tensor, torch.Tensor] = {}
        self._held: set[torch.Tensor] = set()
        self._hook_grad_sq: torch.Tensor | None = None
        self._pending_small: torch.Tensor | None = None  # per-example mode: squared norms summed per group
        if self._restored_group_names not in (None, self.group_names):  # restored before this hook (single device, DDP)
            raise LitCBSConfigError(
                f"the checkpoint's GradientNoiseScale measured the groups {self._restored_group_names} but "
                f"groups={self.groups!r} gives {self.group_names} (None: the parameters in no group); resume with "
                "the groups the checkpoint was written with"
            )
        zeros = torch.zeros(len(self.group_names), device=self._device)
        self._ema = [ema.to(self._device) for ema in self._ema] or [zeros, zeros.clone()]
        self._sums = StepSums(len(self.group_names), self._device)  # this optimizer step's micro-batches
        self._loss_module = None if self.per_example_loss is None else _LossOfBatch(pl_module, self.per_example_loss)
        if self._loss_module is not None:  # its trained parameters by functional_call name
            self._named_params = {f"module.{n}": p for n, p in pl_module.named_parameters() if p in self._group_of}
            return
        if not isinstance(trainer.strategy, DDPStrategy):
            return
        model = cast(DistributedDataParallel, trainer.strategy.model)  # wrapped by DDPStrategy once the fit starts
        try:
            model.register_comm_hook(state=model.process_group, hook=self._comm_hook)
        except RuntimeError as error:
            raise LitCBSConfigError(
                "GradientNoiseScale installs a DDP communication hook to read each rank's gradient before the "
                "all-reduce, but one is already registered: remove DDPStrategy(ddp_comm_hook=...) or "
                "GradientNoiseScale"
            ) from error

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._micro_batch_size = extract_batch_size(batch)
        if self._loss_module is not None and self._micro_batch_size:
            self._pending_small = self._per_example_grad_sq(self._loss_module, batch, self._micro_batch_size)

    def _per_example_grad_sq(self, loss_module: _LossOfBatch, batch: Any, size: int) -> torch.Tensor:
        """Per-example mode (Gray et al. 2024): per group, the sum of each sample's squared gradient norm."""
        names, device = list(self._named_params), self._device
        params = {name: p.detach() for name, p in self._named_params.items()}
        group_index = torch.tensor([self._group_of[self._named_params[n]] for n in names], device=device)

        def sample_grad_sq(params: dict[str, torch.Tensor], sample: Any) -> torch.Tensor:
            loss = lambda p: torch.func.functional_call(loss_module, p, (sample,), strict=False)  # noqa: E731
            grads = torch.func.grad(loss)(params)
            norms = torch.stack([squared_norm(grads[n]) for n in names])
            return torch.zeros(len(self.group_names), device=norms.device).index_add(0, group_index, norms)

        def per_sample(leaf: Any) -> bool:
            return isinstance(leaf, torch.Tensor) and leaf.ndim > 0 and leaf.shape[0] == size

        # vmap over dim 0 of every per-sample tensor, each sample kept as a batch of one.
        samples = tree_map(lambda leaf: leaf.unsqueeze(1) if per_sample(leaf) else leaf, batch)
        in_dims = tree_map(lambda leaf: 0 if per_sample(leaf) else None, batch)
        with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):  # dropout here
            per_sample_sq = torch.func.vmap(  # must not move the training RNG streams
                sample_grad_sq, in_dims=(None, in_dims), randomness="different", chunk_size=self.per_example_chunk_size
            )(params, samples)
        return per_sample_sq.sum(0)

    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if not self._accounting.in_branch:
            self._held.clear()  # the accumulated gradient restarts from zero

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._accounting.in_branch:
            return
        if self._accounting.step_tokens.count is not None:
            raise LitCBSConfigError(
                "GradientNoiseScale measures each micro-batch's mean loss, but this training_step returns "
                "lit_cbs.token_mean_loss(...), whose micro-batch gradients are sums over tokens until the step "
                "rescales them: remove GradientNoiseScale, or return the micro-batch's mean loss"
            )
        b, sums = float(self._micro_batch_size), self._sums
        if not b:  # no sample (an epoch's last round left this rank none): no gradient of its own to measure
            self._hook_grad_sq = None
            sums.add(b)
        elif self.per_example_loss is not None:
            assert self._pending_small is not None  # on_train_batch_start measured this micro-batch (b > 0 samples)
            sums.add(b, self._pending_small, count=b, inverse_size_sum=b)  # b samples, each a batch of 1
        else:
            if self._hook_grad_sq is not None:  # this backward all-reduced: the hook measured it before
                grad_sq, self._hook_grad_sq = self._hook_grad_sq, None
            else:
                grad_sq = self._micro_batch_grad_sq(((p, p.grad) for p in self._group_of), should_accumulate(trainer))
            # Lightning divided this micro-batch's loss by accumulate_grad_batches.
            sums.add(b, grad_sq * trainer.accumulate_grad_batches**2, count=1.0, inverse_size_sum=1.0 / b)

    def _micro_batch_grad_sq(
        self, params_and_grads: Iterable[tuple[torch.Tensor, torch.Tensor | None]], keep: bool
    ) -> torch.Tensor:
        """Per group, |accumulated gradient - its copy before this backward|^2 (fused); keep: update the copy."""
        pairs = [(param, grad) for param, grad in params_and_grads if grad is not None]
        held = [(param, grad) for param, grad in pairs if param in self._held]  # with a copy from before this backward
        fresh = [(param, grad) for param, grad in pairs if param not in self._held]  # without: this step's first
        held_copies = [self._accumulated[param] for param, _ in held]
        if held:
            foreach_sub_(held_copies, [grad for _, grad in held])  # minus this micro-batch's contribution
        grad_sq = self._group_squared_norms([param for param, _ in held + fresh], held_copies + [g for _, g in fresh])
        if keep:
            if held:
                foreach_copy_(held_copies, [grad for _, grad in held])
            for param, grad in fresh:
                if param in self._accumulated:
                    self._accumulated[param].copy_(grad)
                else:
                    self._accumulated[param] = grad.detach().clone()
            self._held.update(param for param, _ in fresh)
        return grad_sq

    def _group_squared_norms(self, params: list[torch.Tensor], tensors: list[torch.Tensor]) -> torch.Tensor:
        """Per group, the summed squared norms of ``tensors`` (of ``params``), half precision reduced in float32."""
        grad_sq = torch.zeros(len(self.group_names), device=self._device)
        for half in (True, False):  # half precision first, as before
            indices = [i for i, t in enumerate(tensors) if (t.dtype in (torch.float16, torch.bfloat16)) == half]
            if not indices:
                continue
            norms = foreach_norm([tensors[i] for i in indices], 2, **({"dtype": torch.float32} if half else {}))
            key = tuple(id(params[i]) for i in indices)
            if (index := self._group_index.get(key)) is None:
                index = torch.tensor([self._group_of[params[i]] for i in indices], device=self._device)
                self._group_index[key] = index
            grad_sq.index_add_(0, index, torch.stack(norms).float().square())
        return grad_sq

    # Unannotated: DDP compares the annotations with dist.GradBucket, and this module's are strings.
    def _comm_hook(self, process_group, bucket):  # type: ignore[no-untyped-def, unused-ignore]
        """DDP communication hook: measure this rank's last micro-batch in ``bucket``, then all-reduce."""
        if self._accounting.in_branch:
            return allreduce_hook(process_group, bucket)
        pairs = [(p, g) for p, g in zip(bucket.parameters(), bucket.gradients()) if p in self._group_of]
        grad_sq = self._micro_batch_grad_sq(pairs, keep=False)
        self._hook_grad_sq = grad_sq if self._hook_grad_sq is None else self._hook_grad_sq + grad_sq
        return allreduce_hook(process_group, bucket)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        sums = self._sums
        if self._accounting.in_branch:
            return
        self._sums = StepSums(len(self.group_names), self._device)  # a new optimizer step: nothing summed,
        self._held.clear()  # no gradient copy current
        if self.per_example_loss is None and trainer.world_size * sums.micro_batches < 2:
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
        if scaler is not None and self.per_example_loss is None:  # micro-batch gradients were read before unscaling
            sums.values[: sums.groups] /= scaler.get_scale() ** 2
        reduce = (lambda values: trainer.strategy.reduce(values, reduce_op="sum")) if trainer.world_size > 1 else None
        averaged_over = trainer.accumulate_grad_batches * trainer.world_size  # also for a step the epoch cut short
        self.last_measurement = sums.measurement(big_grad_sq, reduce, averaged_over)
        self._stepped = self._average(self.last_measurement)

    def _average(self, measured: NoiseMeasurement) -> bool:
        """Average in a step's estimates; False (unchanged) if one is not finite (an AMP overflow: a skipped step)."""
        if not bool(torch.isfinite(measured.grad_sq).all() & torch.isfinite(measured.trace_sigma).all()):
            return False
        new, decay = (measured.grad_sq, measured.trace_sigma), self.ema_decay
        self._ema = [decay * ema + (1 - decay) * value for ema, value in zip(self._ema, new)]
        self.num_updates += 1
        return True

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._stepped:  # after the optimizer step: the row Lightning and BatchWarmup write for this step
            self._stepped = False
            log_to_loggers(trainer, lambda _: self.metrics())

    def metrics(self) -> dict[str, float]:
        """The logged values by name: ``gns/...`` (whole model), ``gns/<group>/...`` per named group; {} before any."""
        if not self.num_updates:
            return {}
        correction = 1.0 - self.ema_decay**self.num_updates  # bias correction of EMAs started at zero
        grad_sq, trace_sigma = (ema / correction for ema in self._ema)
        whole = torch.stack([trace_sigma.sum() / grad_sq.sum(), trace_sigma.sum(), grad_sq.sum()])
        per_group = torch.stack([trace_sigma / grad_sq, trace_sigma, grad_sq], dim=1)
        model, *groups = torch.cat([whole[None], per_group]).tolist()  # one device-to-host copy for all groups
        logged = {metrics.gns(quantity): value for quantity, value in zip(metrics.GNS_QUANTITIES, model)}
        for group, row in zip(self.group_names, groups):
            if group is not None:
                logged.update({metrics.gns(q, group): value for q, value in zip(metrics.GNS_QUANTITIES, row)})
        return logged

    @property
    def b_simple(self) -> float | None:
        """The current B_simple in samples, as logged (None before the first measured step)."""
        return self.metrics().get(metrics.GNS_B_SIMPLE)

    def state_dict(self) -> dict[str, Any]:
        if not self._ema:
            return {}
        emas = {key: ema.detach().cpu() for key, ema in zip(_EMA_KEYS, self._ema)}
        return {"group_names": list(self.group_names), "num_updates": self.num_updates, **emas}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            self._restored_group_names = list(state_dict["group_names"])
            self._ema = [state_dict[key].to(torch.float32) for key in _EMA_KEYS]
            self.num_updates = state_dict["num_updates"]
