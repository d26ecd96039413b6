"""``build_decoder``: the one module that imports both decoders, so that neither imports the other."""

from __future__ import annotations

from typing import Any

from lit_cbs.models.hf import HFDecoder
from lit_cbs.models.olmo import OLMo, OLMoConfig

__all__ = ["build_decoder"]


def build_decoder(config: OLMoConfig | Any) -> OLMo | HFDecoder:
    """``OLMo(config)`` for an ``OLMoConfig``, ``HFDecoder(config)`` for a ``transformers`` config."""
    if isinstance(config, OLMoConfig):
        return OLMo(config)
    return HFDecoder(config)
