"""The config of a GGUF model, from the file's metadata: the values
transformers' own GGUF loading gives (AutoConfig.from_pretrained(folder,
gguf_file=name)), field by field, for the architectures the GGUF loader
reads, without transformers parsing the file (its reader holds every field
as numpy objects, about 160 MB for SmolLM2's tokenizer) and without
importing transformers' config classes: any of them imports
torch.distributed.tensor, sympy and accelerate on the way (about 52 MB of a
serving process; docs/BENCHMARKS.md)."""

from __future__ import annotations

from pathlib import Path

from pagoda.transformers_utils.gguf_reader import GGUFHeader, read_gguf_header

# llama.cpp's "<architecture>.<key>" -> the transformers config field.
_ARCH_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
# Without these the shape would be a config class's default (Llama-2-7B's):
# a file that lacks one is broken, not a 7B model.
_REQUIRED_KEYS = ("block_count", "feed_forward_length", "embedding_length", "attention.head_count")
# transformers takes head_dim from the rotary width for these only (Qwen's
# configs derive it, or keep their class default).
_HEAD_DIM_FROM_ROPE = ("llama", "mistral")
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
_GENERAL_KEYS = {"general.architecture": "model_type", "general.name": "_model_name_or_path"}
_TOKEN_ID_KEYS = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.unknown_token_id": "unk_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}

# What transformers' config classes (LlamaConfig, MistralConfig, Qwen2Config,
# Qwen3Config) hold where the file says nothing, for the fields the engine
# reads; a field a class lacks is left out here too, so getattr's default
# applies alike. head_dim: None is hidden_size // num_attention_heads, and
# num_key_value_heads: None is num_attention_heads (as the classes derive
# them). tests/models/test_gguf_metadata.py holds these to transformers'.
_LLAMA_TOKENS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None}
_QWEN = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None, "max_position_embeddings": 32768,
         "num_key_value_heads": 32, "use_sliding_window": False, "sliding_window": None, "max_window_layers": 28}
_CLASS_DEFAULTS = {
    "llama": {**_LLAMA_TOKENS, "max_position_embeddings": 2048, "num_key_value_heads": None, "head_dim": None,
              "attention_bias": False, "mlp_bias": False},
    "mistral": {**_LLAMA_TOKENS, "max_position_embeddings": 4096 * 32, "num_key_value_heads": 8, "head_dim": None,
                "sliding_window": 4096},
    "qwen2": _QWEN,
    "qwen3": {**_QWEN, "head_dim": 128, "attention_bias": False},
}
_COMMON_DEFAULTS = {"architectures": None, "dtype": None, "hidden_act": "silu", "rms_norm_eps": 1e-6}
_DEFAULT_ROPE_THETA = 10000.0


def model_type(header: GGUFHeader) -> str:
    """The transformers model type of the file. llama.cpp writes Mistral as
    llama; transformers renames it only when general.name is exactly
    "mistral" (it tests membership in the field's list of values), and the
    config follows it so that both agree."""
    if header.architecture == "llama" and header.metadata.get("general.name") == "mistral":
        return "mistral"
    return header.architecture


def gguf_config_dict(header: GGUFHeader) -> dict:
    """The config dict transformers builds from this file's metadata (before
    its config class fills in defaults); ValueError for an architecture
    outside ARCHITECTURES."""
    arch, kind = header.architecture, model_type(header)
    if kind not in ARCHITECTURES:
        raise ValueError(f"{header.path}: GGUF architecture {arch!r} has no config mapping; supported: {ARCHITECTURES}")
    keys = {f"{arch}.{key}": field for key, field in _ARCH_KEYS.items()}
    if kind in _HEAD_DIM_FROM_ROPE:
        keys[f"{arch}.rope.dimension_count"] = "head_dim"
    keys |= _GENERAL_KEYS | _TOKEN_ID_KEYS
    config = {"tie_word_embeddings": all(t.name != "output.weight" for t in header.tensors)}
    for key, field in keys.items():
        if key in header.metadata:
            value = header.metadata[key]
            # transformers unwraps a one-element array into its value.
            config[field] = value[0] if isinstance(value, list) and len(value) == 1 else value
    config["model_type"] = kind
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in header.metadata:
        tokens = header.metadata["tokenizer.ggml.tokens"]  # its length unless read as a list
        config["vocab_size"] = tokens if isinstance(tokens, int) else len(tokens)
    return config


class GGUFModelConfig:
    """A GGUF model's config as the engine reads it: the attributes of the
    transformers config class of its model type that the models, the loader
    and ModelConfig use, with that class's values (`update` for
    hf_overrides, as on a transformers config). `to_transformers()` builds
    the transformers config itself, for code that needs one (the
    transformers baseline)."""

    def __init__(self, name_or_path: str, **fields):
        self.name_or_path = name_or_path
        self.__dict__.update(fields)

    @classmethod
    def from_header(cls, header: GGUFHeader, name_or_path: str) -> GGUFModelConfig:
        raw = gguf_config_dict(header)
        arch = header.architecture
        missing = [f"{arch}.{key}" for key in _REQUIRED_KEYS if _ARCH_KEYS[key] not in raw]
        if "vocab_size" not in raw:
            missing.append(f"{arch}.vocab_size (or tokenizer.ggml.tokens)")
        if missing:
            raise ValueError(f"{header.path}: the GGUF metadata lacks {', '.join(missing)}")
        fields = _COMMON_DEFAULTS | _CLASS_DEFAULTS[raw["model_type"]] | raw
        if fields.get("num_key_value_heads", 0) is None:
            fields["num_key_value_heads"] = fields["num_attention_heads"]
        if fields.get("head_dim", 0) is None:
            fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
        # transformers 5 keeps the rotary settings in one dict.
        fields["rope_parameters"] = {"rope_theta": fields.pop("rope_theta", _DEFAULT_ROPE_THETA), "rope_type": "default"}
        return cls(name_or_path, **fields)

    def update(self, overrides: dict) -> None:
        self.__dict__.update(overrides)

    def to_dict(self) -> dict:
        return {k: v for k, v in vars(self).items() if k != "name_or_path"}

    def to_transformers(self):
        """The transformers config (LlamaConfig, Qwen2Config, ...) with these
        values: what AutoConfig.from_pretrained(folder, gguf_file=name) makes."""
        from transformers import CONFIG_MAPPING

        return CONFIG_MAPPING[self.model_type].from_dict(self.to_dict(), name_or_path=self.name_or_path)

    def __repr__(self) -> str:
        return f"GGUFModelConfig({self.to_dict()})"


def load_gguf_config(path: str | Path) -> GGUFModelConfig:
    """The config of the GGUF file at `path`; ValueError (naming the file and
    the key) for an unsupported architecture or missing shape metadata."""
    path = Path(path)
    return GGUFModelConfig.from_header(read_gguf_header(str(path)), str(path.parent))
