"""An OLMo-style decoder-only transformer, readable top to bottom.

Architecture (OLMo 1B/7B, Groeneveld et al. 2024): token embedding -> ``n_layers`` pre-norm
blocks (attention with rotary position embeddings, then a SwiGLU MLP) -> final norm -> logits.
Every LayerNorm is non-parametric (no weight, no bias) and no Linear layer has a bias. The
output projection reuses the token embedding matrix when ``tie_embeddings`` is set.

SwiGLU convention: ``mlp_hidden`` is the width of the gated activation, i.e. the output size
of each of the gate and up projections; the MLP holds ``3 * d_model * mlp_hidden`` weights.
OLMo's own configs count the fused gate+up output instead, so its ``mlp_hidden_size`` is twice
ours (16384 for 1B, 22016 for 7B). With this convention the presets come to 1.177B (olmo_1b)
and 6.888B (olmo_7b) parameters, OLMo's published sizes.

Initialisation: every weight is drawn from a normal with std ``init_std`` truncated at 3 std;
the two projections that write into the residual stream (attention output, MLP down) use
``init_std / sqrt(2 * n_layers)`` so the residual variance does not grow with depth (GPT-2).
The rule lives in each layer's ``reset_parameters``, so a model built under
``torch.device("meta")`` is initialised the same way by ``to_empty()`` followed by
``reset_parameters()`` on the model, or on every layer as Lightning's ModelParallelStrategy does.

``PRESETS`` maps a preset name to its ``OLMoConfig``: ``tiny`` (233,472 parameters, the tiny workload's CPU model,
docs/tiny_workload.md), ``tiny4x`` (868,352: twice tiny's width), ``olmo_1b`` and ``olmo_7b`` (OLMo's shapes).
``get_config(name)`` returns a copy to modify; ``CausalLM`` takes the name itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from lit_cbs.errors import LitCBSConfigError, positive_int

__all__ = ["OLMoConfig", "PRESETS", "get_config", "rotary_cos_sin", "Block", "OLMo"]


@dataclass
class OLMoConfig:
    """Shape of an OLMo-style model.

    Args:
        vocab_size: token ids are in [0, vocab_size).
        d_model: residual width (features per token).
        n_layers: blocks.
        n_heads: attention heads (head dim = d_model / n_heads, must be even for RoPE).
        mlp_hidden: SwiGLU gated width (see the module docstring).
        context_length: longest sequence the model accepts, in tokens.
        tie_embeddings: reuse the embedding as the output projection.
        rope_theta: RoPE base period (positions).
        init_std: std of the weight initialisation.

    Raises:
        LitCBSConfigError: a size that is not a positive int, ``tie_embeddings`` not a bool, ``d_model`` not
            divisible by ``n_heads``, an odd head dimension, or ``rope_theta`` or ``init_std`` not above 0.

    Examples:
        >>> config = OLMoConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, mlp_hidden=32, context_length=8,
        ...                     tie_embeddings=True)
        >>> config.head_dim
        8
        >>> OLMoConfig(vocab_size=32, d_model=24, n_layers=2, n_heads=5, mlp_hidden=32, context_length=8,
        ...            tie_embeddings=True)
        Traceback (most recent call last):
        ...
        lit_cbs.errors.LitCBSConfigError: d_model=24 must be divisible by n_heads=5 (d_model % n_heads = 4)
    """

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
            raise LitCBSConfigError(
                f"d_model={self.d_model} must be divisible by n_heads={self.n_heads} "
                f"(d_model % n_heads = {self.d_model % self.n_heads})"
            )
        if (self.d_model // self.n_heads) % 2:
            raise LitCBSConfigError(
                f"head dim d_model / n_heads = {self.d_model // self.n_heads} must be even for rotary embeddings; "
                "change d_model or n_heads"
            )
        if not self.rope_theta > 0:
            raise LitCBSConfigError(f"rope_theta={self.rope_theta} must be > 0")
        if not self.init_std > 0:
            raise LitCBSConfigError(f"init_std={self.init_std} must be > 0")

    @property
    def head_dim(self) -> int:
        """Width of one attention head: d_model / n_heads."""
        return self.d_model // self.n_heads


PRESETS: dict[str, OLMoConfig] = {
    # The tiny workload's CPU model (docs/tiny_workload.md): 233,472 parameters (its "233k"), with an untied
    # output head. mlp_hidden = 4 * 64 * 2/3 rounded up to a multiple of 16.
    "tiny": OLMoConfig(
        vocab_size=256, d_model=64, n_layers=4, n_heads=4, mlp_hidden=176, context_length=128, tie_embeddings=False
    ),
    # The tiny model 3.7x over (868,352 parameters): twice the width at the same depth, head size
    # (16) and context, to check on a CPU whether a CBS curve measured on tiny carries to a larger model.
    # mlp_hidden = 4 * 128 * 2/3 rounded up to a multiple of 16.
    "tiny4x": OLMoConfig(
        vocab_size=256, d_model=128, n_layers=4, n_heads=8, mlp_hidden=352, context_length=128, tie_embeddings=False
    ),
    # OLMo-1B (vocab 50280 padded to a multiple of 128).
    "olmo_1b": OLMoConfig(
        vocab_size=50304,
        d_model=2048,
        n_layers=16,
        n_heads=16,
        mlp_hidden=8192,
        context_length=4096,
        tie_embeddings=True,
    ),
    "olmo_7b": OLMoConfig(
        vocab_size=50304,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        mlp_hidden=11008,
        context_length=4096,
        tie_embeddings=False,
    ),
}


def get_config(name: str) -> OLMoConfig:
    """The preset called ``name`` (a fresh copy, safe to modify).

    Args:
        name: a key of ``PRESETS``: ``tiny``, ``tiny4x``, ``olmo_1b``, ``olmo_7b``.

    Returns:
        A new ``OLMoConfig`` equal to the preset.

    Raises:
        LitCBSConfigError: no preset has that name.

    Examples:
        >>> get_config("tiny").d_model
        64
        >>> get_config("huge")
        Traceback (most recent call last):
        ...
        lit_cbs.errors.LitCBSConfigError: unknown model preset 'huge'; known presets: olmo_1b, olmo_7b, tiny, tiny4x
    """
    if name not in PRESETS:
        raise LitCBSConfigError(f"unknown model preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    return OLMoConfig(**vars(PRESETS[name]))


class TruncatedNormalLinear(nn.Linear):
    """A bias-free Linear layer whose ``reset_parameters`` draws N(0, init_std) truncated at 3 std.

    Examples:
        >>> layer = TruncatedNormalLinear(64, 64, init_std=0.02)
        >>> layer.bias is None, bool(layer.weight.abs().max() <= 0.06)
        (True, True)
    """

    def __init__(self, in_features: int, out_features: int, init_std: float):
        self.init_std = init_std  # set first: nn.Linear.__init__ calls reset_parameters
        super().__init__(in_features, out_features, bias=False)

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.weight, std=self.init_std, a=-3 * self.init_std, b=3 * self.init_std)


class TruncatedNormalEmbedding(nn.Embedding):
    """A token embedding whose ``reset_parameters`` draws N(0, init_std) truncated at 3 std.

    Examples:
        >>> embedding = TruncatedNormalEmbedding(256, 64, init_std=0.02)
        >>> tuple(embedding.weight.shape), bool(embedding.weight.abs().max() <= 0.06)
        ((256, 64), True)
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, init_std: float):
        self.init_std = init_std
        super().__init__(num_embeddings, embedding_dim)

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.weight, std=self.init_std, a=-3 * self.init_std, b=3 * self.init_std)


