"""What ``OLMo`` and ``HFDecoder`` have in common: their sizes under one set of names, their blocks, embeddings."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from lit_cbs.models.olmo import OLMoConfig

__all__ = ["DecoderDims", "decoder_dims"]


@dataclasses.dataclass(frozen=True)
class DecoderDims:
    """A decoder's sizes in ``OLMoConfig``'s names (``CausalLM.dims``), for the memory plan and the recipes' checks."""

    vocab_size: int
    d_model: int  # residual width (transformers: hidden_size)
    n_layers: int
    n_heads: int  # query heads
    head_dim: int
    mlp_hidden: int  # the MLP's hidden width (transformers: intermediate_size)
    context_length: int  # longest sequence in tokens (transformers: max_position_embeddings)
    tie_embeddings: bool


def decoder_dims(config: OLMoConfig | Any) -> DecoderDims:
    """The ``DecoderDims`` of an ``OLMoConfig`` or a ``transformers`` config."""
    if isinstance(config, OLMoConfig):
        return DecoderDims(**{field.name: getattr(config, field.name) for field in dataclasses.fields(DecoderDims)})
    hidden, heads = config.hidden_size, config.num_attention_heads  # Llama's names; transformers aliases GPT-2's
    return DecoderDims(
        vocab_size=config.vocab_size,
        d_model=hidden,
        n_layers=config.num_hidden_layers,
        n_heads=heads,
        head_dim=getattr(config, "head_dim", None) or hidden // heads,
        mlp_hidden=getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden,
        context_length=config.max_position_embeddings,
        tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
    )


def layer_stacks(module: nn.Module) -> list[str]:
    """Paths of ``module``'s stacks of blocks (a ``ModuleList`` of one class, with parameters), found by type."""
    stacks: list[str] = []
    for path, child in module.named_modules():
        if any(path.startswith(stack + ".") for stack in stacks):
            continue
        if (
            isinstance(child, nn.ModuleList)
            and len(child) > 0
            and len({type(entry) for entry in child}) == 1
            and all(any(True for _ in entry.parameters()) for entry in child)
        ):
            stacks.append(path)
    return stacks


def embedding_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``module``'s ``nn.Embedding`` layers, each once, in module order."""
    return list({id(p): p for m in module.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}.values())
