"""The decoders ``lit_cbs.lm.CausalLM`` trains, and the shape numbers the plan and the recipes read from them.

A model config is either an ``OLMoConfig`` (lit_cbs's own decoder, ``lit_cbs.models.olmo.OLMo``) or
a ``transformers`` config (``lit_cbs.models.hf.HFDecoder``); ``build_decoder`` builds either, and
``DecoderDims`` holds the sizes both have under one set of names.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from lit_cbs.models.olmo import OLMo, OLMoConfig


@dataclasses.dataclass(frozen=True)
class DecoderDims:
    """A decoder's sizes, in ``OLMoConfig``'s names, for the memory plan and the recipes' checks."""

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
        return DecoderDims(
            vocab_size=config.vocab_size, d_model=config.d_model, n_layers=config.n_layers, n_heads=config.n_heads,
            head_dim=config.head_dim, mlp_hidden=config.mlp_hidden, context_length=config.context_length,
            tie_embeddings=config.tie_embeddings,
        )
    from lit_cbs.models.hf import hf_dims

    return hf_dims(config)


def build_decoder(config: OLMoConfig | Any) -> nn.Module:
    """``OLMo(config)`` for an ``OLMoConfig``, ``HFDecoder(config)`` for a ``transformers`` config (on the
    current default device: under ``torch.device("meta")`` no memory is allocated)."""
    if isinstance(config, OLMoConfig):
        return OLMo(config)
    from lit_cbs.models.hf import HFDecoder

    return HFDecoder(config)


def config_as_dict(config: OLMoConfig | Any) -> dict[str, Any]:
    """The config as plain values (a checkpoint's hyperparameters load with ``weights_only=True``), that
    ``lit_cbs.lm.resolve_model_config`` turns back into the config."""
    if isinstance(config, OLMoConfig):
        return dataclasses.asdict(config)
    return config.to_diff_dict()
