"""What the decoders ``lit_cbs.models.lm.CausalLM`` trains have in common, and the shape numbers the plan and the
recipes read from them.

A model config is either an ``OLMoConfig`` (lit_cbs's own decoder, ``lit_cbs.models.olmo.OLMo``) or
a ``transformers`` config (``lit_cbs.models.hf.HFDecoder``); ``lit_cbs.models.build.build_decoder`` builds
either, and ``DecoderDims`` holds the sizes both have under one set of names (``decoder_dims``, from either
config without importing transformers). ``layer_stacks`` and
``embedding_parameters`` find, in any model, what the sharding, the noise scale's groups, the
weight decay and the plan treat apart: the stacks of blocks and the embeddings.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from lit_cbs.models.olmo import OLMoConfig

__all__ = ["DecoderDims", "decoder_dims"]


@dataclasses.dataclass(frozen=True)
class DecoderDims:
    """A decoder's sizes, in ``OLMoConfig``'s names, for the memory plan and the recipes' checks
    (``CausalLM.dims``).

    Attributes:
        vocab_size: token ids are in [0, vocab_size).
        d_model: residual width (transformers: ``hidden_size``).
        n_layers: decoder blocks.
        n_heads: query heads.
        head_dim: width of one attention head.
        mlp_hidden: the MLP's hidden width (transformers: ``intermediate_size``).
        context_length: longest sequence, in tokens (transformers: ``max_position_embeddings``).
        tie_embeddings: whether the output projection reuses the token embedding.

    Examples:
        >>> from lit_cbs.models import get_config
        >>> decoder_dims(get_config("tiny"))
        DecoderDims(vocab_size=256, d_model=64, n_layers=4, n_heads=4, head_dim=16, mlp_hidden=176, \
context_length=128, tie_embeddings=False)
    """

    vocab_size: int
    d_model: int  # residual width (transformers: hidden_size)
    n_layers: int
    n_heads: int  # query heads
    head_dim: int
    mlp_hidden: int  # the MLP's hidden width (transformers: intermediate_size)
    context_length: int  # longest sequence in tokens (transformers: max_position_embeddings)
    tie_embeddings: bool


def decoder_dims(config: OLMoConfig | Any) -> DecoderDims:
    """The ``DecoderDims`` of an ``OLMoConfig`` or a ``transformers`` config.

    Args:
        config: an ``OLMoConfig``, or a ``transformers`` config (read by ``hf_dims``).

    Returns:
        Its sizes.

    Examples:
        >>> from lit_cbs.models import get_config
        >>> dims = decoder_dims(get_config("tiny"))
        >>> dims.n_layers, dims.head_dim, dims.context_length
        (4, 16, 128)
    """
    if isinstance(config, OLMoConfig):
        return DecoderDims(
            vocab_size=config.vocab_size,
            d_model=config.d_model,
            n_layers=config.n_layers,
            n_heads=config.n_heads,
            head_dim=config.head_dim,
            mlp_hidden=config.mlp_hidden,
            context_length=config.context_length,
            tie_embeddings=config.tie_embeddings,
        )
    return hf_dims(config)


def hf_dims(config: Any) -> DecoderDims:
    """The ``DecoderDims`` of a ``transformers`` config (Llama's names; GPT-2's are aliased by transformers).

    Args:
        config: a ``transformers`` config, or any object with its attributes (``hidden_size``,
            ``num_attention_heads``, ``num_hidden_layers``, ``vocab_size``, ``max_position_embeddings``; optional
            ``head_dim``, ``intermediate_size`` or ``n_inner``, ``tie_word_embeddings``).

    Returns:
        Its sizes; without ``head_dim``, hidden_size / heads; without an MLP width, 4 x hidden_size.

    Examples:
        >>> from types import SimpleNamespace
        >>> llama_like = SimpleNamespace(vocab_size=100, hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
        ...                              intermediate_size=64, max_position_embeddings=16, tie_word_embeddings=True)
        >>> hf_dims(llama_like)
        DecoderDims(vocab_size=100, d_model=32, n_layers=2, n_heads=4, head_dim=8, mlp_hidden=64, \
context_length=16, tie_embeddings=True)
    """
    hidden, heads = config.hidden_size, config.num_attention_heads
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


def config_as_dict(config: OLMoConfig | Any) -> dict[str, Any]:
    """The config as plain values (a checkpoint's hyperparameters load with ``weights_only=True``), that
    ``lit_cbs.models.lm.resolve_model_config`` turns back into the config.

    Args:
        config: an ``OLMoConfig`` (all its fields) or a ``transformers`` config (the fields that differ from
            its class's defaults, with ``model_type``).

    Returns:
        A dict of plain values.

    Examples:
        >>> from lit_cbs.models import get_config
        >>> config_as_dict(get_config("tiny"))["mlp_hidden"]
        176
    """
    if isinstance(config, OLMoConfig):
        return dataclasses.asdict(config)
    return config.to_diff_dict()


def layer_stacks(module: nn.Module) -> list[str]:
    """The paths of ``module``'s stacks of transformer blocks: each ``nn.ModuleList`` whose entries are
    all of one class and all hold parameters, outside any other such stack, in definition order.

    ``["model.blocks"]`` for ``CausalLM`` on lit_cbs's OLMo, ``["model.lm.model.layers"]`` on a
    transformers Llama, ``["model.transformer.h"]`` for a GPT-2 held as ``self.model``. Found from the
    modules, not the names: activation checkpointing, ``torch.compile`` and FSDP2 keep both.

    Args:
        module: any model.

    Returns:
        The stacks' paths (``named_modules`` names; ``""`` for ``module`` itself).

    Examples:
        >>> from lit_cbs.models import OLMo, get_config
        >>> layer_stacks(OLMo(get_config("tiny")))
        ['blocks']
    """
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
    """The parameters of ``module``'s ``nn.Embedding`` layers (token and position embeddings), each once.

    Args:
        module: any model.

    Returns:
        The embedding parameters, in module order.

    Examples:
        >>> from lit_cbs.models import OLMo, get_config
        >>> [tuple(p.shape) for p in embedding_parameters(OLMo(get_config("tiny")))]  # vocab_size x d_model
        [(256, 64)]
    """
    return list({id(p): p for m in module.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}.values())
