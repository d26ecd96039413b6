"""What a run holds in memory, in bytes, counted as the training code allocates it: per device (``device_memory``),
and per rank in host memory for the CBS probe (``probe_plan``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

from lit_cbs.models.decoder import DecoderDims, decoder_dims, embedding_parameters
from lit_cbs.models.hf import HFDecoder, build_decoder
from lit_cbs.models.olmo import OLMo

__all__: list[str] = []  # users read it as plan=true's memory table

GIB = 2**30
TOKEN_BYTES = 8  # TokenDataModule batches are int64 token ids
# precision -> (bytes per parameter element, bytes per activation element of the matmuls)
PRECISIONS = {"32-true": (4, 4), "32": (4, 4), "bf16-mixed": (4, 2), "16-mixed": (4, 2), "bf16-true": (2, 2)}
PRECISIONS["16-true"] = (2, 2)


def _precision_bytes(precision: str) -> tuple[int, int]:
    if str(precision) not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one the plan knows; use one of {list(PRECISIONS)}")
    return PRECISIONS[str(precision)]


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """Parameter counts (elements) of a decoder, read from its meta-device build."""

    config: DecoderDims
    parameters: int
    parameter_tensors: int
    block_parameters: int  # one block's
    root_parameters: int  # outside the blocks: embedding and untied output head
    autocast_weights: int  # matmul weights autocast casts each step: all but the embedding (tied: it is also the head)
    model: OLMo | HFDecoder = dataclasses.field(repr=False, compare=False)  # on the meta device

    @classmethod
    def measure(cls, config: Any) -> ModelShape:
        with torch.device("meta"):
            model = build_decoder(config)
        dims = decoder_dims(config)
        block = sum(p.numel() for p in model.blocks[0].parameters())
        embeddings = sum(p.numel() for p in embedding_parameters(model))
        total = model.num_parameters()
        return cls(
            config=dims,
            parameters=total,
            parameter_tensors=len(list(model.parameters())),
            block_parameters=block,
            root_parameters=total - dims.n_layers * block,
            autocast_weights=total - (0 if dims.tie_embeddings else embeddings),
            model=model,
        )

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (6N + attention)."""
        return self.model.flops_per_token(seq_len)


@dataclasses.dataclass(frozen=True)
class OptimizerState:
    """What an optimizer keeps per parameter tensor: ``per_element`` tensors the parameter's size and dtype, and
    ``bytes_per_tensor`` bytes besides (a step count)."""

    name: str
    per_element: int
    bytes_per_tensor: int

    @classmethod
    def measure(cls, optimizer: Callable[[Any], torch.optim.Optimizer]) -> OptimizerState:
        """Counted after one step of ``optimizer`` (parameters -> Optimizer) on a 4 x 8 fp32 parameter."""
        parameter = torch.nn.Parameter(torch.zeros(4, 8))
        parameter.grad = torch.ones_like(parameter)
        built = optimizer([parameter])
        built.step()
        state = [value for value in built.state[parameter].values() if isinstance(value, torch.Tensor)]
        like_parameter = [value for value in state if value.numel() == parameter.numel()]
        return cls(
            name=type(built).__name__,
            per_element=sum(value.element_size() for value in like_parameter) // parameter.element_size(),
            bytes_per_tensor=sum(value.nbytes for value in state if value.numel() != parameter.numel()),
        )


ADAMW_STATE = OptimizerState("AdamW", per_element=2, bytes_per_tensor=4)  # exp_avg, exp_avg_sq; an fp32 step


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """Bytes on one device at the peak of a training step."""

    parameters: int
    gradients: int
    optimizer_state: int
    working_buffers: int
    activations: int  # saved for backward, at the end of the forward pass
    activation_peak_extra: int  # the recomputed block (activation checkpointing) and the logits at the loss

    @property
    def total(self) -> int:
        """Bytes at the step's peak."""
        return sum(dataclasses.astuple(self))


def _block_bytes(config: DecoderDims, micro_batch: int, seq_len: int, act: int) -> int:
    """Bytes one block saves for backward: 8 d_model- and 4 mlp_hidden-wide vectors per token (autocast: the
    residual stream fp32, the rest low precision, each matmul its own cast of its input), LayerNorm statistics
    and attention's log-sum-exp per head in fp32."""
    tokens = micro_batch * seq_len
    d, f = config.d_model, config.mlp_hidden
    small = 4 * (4 * tokens + config.n_heads * tokens)
    if act == 4:
        return 4 * tokens * (8 * d + 4 * f) + small
    return 4 * tokens * 2 * d + act * tokens * (9 * d + 4 * f) + small


def _outside_bytes(config: DecoderDims, micro_batch: int, seq_len: int, act: int) -> int:
    """Bytes saved outside the blocks: ids and targets, RoPE's cos and sin, the final LayerNorm, the log-softmax."""
    tokens = micro_batch * seq_len
    ids = TOKEN_BYTES * micro_batch * (seq_len + 1) + TOKEN_BYTES * tokens
    rope = 2 * 4 * seq_len * config.head_dim
    final_norm = 4 * tokens * config.d_model + 4 * 2 * tokens + act * tokens * config.d_model
    return ids + rope + final_norm + 4 * tokens * config.vocab_size + 4  # + the loss scalar


