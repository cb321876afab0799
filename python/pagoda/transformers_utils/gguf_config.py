"""The config of a GGUF model, from the file's metadata: the values
transformers' own GGUF loading gives (AutoConfig.from_pretrained(folder,
gguf_file=name)), field by field, for the architectures the GGUF loader
reads, without transformers parsing the file (its reader holds every field
as numpy objects, about 160 MB for SmolLM2's tokenizer) and without
importing transformers' config classes (hf_config.HFConfig holds their
values)."""

from __future__ import annotations

from pathlib import Path

from pagoda.transformers_utils.gguf_reader import GGUFHeader, read_gguf_header
from pagoda.transformers_utils.hf_config import HFConfig

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


def load_gguf_config(path: str | Path) -> HFConfig:
    """The config of the GGUF file at `path`; ValueError (naming the file and
    the key) for an unsupported architecture or missing shape metadata."""
    path = Path(path)
    header = read_gguf_header(str(path))
    raw = gguf_config_dict(header)
    arch = header.architecture
    missing = [f"{arch}.{key}" for key in _REQUIRED_KEYS if _ARCH_KEYS[key] not in raw]
    if "vocab_size" not in raw:
        missing.append(f"{arch}.vocab_size (or tokenizer.ggml.tokens)")
    if missing:
        raise ValueError(f"{header.path}: the GGUF metadata lacks {', '.join(missing)}")
    return HFConfig.from_dict(raw, str(path.parent))
