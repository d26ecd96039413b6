"""Bytes a run holds, counted as the training code allocates them: per device, and per rank for the CBS probe."""

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
        dims, total = decoder_dims(config), model.num_parameters()
        block = sum(p.numel() for p in model.blocks[0].parameters())
        embeddings = 0 if dims.tie_embeddings else sum(p.numel() for p in embedding_parameters(model))
        tensors = len(list(model.parameters()))
        return cls(dims, total, tensors, block, total - dims.n_layers * block, total - embeddings, model)

    def state_bytes(self, precision: str, shards: int, optimizer: OptimizerState) -> tuple[int, int, int]:
        """(bytes per parameter element, one shard's parameter bytes, its optimizer state's bytes)."""
        if str(precision) not in PRECISIONS:
            raise ValueError(f"precision={precision!r} is not one the plan knows; use one of {list(PRECISIONS)}")
        param_bytes = PRECISIONS[str(precision)][0]
        parameters = math.ceil(self.parameters / shards) * param_bytes
        state = optimizer.per_element * parameters + optimizer.bytes_per_tensor * self.parameter_tensors
        return param_bytes, parameters, state


@dataclasses.dataclass(frozen=True)
class OptimizerState:
    """Per parameter tensor: ``per_element`` tensors of its size and dtype, and ``bytes_per_tensor`` bytes."""

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
        like = [value.element_size() for value in state if value.numel() == parameter.numel()]
        others = sum(value.nbytes for value in state if value.numel() != parameter.numel())
        return cls(type(built).__name__, sum(like) // parameter.element_size(), others)


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
        return sum(dataclasses.astuple(self))


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
    """Peak bytes per device of a training step (``strategy``: single, ddp or fsdp)."""
    config, tokens = shape.config, micro_batch * seq_len
    shards = data_parallel_size if strategy == "fsdp" else 1
    param_bytes, parameters, optimizer_state = shape.state_bytes(precision, shards, optimizer)
    act = PRECISIONS[str(precision)][1]
    if strategy == "fsdp":
        gathered = (shape.root_parameters + min(3, config.n_layers) * shape.block_parameters) * act
        # One rank gathers nothing, but still casts to the low-precision parameter dtype.
        working = gathered + shape.block_parameters * (act + 4) if shards > 1 or act < param_bytes else 0
    else:
        working = parameters if strategy == "ddp" else 0  # DDP's gradient buckets
        if act < param_bytes:  # autocast's copies; with checkpointing, of one block's weights at a time
            recomputed = (config.n_layers - 1) * shape.block_parameters if activation_checkpointing else 0
            working += (shape.autocast_weights - recomputed) * act
    # A block saves 8 d_model- and 4 mlp_hidden-wide vectors per token (autocast: the residual stream fp32, the rest
    # low precision, each matmul its own cast of its input), LayerNorm statistics and attention's log-sum-exp per
    # head in fp32.
    d, f = config.d_model, config.mlp_hidden
    block = 4 * (4 * tokens + config.n_heads * tokens)
    block += 4 * tokens * (8 * d + 4 * f) if act == 4 else 4 * tokens * 2 * d + act * tokens * (9 * d + 4 * f)
    # Outside the blocks: ids and targets, RoPE's cos and sin, the final LayerNorm, the log-softmax, the loss.
    outside = TOKEN_BYTES * micro_batch * (seq_len + 1) + TOKEN_BYTES * tokens + 2 * 4 * seq_len * config.head_dim
    outside += 4 * tokens * d + 4 * 2 * tokens + act * tokens * d + 4 * tokens * config.vocab_size + 4
    logits = tokens * config.vocab_size * (act + 4)
    if activation_checkpointing:  # a block keeps its fp32 input; backward recomputes one block at a time
        saved, extra = config.n_layers * 4 * tokens * d + outside, block + logits
    else:
        saved, extra = config.n_layers * block + outside, logits
    return DeviceMemory(parameters, parameters, optimizer_state, working, saved, extra)
