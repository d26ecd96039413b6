"""The models: the OLMo-style decoder and its size presets (``olmo``, ``decoder``), a Hugging Face
causal LM (``hf``), the one that builds either from its config (``build``), ``CausalLM``, the LightningModule
that trains either (``lm``), and the token-mean loss a step's micro-batches share (``token_loss``)."""

from typing import TYPE_CHECKING

from lit_cbs._lazy import lazy_exports
from lit_cbs.models.olmo import PRESETS, Block, OLMo, OLMoConfig, get_config

_EXPORTS = {"CausalLM": "lit_cbs.models.lm", "token_mean_loss": "lit_cbs.models.token_loss"}

__all__ = ["OLMo", "OLMoConfig", "PRESETS", "Block", "get_config", *_EXPORTS]

# What type checkers and editors see (`X as X`: exported); at run time each name loads on first use.
if TYPE_CHECKING:
    from lit_cbs.models.lm import CausalLM as CausalLM
    from lit_cbs.models.token_loss import token_mean_loss as token_mean_loss

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
