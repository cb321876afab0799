"""Qwen3 (Hugging Face's Qwen3ForCausalLM): Llama's architecture plus an
RMSNorm over each head of q and k (q_norm/k_norm) before RoPE; head_dim comes
from the config (it is not hidden_size / num_heads for most sizes). The norms
being per head, a rank applies them to its own heads alone; the attention
layer applies them with RoPE and the cache write (ops.rope_and_cache)."""

from __future__ import annotations

import torch

from pagoda.model_executor.layers.layernorm import RMSNorm
from pagoda.model_executor.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, config, dtype: torch.dtype):
        super().__init__(config, dtype)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)

    def qk_norms(self) -> tuple[RMSNorm, RMSNorm]:
        return self.q_norm, self.k_norm


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
