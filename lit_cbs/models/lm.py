"""``CausalLM``: next-token training of the OLMo-style decoder or a Hugging Face causal LM, FSDP2-sharded."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import nullcontext
from typing import Any, cast

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.fabric.utilities.throughput import Throughput, get_available_flops
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torchmetrics import MeanMetric

from lit_cbs import metrics
from lit_cbs._internals import checkpoint_wrapper
from lit_cbs.callbacks.accounting import BatchAccounting
from lit_cbs.errors import LitCBSConfigError, positive_number
from lit_cbs.models.decoder import DecoderDims, decoder_dims, embedding_parameters
from lit_cbs.models.hf import HFDecoder, build_decoder, hf_config, is_hf_config
from lit_cbs.models.olmo import OLMo, OLMoConfig, get_config
from lit_cbs.models.token_loss import token_mean_loss
from lit_cbs.rules.lr_schedules import TokenLRScheduler

__all__ = ["CausalLM", "resolve_model_config"]

_OLMO_FIELDS = [f.name for f in dataclasses.fields(OLMoConfig)]
_REQUIRED_OLMO_FIELDS = [f.name for f in dataclasses.fields(OLMoConfig) if f.default is dataclasses.MISSING]
# Trainer precision -> the dtype its matmuls run in, for Lightning's table of peak FLOP/s.
COMPUTE_DTYPES = {"64-true": torch.float64} | {
    f"{p}-{m}": t for p, t in (("bf16", torch.bfloat16), ("16", torch.float16)) for m in ("mixed", "true")
}

OptimizerFactory = Callable[[Iterable[dict[str, Any]]], torch.optim.Optimizer]
# OLMo's AdamW: betas (0.9, 0.95); the weight decay applies to the weight matrices only (parameter_groups).
ADAMW = functools.partial(torch.optim.AdamW, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)


def resolve_model_config(config: str | OLMoConfig | Mapping[str, Any] | Any) -> OLMoConfig | Any:
    """The ``OLMoConfig`` or ``transformers`` config of a preset name, a config, or a mapping: ``{"model_type": name,
    **fields}``, ``{"preset": name, **fields}`` (those fields replaced), or every required OLMoConfig field."""
    if isinstance(config, OLMoConfig) or is_hf_config(config):
        return config
    if isinstance(config, str):
        return get_config(config)
    if not isinstance(config, Mapping):
        raise TypeError(
            "model config must be a preset name, an OLMoConfig, a transformers config or a mapping of their fields, "
            f"got {config!r}"
        )
    if "model_type" in config:
        return hf_config(config)
    fields = dict(config)
    preset = fields.pop("preset", None)
    if unknown := sorted(set(fields) - set(_OLMO_FIELDS)):
        raise ValueError(f"model config field(s) {unknown} are not OLMoConfig fields; use preset or {_OLMO_FIELDS}")
    if preset is None:
        if missing := [name for name in _REQUIRED_OLMO_FIELDS if name not in fields]:
            raise ValueError(f"model config without a preset must give {missing}; or name a preset, e.g. preset: tiny")
        return OLMoConfig(**fields)
    return dataclasses.replace(get_config(preset), **fields)


class CausalLM(pl.LightningModule):
    """Train a decoder on token batches [B, seq_len + 1] (inputs ``[:, :-1]``, targets ``[:, 1:]``).

    Logs ``train/loss`` (the step's mean, nats per token), ``val/loss``, ``perf/tokens_per_s`` (all ranks,
    validation and probe branches excluded) and, where the device's peak is known, ``perf/mfu``.

    Args:
        config: see ``resolve_model_config``; a ``transformers`` config (the [hf] extra) gets fresh weights.
        optimizer: parameter groups -> optimizer (Hydra: ``_partial_: true``), its weight decay on the weight
            matrices only. Default: OLMo's AdamW.
        lr_schedule: tokens seen (global) -> LR multiplier; None keeps the base LR.
        peak_flops_per_device: FLOP/s of one device at the training precision (989e12: an H100 in dense bf16);
            None: Lightning's table.
        ignore_index: a padding token id whose targets do not count (``token_mean_loss``).

    Examples:
        >>> import math, torch
        >>> from lit_cbs.models import CausalLM
        >>> lm = CausalLM({"preset": "tiny", "n_layers": 1})
        >>> lm.num_parameters()  # embedding, head: 2 x 256 x 64; attention: 4 x 64 x 64; SwiGLU: 3 x 64 x 176
        82944
        >>> _ = torch.manual_seed(0)
        >>> lm.configure_model()  # Lightning calls it in fit
        >>> batch = torch.randint(0, 256, (3, 9))  # 3 sequences of seq_len + 1 = 9 tokens
        >>> abs(lm.probe_loss(batch).item() - math.log(256)) < 0.1  # freshly initialised: about ln(vocab_size) nats
        True
    """

    def __init__(
        self,
        config: str | OLMoConfig | Mapping[str, Any] | Any = "tiny",
        optimizer: OptimizerFactory = ADAMW,
        lr_schedule: Callable[[int], float] | None = None,
        activation_checkpointing: bool = False,
        peak_flops_per_device: float | None = None,
        compile: bool | Mapping[str, Any] = False,
        ignore_index: int | None = None,
    ):
        super().__init__()
        self.config = resolve_model_config(config)
        self.dims: DecoderDims = decoder_dims(self.config)
        vocab_size = self.dims.vocab_size
        if ignore_index is not None and not (isinstance(ignore_index, int) and 0 <= ignore_index < vocab_size):
            raise LitCBSConfigError(
                f"ignore_index={ignore_index!r} must be a token id in [0, {vocab_size}) (the padding token, "
                "fed to the model as input and not counted as a target), or None to count every target"
            )
        self.ignore_index = ignore_index
        _check_optimizer(optimizer)
        if lr_schedule is not None and not callable(lr_schedule):
            raise TypeError(f"lr_schedule must be callable tokens -> LR multiplier, or None; got {lr_schedule!r}")
        positive_number("peak_flops_per_device", peak_flops_per_device, "FLOP/s of one device", optional=True)
        self.optimizer_factory, self.lr_schedule = optimizer, lr_schedule
        self.activation_checkpointing, self.peak_flops_per_device = activation_checkpointing, peak_flops_per_device
        if not isinstance(compile, (bool, Mapping)):
            raise LitCBSConfigError(f"compile={compile!r} must be true, false or a dict of torch.compile arguments")
        self.compile_options = dict(compile) if isinstance(compile, Mapping) else ({} if compile else None)
        # Callables stay out of the checkpoint's hyperparameters, which load with weights_only=True.
        self.save_hyperparameters(ignore=["optimizer", "lr_schedule"])
        # Plain values, reloadable without the preset table: the OLMoConfig, or a transformers config's non-defaults.
        c = self.config
        self.hparams["config"] = dataclasses.asdict(c) if isinstance(c, OLMoConfig) else dict(c.to_diff_dict())
        self.model: OLMo | HFDecoder | None = None  # built in configure_model
        self.train_loss, self.val_loss = MeanMetric(), MeanMetric()
        self._flops_per_token: dict[int, int] = {}  # seq_len -> training FLOPs per token
        self._stretch_start: float | None = None  # perf_counter where the current stretch of training started

    def setup(self, stage: str) -> None:
        if stage == "fit":
            BatchAccounting.attach(self.trainer)  # counts the tokens the LR schedule is indexed by

    @property
    def _decoder(self) -> OLMo | HFDecoder:
        if self.model is None:
            raise RuntimeError("CausalLM's decoder is not built yet: call configure_model() (Lightning does, in fit)")
        return self.model

    def configure_model(self) -> None:
        """Build the decoder once (Lightning calls this in every fit): sharded, checkpointed, compiled as asked."""
        if self.model is not None:
            return
        mesh = None
        if self._trainer is not None and isinstance(self.trainer.strategy, ModelParallelStrategy):
            assert self.device_mesh is not None  # ModelParallelStrategy sets it before configure_model
            if self.device_mesh["tensor_parallel"].size() != 1:
                raise ValueError(
                    f"CausalLM shards with FSDP2 only, but the strategy's tensor_parallel_size is "
                    f"{self.device_mesh['tensor_parallel'].size()}; set tensor_parallel_size=1 and data_parallel_size "
                    "to the number of processes (trainer=fsdp does this)"
                )
            mesh = self.device_mesh["data_parallel"]
        with torch.device("meta") if mesh is not None else nullcontext():
            model = build_decoder(self.config)
        if self.activation_checkpointing:
            for index, block in enumerate(model.blocks):
                model.blocks[index] = checkpoint_wrapper(block)
        if self.compile_options is not None:
            for block in model.blocks:
                block.compile(**self.compile_options)  # in place: parameter names and checkpoints stay as without
        if mesh is not None:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            # bf16-mixed: gather and compute in bf16, reduce gradients in fp32 (param, reduce); autocast the rest.
            bf16 = self.trainer.precision == "bf16-mixed"
            policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else MixedPrecisionPolicy()
            for index, block in enumerate(model.blocks):
                # The last block's parameters are needed again right at the start of backward: keep them.
                fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=index < len(model.blocks) - 1)
            fully_shard(model, mesh=mesh, mp_policy=policy)
            # Materialize only the local shards, then draw the initial weights into them.
            model.to_empty(device=self.trainer.strategy.root_device)
            model.reset_parameters()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab_size] for ``input_ids`` [B, T]."""
        return cast(torch.Tensor, self._decoder(input_ids))

    def probe_loss(self, batch: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (nats per counted token) of a batch [B, seq_len + 1]; a probe's score."""
        if self.ignore_index is None:
            logits = self._decoder(batch[:, :-1])
            # A mean over no target is NaN; the sum over none is 0, with a zero gradient, for a zero-sample micro-batch.
            reduction = "mean" if len(batch) else "sum"
            return F.cross_entropy(_at_least_float32(logits.flatten(0, 1)), batch[:, 1:].flatten(), reduction=reduction)
        loss_sum, tokens = self._loss_sum(batch)
        return loss_sum / tokens.clamp(min=1)

    def _loss_sum(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Next-token cross-entropy summed over the targets that are not ``ignore_index`` (nats), and their number."""
        ignore_index, targets = self.ignore_index, batch[:, 1:].flatten()
        assert ignore_index is not None  # else _loss takes the mean itself
        logits = _at_least_float32(self._decoder(batch[:, :-1]).flatten(0, 1))
        loss_sum = F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")
        return loss_sum, (targets != ignore_index).sum()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.ignore_index is None:
            loss = self.probe_loss(batch)
            # A micro-batch of no sample (an epoch's last, on a rank its share left none) does not count.
            self.train_loss.update(loss.detach(), weight=float(len(batch) > 0))
            return loss
        loss_sum, tokens = self._loss_sum(batch)
        loss = token_mean_loss(self, loss_sum, tokens)
        self.train_loss.update(loss.detach(), weight=tokens)
        return loss

    def on_train_batch_start(self, batch: torch.Tensor, batch_idx: int) -> None:
        # Counted in a hook, not in training_step, which CBS probe branches call too.
        tokens = batch[:, 1:].numel()
        self._samples += batch.shape[0]
        self._tokens += tokens
        self._step_flops += self.flops_per_token(batch.shape[1] - 1) * tokens

    def on_train_start(self) -> None:
        peak = self.peak_flops_per_device
        if peak is None:
            peak = get_available_flops(self.device, COMPUTE_DTYPES.get(str(self.trainer.precision), torch.float32))
        # A window of 2 updates: each logged rate covers the last optimizer step alone.
        self._throughput = Throughput(available_flops=peak, world_size=self.trainer.world_size, window_size=2)
        self._last_global_step = self.trainer.global_step
        # Steps, this rank's samples and tokens since here; its FLOPs since the last step; seconds trained before.
        self._steps = self._samples = self._tokens = self._step_flops = 0
        self._training_seconds = 0.0
        # A probe resumed inside its window starts in its own on_train_start, which Lightning calls before this one.
        self._branch_seconds_before = BatchAccounting.attach(self.trainer).branch_seconds
        self._throughput.update(time=0.0, batches=0, samples=0, lengths=0, flops=0)
        self._stretch_start = time.perf_counter()

    def on_validation_start(self) -> None:
        if self._stretch_start is not None:  # not in the sanity check before training
            self._training_seconds += time.perf_counter() - self._stretch_start

    def on_validation_end(self) -> None:
        if self._stretch_start is not None:
            self._stretch_start = time.perf_counter()  # validation time does not count as training throughput

    def on_train_batch_end(self, outputs: Any, batch: torch.Tensor, batch_idx: int) -> None:
        # The step count, not should_accumulate: BatchWarmup's hook, run before, may just have changed the accumulation.
        if self.trainer.global_step == self._last_global_step:
            return  # accumulating: no optimizer step after this micro-batch
        self._last_global_step = self.trainer.global_step
        self.log(metrics.TRAIN_LOSS, self.train_loss.compute(), on_step=True, on_epoch=False, prog_bar=True)
        self.train_loss.reset()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._steps += 1
        # A CBS probe's branches run between the main run's steps: their time is not the main run's.
        branch_seconds = BatchAccounting.attach(self.trainer).branch_seconds - self._branch_seconds_before
        assert self._stretch_start is not None  # set in on_train_start, which runs first
        seconds = self._training_seconds + time.perf_counter() - self._stretch_start - branch_seconds
        self._throughput.update(
            time=seconds, batches=self._steps, samples=self._samples, lengths=self._tokens, flops=self._step_flops
        )
        self._step_flops = 0
        rates = self._throughput.compute()
        # Throughput's rates are per device; every rank trains micro-batches of the same shape.
        tokens_per_s = rates["device/items_per_sec"] * self.trainer.world_size
        self.log(metrics.TOKENS_PER_S, tokens_per_s, on_step=True, on_epoch=False, prog_bar=True)
        if "device/mfu" in rates:
            self.log(metrics.MFU, rates["device/mfu"], on_step=True, on_epoch=False)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token at ``seq_len`` tokens per sequence (the decoder's PaLM estimate), cached."""
        if seq_len not in self._flops_per_token:
            # Parameter counts of sharded (DTensor) parameters are global, so this holds under FSDP.
            self._flops_per_token[seq_len] = self._decoder.flops_per_token(seq_len)
        return self._flops_per_token[seq_len]

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        counted = batch[:, 1:].numel() if self.ignore_index is None else (batch[:, 1:] != self.ignore_index).sum()
        self.val_loss.update(self.probe_loss(batch), weight=counted)
        self.log(metrics.VAL_LOSS, self.val_loss, on_step=False, on_epoch=True, prog_bar=True)

    def parameter_groups(self) -> list[dict[str, Any]]:
        """The weight matrices, with the optimizer's weight decay; embeddings, norms and biases without."""
        embeddings = {id(param) for param in embedding_parameters(self._decoder)}
        groups: tuple[list[nn.Parameter], list[nn.Parameter]] = ([], [])  # (decayed, not)
        for param in self._decoder.parameters():
            groups[param.ndim < 2 or id(param) in embeddings].append(param)
        return [{"params": groups[0]}, {"params": groups[1], "weight_decay": 0.0}]

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(self.parameter_groups())
        if self.lr_schedule is None:
            return optimizer
        scheduler = TokenLRScheduler(optimizer, self.lr_schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def num_parameters(self) -> int:
        """Parameters of the model (built on the meta device before ``configure_model``); a tied head counted once."""
        if self.model is not None:
            return self.model.num_parameters()
        with torch.device("meta"):
            return build_decoder(self.config).num_parameters()


def _at_least_float32(logits: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 logits in float32 for the softmax; float32 and float64 ("64-true") as they are."""
    return logits.float() if logits.element_size() < 4 else logits


def _check_optimizer(optimizer: OptimizerFactory) -> None:
    """LitCBSConfigError unless ``optimizer`` builds an optimizer from groups like ``CausalLM.parameter_groups``."""
    if not callable(optimizer):
        raise LitCBSConfigError(
            f"optimizer={optimizer!r} must be a callable parameter groups -> torch.optim.Optimizer, "
            "e.g. functools.partial(torch.optim.AdamW, lr=3e-3)"
        )
    name = repr(optimizer)  # AdamW(lr=0.003, ...) for a functools.partial
    if isinstance(optimizer, functools.partial):
        arguments = [*map(repr, optimizer.args), *(f"{key}={value!r}" for key, value in optimizer.keywords.items())]
        name = f"{getattr(optimizer.func, '__qualname__', repr(optimizer.func))}({', '.join(arguments)})"
    matrix, vector = nn.Parameter(torch.zeros(2, 2)), nn.Parameter(torch.zeros(2))
    try:
        built = optimizer([{"params": [matrix]}, {"params": [vector], "weight_decay": 0.0}])
    except (TypeError, ValueError) as error:
        raise LitCBSConfigError(f"optimizer {name} cannot be built: {error}") from error
    if not isinstance(built, torch.optim.Optimizer):
        raise LitCBSConfigError(f"optimizer {name} returned {type(built).__name__}, not a torch.optim.Optimizer")