def layer_norm(x: torch.Tensor) -> torch.Tensor:
    """Non-parametric LayerNorm over the last dimension (OLMo: no weight, no bias).

    Examples:
        >>> layer_norm(torch.tensor([[1.0, 2.0, 3.0]]))
        tensor([[-1.2247,  0.0000,  1.2247]])
    """
    return F.layer_norm(x, (x.shape[-1],), eps=1e-5)


def rotary_cos_sin(
    seq_len: int, head_dim: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, each [seq_len, head_dim], for positions 0..seq_len-1.

    Computed per forward in float32 (cheap next to attention) rather than kept as a buffer, so
    nothing needs re-materialising after a meta-device build.

    Args:
        seq_len: positions (tokens).
        head_dim: width of one attention head (even).
        theta: RoPE base period.
        device: where to compute them.

    Returns:
        (cos, sin), each [seq_len, head_dim], float32.

    Examples:
        >>> cos, sin = rotary_cos_sin(8, 4, 10000.0, torch.device("cpu"))
        >>> cos.shape, cos[0].tolist()  # position 0: no rotation
        (torch.Size([8, 4]), [1.0, 1.0, 1.0, 1.0])
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + head_dim/2) of x [B, H, T, head_dim] by each position's angles (GPT-NeoX layout).

    Args:
        x: queries or keys [B, H, T, head_dim].
        cos: ``rotary_cos_sin``'s cos [T, head_dim].
        sin: its sin [T, head_dim].

    Returns:
        ``x`` rotated, in its dtype.

    Examples:
        >>> cos, sin = rotary_cos_sin(2, 2, 10000.0, torch.device("cpu"))
        >>> apply_rotary(torch.tensor([[[[1.0, 0.0], [1.0, 0.0]]]]), cos, sin).round(decimals=4)  # 0 and 1 radian
        tensor([[[[1.0000, 0.0000],
                  [0.5403, 0.8415]]]])
    """
    first, second = x.chunk(2, dim=-1)
    rotated_half = torch.cat((-second, first), dim=-1)
    return (x * cos + rotated_half * sin).to(x.dtype)


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary position embeddings on queries and keys.

    Examples:
        >>> config = get_config("tiny")
        >>> cos, sin = rotary_cos_sin(8, config.head_dim, config.rope_theta, torch.device("cpu"))
        >>> Attention(config)(torch.randn(2, 8, config.d_model), cos, sin).shape
        torch.Size([2, 8, 64])
    """

    def __init__(self, config: OLMoConfig):
        super().__init__()
        d, std = config.d_model, config.init_std
        self.n_heads = config.n_heads
        self.q_proj = TruncatedNormalLinear(d, d, std)
        self.k_proj = TruncatedNormalLinear(d, d, std)
        self.v_proj = TruncatedNormalLinear(d, d, std)
        self.out_proj = TruncatedNormalLinear(d, d, std / math.sqrt(2 * config.n_layers))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Attention's output [B, T, d_model] for ``x`` [B, T, d_model], rotated by ``cos`` and ``sin``
        [T, head_dim] (``rotary_cos_sin``); position t attends to positions 0..t."""
        batch, seq_len, d = x.shape

        def split_heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq_len, self.n_heads, d // self.n_heads).transpose(1, 2)

        q = apply_rotary(split_heads(self.q_proj(x)), cos, sin)
        k = apply_rotary(split_heads(self.k_proj(x)), cos, sin)
        v = split_heads(self.v_proj(x))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(batch, seq_len, d))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), gated width ``mlp_hidden``.

    Examples:
        >>> mlp = SwiGLU(get_config("tiny"))
        >>> mlp(torch.randn(2, 8, 64)).shape, sum(p.numel() for p in mlp.parameters())  # 3 x 64 x 176 weights
        (torch.Size([2, 8, 64]), 33792)
    """

    def __init__(self, config: OLMoConfig):
        super().__init__()
        d, h, std = config.d_model, config.mlp_hidden, config.init_std
        self.gate_proj = TruncatedNormalLinear(d, h, std)
        self.up_proj = TruncatedNormalLinear(d, h, std)
        self.down_proj = TruncatedNormalLinear(h, d, std / math.sqrt(2 * config.n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP's output [B, T, d_model] for ``x`` [B, T, d_model]."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)). The unit FSDP wraps.

    Args:
        config: the model's shape (``d_model``, ``n_heads``, ``mlp_hidden``, ``init_std``).

    Examples:
        >>> config = get_config("tiny")
        >>> block = Block(config)
        >>> cos, sin = rotary_cos_sin(8, config.head_dim, config.rope_theta, torch.device("cpu"))
        >>> block(torch.randn(2, 8, config.d_model), cos, sin).shape
        torch.Size([2, 8, 64])
        >>> sum(p.numel() for p in block.parameters())  # attention 4 x 64 x 64, SwiGLU 3 x 64 x 176
        50176
    """

    def __init__(self, config: OLMoConfig):
        super().__init__()
        self.attention = Attention(config)
        self.mlp = SwiGLU(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The block's output [B, T, d_model] for the residual stream ``x`` [B, T, d_model], at positions whose
        rotation ``cos`` and ``sin`` [T, head_dim] give (``rotary_cos_sin``).

        Args:
            x: the residual stream [B, T, d_model].
            cos: cosines of the rotary angles [T, head_dim].
            sin: sines of the rotary angles [T, head_dim].

        Returns:
            The residual stream after the block [B, T, d_model].
        """
        x = x + self.attention(layer_norm(x), cos, sin)
        return x + self.mlp(layer_norm(x))


class OLMo(nn.Module):
    """Decoder-only language model: ``forward(input_ids [B, T]) -> logits [B, T, vocab_size]``.

    Args:
        config: the model's shape (``OLMoConfig``, e.g. ``get_config("tiny")``).

    Examples:
        >>> config = OLMoConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, mlp_hidden=32, context_length=8,
        ...                     tie_embeddings=True)
        >>> model = OLMo(config)
        >>> model(torch.zeros(2, 8, dtype=torch.long)).shape
        torch.Size([2, 8, 32])
        >>> model.num_parameters(), model.num_parameters(exclude_embeddings=True)  # the embedding is 32 x 16
        (5632, 5120)

        The presets build on the meta device without memory:

        >>> with torch.device("meta"):
        ...     OLMo(get_config("olmo_1b")).num_parameters()
        1176764416
    """

    def __init__(self, config: OLMoConfig):
        super().__init__()
        self.config = config
        self.embedding = TruncatedNormalEmbedding(config.vocab_size, config.d_model, config.init_std)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        # Tied: logits use embedding.weight directly, so no Parameter is shared between modules
        # (sharing breaks under to_empty() and FSDP's per-module sharding).
        self.lm_head = (
            None if config.tie_embeddings else TruncatedNormalLinear(config.d_model, config.vocab_size, config.init_std)
        )

    def reset_parameters(self) -> None:
        """(Re-)initialise every weight; call after ``to_empty()`` on a model built on the meta device."""
        for module in self.modules():
            if isinstance(module, (TruncatedNormalLinear, TruncatedNormalEmbedding)):
                module.reset_parameters()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Next-token logits.

        Args:
            input_ids: token ids [B, T], T at most ``context_length``.

        Returns:
            Logits [B, T, vocab_size].

        Raises:
            ValueError: T is over ``context_length``.
        """
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
        x = layer_norm(x)
        if self.lm_head is None:
            return F.linear(x, self.embedding.weight)
        return self.lm_head(x)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters; ``exclude_embeddings`` leaves out the token embedding and an
        untied output projection (Kaplan et al.'s non-embedding count).

        Args:
            exclude_embeddings: count only the non-embedding parameters.

        Returns:
            The count (elements).
        """
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= self.embedding.weight.numel()
            if self.lm_head is not None:
                total -= self.lm_head.weight.numel()
        return total

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward + backward) per token at ``seq_len`` tokens per sequence.

        PaLM's estimate (Chowdhery et al. 2022, App. B; also nanoGPT's MFU): 6 * N + 12 * L * d * T,
        where N counts every weight used in a matmul (the non-embedding weights plus the
        vocab x d output projection, tied or not; the embedding lookup is free) and
        12 * L * d * T is the attention score and value matmuls over T positions (causal
        masking not discounted). Divide achieved FLOP/s by peak for MFU.

        Args:
            seq_len: tokens per sequence (T).

        Returns:
            FLOPs per token.

        Examples:
            >>> OLMo(get_config("tiny")).flops_per_token(128)  # 6 x (233,472 - 256 x 64) + 12 x 4 x 64 x 128
            1695744
        """
        c = self.config
        matmul_weights = self.num_parameters(exclude_embeddings=True) + c.vocab_size * c.d_model
        return 6 * matmul_weights + 12 * c.n_layers * c.d_model * seq_len
