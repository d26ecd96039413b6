"""``build_decoder``: the decoder a model config describes, lit_cbs's OLMo or a Hugging Face causal LM.

The one module that imports both decoders (``lit_cbs.models.olmo``, ``lit_cbs.models.hf``), so that neither imports
the other: what they share (``DecoderDims``, the stacks of blocks, the embeddings) is in ``lit_cbs.models.decoder``.
"""

from __future__ import annotations

from typing import Any

from lit_cbs.models.hf import HFDecoder
from lit_cbs.models.olmo import OLMo, OLMoConfig

__all__ = ["build_decoder"]


def build_decoder(config: OLMoConfig | Any) -> OLMo | HFDecoder:
    """``OLMo(config)`` for an ``OLMoConfig``, ``HFDecoder(config)`` for a ``transformers`` config (on the
    current default device: under ``torch.device("meta")`` no memory is allocated).

    Args:
        config: an ``OLMoConfig`` or a ``transformers`` config.

    Returns:
        The decoder, freshly initialised.

    Raises:
        LitCBSConfigError: a ``transformers`` config while transformers is not installed, or one whose model
            holds no stack of its decoder layers.

    Examples:
        >>> import torch
        >>> from lit_cbs.models import get_config
        >>> with torch.device("meta"):
        ...     decoder = build_decoder(get_config("tiny"))
        >>> type(decoder).__name__, decoder.num_parameters()
        ('OLMo', 233472)
    """
    if isinstance(config, OLMoConfig):
        return OLMo(config)
    return HFDecoder(config)