def device_memory(
    shape: ModelShape,
    micro_batch: int,
    seq_len: int,
    precision: str,
    strategy: str,
    data_parallel_size: int,
    activation_checkpointing: bool,
    optimizer: OptimizerState = ADAMW_STATE,
) -> DeviceMemory:
    """Peak bytes per device of a training step. ``strategy``: ``single``, ``ddp`` or ``fsdp`` (FSDP2 shards the
    model state over ``data_parallel_size`` and gathers the root and up to three blocks)."""
    if strategy not in ("single", "ddp", "fsdp"):
        raise ValueError(f"strategy={strategy!r} must be one of ('single', 'ddp', 'fsdp')")
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size={data_parallel_size} must be >= 1")
    param_bytes, act = _precision_bytes(precision)
    config = shape.config
    shards = data_parallel_size if strategy == "fsdp" else 1
    local = math.ceil(shape.parameters / shards)
    parameters = local * param_bytes
    optimizer_state = optimizer.per_element * local * param_bytes + optimizer.bytes_per_tensor * shape.parameter_tensors
    if strategy == "fsdp":
        gathered = (shape.root_parameters + min(3, config.n_layers) * shape.block_parameters) * act
        # One rank gathers nothing, but still casts to the low-precision parameter dtype.
        working = gathered + shape.block_parameters * (act + 4) if shards > 1 or act < param_bytes else 0
    else:
        working = parameters if strategy == "ddp" else 0  # DDP's gradient buckets
        if act < param_bytes:  # autocast's copies; with checkpointing, of one block's weights at a time
            recomputed = (config.n_layers - 1) * shape.block_parameters if activation_checkpointing else 0
            working += (shape.autocast_weights - recomputed) * act
    block = _block_bytes(config, micro_batch, seq_len, act)
    outside = _outside_bytes(config, micro_batch, seq_len, act)
    logits = micro_batch * seq_len * config.vocab_size * (act + 4)
    if activation_checkpointing:  # a block keeps its fp32 input; backward recomputes one block at a time
        saved = config.n_layers * 4 * micro_batch * seq_len * config.d_model + outside
        extra = block + logits
    else:
        saved = config.n_layers * block + outside
        extra = logits
    return DeviceMemory(parameters, parameters, optimizer_state, working, saved, extra)


@dataclasses.dataclass(frozen=True)
class ProbePlan:
    """What a CBSProbeCallback will cost; bytes per rank, in host memory."""

    points: list[int]  # token counts of the probes whose span ends within max_tokens
    snapshot_bytes: int  # the rank's parameters and optimizer state
    window_bytes: int  # the recorded micro-batches of one probe's windows
    heldout_bytes: int
    max_branches: int
    window_tokens: int
    replicates: int = 1
    snapshots: int = 2  # held at once: the window's start, the main run after it, one per branch with early_stop
    side_jobs: str | None = None  # the side jobs' launcher (their branches train elsewhere)
    checkpoint_bytes: int = 0  # side jobs: the checkpoint each probe writes for its job (all ranks' shards)

    @property
    def host_bytes(self) -> int:
        """Peak host memory per rank (side jobs: only the held-out batches the main run scores itself on)."""
        if self.side_jobs is not None:
            return self.heldout_bytes
        return self.snapshots * self.snapshot_bytes + self.window_bytes + self.heldout_bytes

    @property
    def tokens(self) -> int:
        """Tokens trained in branches over the run, at most."""
        return len(self.points) * self.max_branches * self.window_tokens * self.replicates


def probe_plan(
    probe: Any,
    shape: ModelShape,
    precision: str,
    strategy: str,
    data_parallel_size: int,
    val_micro_batch: int,
    seq_len: int,
    max_tokens: int,
    optimizer: OptimizerState = ADAMW_STATE,
) -> ProbePlan:
    """The cost of ``probe`` (a ``CBSProbeCallback``) on this run."""
    from lit_cbs.probe.reading import max_branches

    config = probe.config
    points: list[int] = []
    while (point := config.probe_point(len(points))) + config.span_tokens <= max_tokens:
        points.append(int(point))
    param_bytes, _ = _precision_bytes(precision)
    shards = data_parallel_size if strategy == "fsdp" else 1
    local = math.ceil(shape.parameters / shards)
    snapshot = (1 + optimizer.per_element) * local * param_bytes + optimizer.bytes_per_tensor * shape.parameter_tensors
    sample_bytes = (seq_len + 1) * TOKEN_BYTES
    branches = max_branches(config.search, len(config.multipliers))
    return ProbePlan(
        points=points,
        snapshot_bytes=snapshot,
        window_bytes=config.span_tokens // seq_len // data_parallel_size * sample_bytes,
        heldout_bytes=config.heldout_batches * val_micro_batch * sample_bytes if config.evaluate == "heldout" else 0,
        max_branches=branches,
        window_tokens=config.window_tokens,
        replicates=config.replicates,
        snapshots=2 + (branches if config.early_stop else 0),
        side_jobs=type(config.side_jobs.launcher).__name__ if config.side_jobs is not None else None,
        checkpoint_bytes=snapshot * shards,
    )
