"""Architecture name (config.architectures) -> model class."""

from __future__ import annotations

import importlib

from torch import nn

# architecture -> (module in pagoda.model_executor.models, class)
_MODELS = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),  # Llama with GQA; same weights layout
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "OPTForCausalLM": ("opt", "OPTForCausalLM"),
}

# Configs that transformers builds from GGUF files have no `architectures`:
# fall back on model_type.
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "opt": "OPTForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(hf_config) -> type[nn.Module]:
    architectures = list(getattr(hf_config, "architectures", None) or [])
    model_type = getattr(hf_config, "model_type", None)
    if not architectures and model_type in _MODEL_TYPES:
        architectures = [_MODEL_TYPES[model_type]]
    for arch in architectures:
        if arch in _MODELS:
            module, cls = _MODELS[arch]
            return getattr(importlib.import_module(f"pagoda.model_executor.models.{module}"), cls)
    raise ValueError(
        f"unsupported model architecture {architectures or None} (model_type {model_type!r}); "
        f"supported: {', '.join(supported_architectures())}"
    )
