"""The OLMo-style decoder and its size presets."""

from lit_cbs.models.olmo import PRESETS, Block, OLMo, OLMoConfig, get_config

__all__ = ["OLMo", "OLMoConfig", "PRESETS", "Block", "get_config"]
