"""The OLMo-style decoder and its presets, ``CausalLM`` (which trains it or a Hugging Face LM), the token-mean loss."""

from typing import TYPE_CHECKING

from lit_cbs._lazy import lazy_exports
from lit_cbs.models.olmo import PRESETS, OLMo, OLMoConfig, get_config

_EXPORTS = {"CausalLM": "lit_cbs.models.lm", "token_mean_loss": "lit_cbs.models.token_loss"}

__all__ = ["OLMo", "OLMoConfig", "PRESETS", "get_config", *_EXPORTS]

if TYPE_CHECKING:
    from lit_cbs.models.lm import CausalLM as CausalLM
    from lit_cbs.models.token_loss import token_mean_loss as token_mean_loss

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
