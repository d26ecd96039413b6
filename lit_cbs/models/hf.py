"""``HFDecoder``: a ``transformers`` causal LM built from a config, trained as ``OLMo`` is; ``build_decoder``."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import nn

from lit_cbs.errors import LitCBSConfigError
from lit_cbs.models.decoder import decoder_dims, layer_stacks
from lit_cbs.models.olmo import OLMo, OLMoConfig

__all__ = ["HFDecoder", "build_decoder", "hf_config"]


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as error:
        raise LitCBSConfigError(
            "a model config with model_type builds a Hugging Face transformers model, but transformers is not "
            'installed: pip install -e ".[hf]" (or pip install transformers)'
        ) from error
    return transformers


def is_hf_config(config: Any) -> bool:
    """True for a ``transformers`` model config (without importing transformers)."""
    return any(
        cls.__name__ in ("PreTrainedConfig", "PretrainedConfig") and cls.__module__.startswith("transformers")
        for cls in type(config).__mro__
    )


def hf_config(fields: Mapping[str, Any]) -> Any:
    """The ``transformers`` config ``{"model_type": name, **fields}`` describes, or LitCBSConfigError."""
    transformers = _transformers()
    fields = dict(fields)
    model_type = fields.pop("model_type")
    if model_type not in transformers.CONFIG_MAPPING:
        close = difflib.get_close_matches(str(model_type), list(transformers.CONFIG_MAPPING.keys()), n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise LitCBSConfigError(
            f"model_type={model_type!r} is not a transformers model type{hint}; use one AutoModelForCausalLM builds, "
            "e.g. llama, olmo2, qwen2, mistral, gpt2"
        )
    config_class = transformers.CONFIG_MAPPING[model_type]
    if config_class not in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise LitCBSConfigError(
            f"model_type={model_type!r} has no causal language model in transformers (AutoModelForCausalLM); "
            "use a decoder such as llama, olmo2, qwen2, mistral or gpt2"
        )
    known = set(config_class().to_dict()) | set(config_class.attribute_map)
    if unknown := sorted(set(fields) - known):
        raise LitCBSConfigError(
            f"field(s) {unknown} are not {config_class.__name__} fields (transformers would keep them unused); "
            f"its fields include {', '.join(sorted(name for name in known if not name.startswith('_'))[:24])}, ..."
        )
    return config_class(**fields)


class HFDecoder(nn.Module):
    """A ``transformers`` causal LM built from ``config``; its parameters are named ``lm.<the model's names>``."""

    def __init__(self, config: Any):
        super().__init__()
        self.config = config
        self.lm = _transformers().AutoModelForCausalLM.from_config(config)
        n_layers = config.num_hidden_layers
        if not (paths := [path for path in layer_stacks(self.lm) if len(self.lm.get_submodule(path)) == n_layers]):
            raise LitCBSConfigError(
                f"{type(self.lm).__name__} holds no nn.ModuleList of its {n_layers} decoder layers (num_hidden_layers) "
                "to shard, checkpoint and compile one by one; use a decoder such as llama, olmo2, qwen2 or gpt2"
            )
        self._layers_path = paths[0]

    @property
    def blocks(self) -> nn.ModuleList:
        return cast(nn.ModuleList, self.lm.get_submodule(self._layers_path))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab_size]; a batch of no sample runs one padding row, so every layer's collectives fire."""
        empty = input_ids.shape[0] == 0
        logits = self.lm(input_ids=input_ids.new_zeros(1, input_ids.shape[1]) if empty else input_ids, use_cache=False)
        return cast(torch.Tensor, logits.logits[:0] if empty else logits.logits)

    def reset_parameters(self) -> None:
        self.lm.init_weights()

    def num_parameters(self) -> int:
        """Number of parameters (a tied head once)."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int) -> int:
        """PaLM's training FLOPs per token, as ``OLMo.flops_per_token``, over every ``nn.Linear`` weight."""
        weights = {id(m.weight): m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear)}  # tied: once
        dims = decoder_dims(self.config)
        return 6 * sum(weights.values()) + 12 * dims.n_layers * dims.n_heads * dims.head_dim * seq_len


def build_decoder(config: OLMoConfig | Any) -> OLMo | HFDecoder:
    """``OLMo(config)`` for an ``OLMoConfig``, ``HFDecoder(config)`` for a ``transformers`` config."""
    return OLMo(config) if isinstance(config, OLMoConfig) else HFDecoder(config)
