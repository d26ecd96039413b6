"""An OLMo-style decoder (Groeneveld et al. 2024), no biases, and its ``PRESETS`` (``tiny``: 233,472 parameters)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from lit_cbs.errors import LitCBSConfigError, positive_int

__all__ = ["OLMoConfig", "PRESETS", "get_config", "rotary_cos_sin", "Block", "OLMo"]


@dataclass
class OLMoConfig:
    """Shape of an OLMo-style model; LitCBSConfigError on one the model cannot take (the head dim must be even)."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    mlp_hidden: int
    context_length: int
    tie_embeddings: bool
    rope_theta: float = 10000.0
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "mlp_hidden", "context_length"):
            positive_int(name, getattr(self, name), "model config field")
        if not isinstance(self.tie_embeddings, bool):
            raise LitCBSConfigError(f"tie_embeddings must be a bool, got {self.tie_embeddings!r}")
        if self.d_model % self.n_heads:
            raise LitCBSConfigError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise LitCBSConfigError(f"head dim d_model/n_heads = {self.head_dim} must be even (rotary embeddings)")
        for name in ("rope_theta", "init_std"):
            if not getattr(self, name) > 0:
                raise LitCBSConfigError(f"{name}={getattr(self, name)} must be > 0")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


# tiny's mlp_hidden: 4 d_model x 2/3 rounded up to a multiple of 16; OLMo's vocabulary (50,280) padded to 128s.
PRESETS: dict[str, OLMoConfig] = {
    "tiny": OLMoConfig(256, 64, 4, 4, 176, 128, False),
    "tiny4x": OLMoConfig(256, 128, 4, 8, 352, 128, False),
    "olmo_1b": OLMoConfig(50304, 2048, 16, 16, 8192, 4096, True),
    "olmo_7b": OLMoConfig(50304, 4096, 32, 32, 11008, 4096, False),
}


def get_config(name: str) -> OLMoConfig:
    """A fresh copy of the preset ``name`` (LitCBSConfigError for an unknown one)."""
    if name not in PRESETS:
        raise LitCBSConfigError(f"unknown model preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    return OLMoConfig(**vars(PRESETS[name]))


class _TruncatedNormal:
    """Weights N(0, init_std) truncated at 3 std, drawn in ``reset_parameters`` (also after a meta-device build)."""

    init_std: float
    weight: torch.Tensor

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.weight, std=self.init_std, a=-3 * self.init_std, b=3 * self.init_std)


class _TruncatedNormalLinear(_TruncatedNormal, nn.Linear):
    def __init__(self, in_features: int, out_features: int, init_std: float):
        self.init_std = init_std  # set first: nn.Linear.__init__ calls reset_parameters
        super().__init__(in_features, out_features, bias=False)


class _TruncatedNormalEmbedding(_TruncatedNormal, nn.Embedding):
    def __init__(self, num_embeddings: int, embedding_dim: int, init_std: float):
        self.init_std = init_std
        super().__init__(num_embeddings, embedding_dim)


def _layer_norm(x: torch.Tensor) -> torch.Tensor:
    """Non-parametric LayerNorm over the last dimension."""
    return F.layer_norm(x, (x.shape[-1],), eps=1e-5)


def rotary_cos_sin(
    seq_len: int, head_dim: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, each [seq_len, head_dim] float32 (per forward: no buffer to rebuild)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + head_dim/2) of x [B, H, T, head_dim] by each position's angles (GPT-NeoX layout)."""
    first, second = x.chunk(2, dim=-1)
    rotated_half = torch.cat((-second, first), dim=-1)
    return (x * cos + rotated_half * sin).to(x.dtype)


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary position embeddings on queries and keys."""

    def __init__(self, config: OLMoConfig):
        super().__init__()
        d, std = config.d_model, config.init_std
        self.n_heads = config.n_heads
        self.q_proj = _TruncatedNormalLinear(d, d, std)
        self.k_proj = _TruncatedNormalLinear(d, d, std)
        self.v_proj = _TruncatedNormalLinear(d, d, std)
        self.out_proj = _TruncatedNormalLinear(d, d, std / math.sqrt(2 * config.n_layers))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq_len, d = x.shape
        heads = [
            p(x).view(batch, seq_len, self.n_heads, d // self.n_heads).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        ]
        q, k, v = apply_rotary(heads[0], cos, sin), apply_rotary(heads[1], cos, sin), heads[2]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return cast(torch.Tensor, self.out_proj(y.transpose(1, 2).reshape(batch, seq_len, d)))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), gated width ``mlp_hidden``."""

    def __init__(self, config: OLMoConfig):
        super().__init__()
        d, h, std = config.d_model, config.mlp_hidden, config.init_std
        self.gate_proj = _TruncatedNormalLinear(d, h, std)
        self.up_proj = _TruncatedNormalLinear(d, h, std)
        self.down_proj = _TruncatedNormalLinear(h, d, std / math.sqrt(2 * config.n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)). The unit FSDP2 shards."""

    def __init__(self, config: OLMoConfig):
        super().__init__()
        self.attention = Attention(config)
        self.mlp = SwiGLU(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(_layer_norm(x), cos, sin)
        return cast(torch.Tensor, x + self.mlp(_layer_norm(x)))


class OLMo(nn.Module):
    """Decoder-only language model: ``forward(input_ids [B, T]) -> logits [B, T, vocab_size]``."""

    def __init__(self, config: OLMoConfig):
        super().__init__()
        self.config = config
        std = config.init_std
        self.embedding = _TruncatedNormalEmbedding(config.vocab_size, config.d_model, std)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        # Tied: logits use embedding.weight directly; a Parameter shared between modules breaks to_empty() and FSDP.
        self.lm_head = None if config.tie_embeddings else _TruncatedNormalLinear(config.d_model, config.vocab_size, std)

    def reset_parameters(self) -> None:
        """(Re-)initialise every weight; call after ``to_empty()`` on a model built on the meta device."""
        for module in self.modules():
            if isinstance(module, _TruncatedNormal):
                module.reset_parameters()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Next-token logits [B, T, vocab_size]; ValueError when T exceeds ``context_length``."""
        seq_len = input_ids.shape[1]
        if seq_len > self.config.context_length:
            raise ValueError(
                f"input_ids has {seq_len} tokens per sequence but context_length={self.config.context_length}; "
                "use sequences of at most context_length tokens or a config with a longer context_length"
            )
        cos, sin = rotary_cos_sin(seq_len, self.config.head_dim, self.config.rope_theta, input_ids.device)
        x = self.embedding(input_ids)
        for block in self.blocks:
            x = block(x, cos, sin)
        x = _layer_norm(x)
        if self.lm_head is None:
            return F.linear(x, self.embedding.weight)
        return cast(torch.Tensor, self.lm_head(x))

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters; ``exclude_embeddings`` leaves out the embedding and an untied head (Kaplan's count)."""
        embeddings = [self.embedding, self.lm_head] if exclude_embeddings else []
        return sum(p.numel() for p in self.parameters()) - sum(m.weight.numel() for m in embeddings if m is not None)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token at ``seq_len``: PaLM's 6 N + 12 L d T, N every matmul weight (the head's too)."""
        c = self.config
        matmul_weights = self.num_parameters(exclude_embeddings=True) + c.vocab_size * c.d_model
        return 6 * matmul_weights + 12 * c.n_layers * c.d_model * seq_len
