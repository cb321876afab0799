"""A model's config as the engine reads it, without transformers' config
classes: for each model type Pagoda runs, the attributes of transformers'
class (LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, OPTConfig) with
that class's defaults and derived values, from a folder's config.json (here)
or a GGUF file's metadata (gguf_config). Importing any of those classes
imports torch.distributed's tensor package, sympy and accelerate on the way:
about half a second of the engine core's start on the dev machine, which
waits for its config before it builds the model, and 52 MB of a process
(docs/BENCHMARKS.md). tests/models/test_hf_config.py holds these values to
transformers'."""

from __future__ import annotations

import json
from pathlib import Path

# transformers 5.x's class defaults, for the fields the engine reads. A field
# a class lacks is left out here too, so getattr's default applies alike;
# "rope_parameters" marks the classes with rotary embeddings.
_ROTARY = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_parameters": None}
_LLAMA_TOKENS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None}
_QWEN = {**_ROTARY, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 32768,
         "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28,
         "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
CLASS_DEFAULTS = {
    "llama": {**_ROTARY, **_LLAMA_TOKENS, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None,
              "max_position_embeddings": 2048, "attention_bias": False, "mlp_bias": False},
    "mistral": {**_ROTARY, **_LLAMA_TOKENS, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None,
                "max_position_embeddings": 4096 * 32, "sliding_window": 4096},
    "qwen2": _QWEN,
    "qwen3": {**_QWEN, "head_dim": 128, "attention_bias": False},
    "opt": {"vocab_size": 50272, "hidden_size": 768, "num_hidden_layers": 12, "ffn_dim": 3072,
            "max_position_embeddings": 2048, "do_layer_norm_before": True, "_remove_final_layer_norm": False,
            "word_embed_proj_dim": None, "num_attention_heads": 12, "activation_function": "relu",
            "bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1, "enable_bias": True,
            "layer_norm_elementwise_affine": True, "tie_word_embeddings": True},
}
_COMMON_DEFAULTS = {"architectures": None, "dtype": None}
_DEFAULT_ROPE_THETA = 10000.0
# Rotary types whose scaling needs the pretraining length (transformers fills it in).
_ROPE_TYPES_WITH_ORIGINAL_LENGTH = ("llama3", "yarn", "longrope")
# Sizes the model is built from: a value that is not a positive int is the
# config's error, said here rather than as a shape error deep in the model.
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "ffn_dim", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "max_position_embeddings", "word_embed_proj_dim")


class HFConfig:
    """The attributes of the transformers config class of a model type that
    the models, the loaders and ModelConfig read, with that class's values
    (`update` for hf_overrides, as on a transformers config).
    `to_transformers()` builds the transformers config itself, for code that
    needs one (the transformers baseline)."""

    def __init__(self, name_or_path: str, **fields):
        self.name_or_path = name_or_path
        self.__dict__.update(fields)

    @classmethod
    def from_dict(cls, raw: dict, name_or_path: str) -> HFConfig:
        """What transformers' class for raw["model_type"] (a key of
        CLASS_DEFAULTS) makes of the config dict `raw`: its defaults where
        raw says nothing, its derived fields, the rotary settings in one
        dict, the dtype under its new name (a string, as config.json has it,
        where transformers holds a torch.dtype). ValueError, naming the
        field, for a size that is not a positive int or heads that do not
        divide the hidden size."""
        kind = raw["model_type"]
        fields = _COMMON_DEFAULTS | CLASS_DEFAULTS[kind] | raw
        dtype = fields.pop("torch_dtype", None)  # transformers 4's name
        if fields["dtype"] is None:
            fields["dtype"] = dtype
        _check_sizes(fields, name_or_path)
        derive_head_dim = kind in ("llama", "mistral") and fields["head_dim"] is None
        # LlamaConfig checks this always; a derived head_dim needs it too.
        if (kind == "llama" or derive_head_dim) and fields["hidden_size"] % fields["num_attention_heads"]:
            raise ValueError(f"{name_or_path}: config field hidden_size ({fields['hidden_size']}) is not a multiple "
                             f"of num_attention_heads ({fields['num_attention_heads']})")
        if derive_head_dim:
            fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
        if kind != "opt" and fields["num_key_value_heads"] is None:
            fields["num_key_value_heads"] = fields["num_attention_heads"]
        if kind in ("qwen2", "qwen3") and not fields["use_sliding_window"]:
            fields["sliding_window"] = None
        if kind == "opt" and fields["word_embed_proj_dim"] is None:
            fields["word_embed_proj_dim"] = fields["hidden_size"]
        if "rope_parameters" in CLASS_DEFAULTS[kind]:
            fields["rope_parameters"] = _rope_parameters(fields)
        return cls(name_or_path, **fields)

    def update(self, overrides: dict) -> None:
        _check_sizes(overrides, self.name_or_path)
        self.__dict__.update(overrides)

    def to_dict(self) -> dict:
        return {k: v for k, v in vars(self).items() if k != "name_or_path"}

    def to_transformers(self):
        """The transformers config (LlamaConfig, Qwen2Config, ...) with these
        values: what AutoConfig.from_pretrained makes of the same folder or file."""
        from transformers import CONFIG_MAPPING

        return CONFIG_MAPPING[self.model_type].from_dict(self.to_dict(), name_or_path=self.name_or_path)

    def __repr__(self) -> str:
        return f"HFConfig({self.to_dict()})"


def _check_sizes(fields: dict, source: str) -> None:
    for name in _SIZES:
        value = fields.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{source}: config field {name} must be a positive int, got {value!r}")


def _rope_parameters(fields: dict) -> dict:
    """transformers 5's one dict of rotary settings, from either its own
    `rope_parameters` or transformers 4's `rope_scaling`, `rope_theta` and
    `partial_rotary_factor` (taken out of `fields`, as transformers does)."""
    params = dict(fields.pop("rope_scaling", None) or fields["rope_parameters"] or {})
    params.setdefault("rope_theta", fields.pop("rope_theta", _DEFAULT_ROPE_THETA))
    partial = fields.pop("partial_rotary_factor", None)
    if partial is not None:
        params.setdefault("partial_rotary_factor", partial)
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] in _ROPE_TYPES_WITH_ORIGINAL_LENGTH:
        params.setdefault("original_max_position_embeddings", fields["max_position_embeddings"])
    return params


def load_hf_config(folder: str | Path):
    """The config of the model folder `folder` (its config.json): an HFConfig
    for the model types of CLASS_DEFAULTS, else transformers' own config
    class (whose model the registry then accepts or refuses by name)."""
    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read the model's config ({e})") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: the model's config must be a JSON object, got {type(raw).__name__}")
    if raw.get("model_type") in CLASS_DEFAULTS:
        return HFConfig.from_dict(raw, str(folder))
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)
