"""Qwen3 (Hugging Face's Qwen3ForCausalLM): Llama's architecture plus an
RMSNorm over each head of q and k (q_norm/k_norm) before RoPE; head_dim comes
from the config (it is not hidden_size / num_heads for most sizes). The norms
being per head, a rank applies them to its own heads alone."""

from __future__ import annotations

import torch

from pagoda.model_executor.layers.layernorm import RMSNorm
from pagoda.model_executor.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, config, dtype: torch.dtype):
        super().__init__(config, dtype)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)

    def position_encode(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # One row per head; reshape copies q/k out of the fused qkv output
        # (the norm writes new tensors anyway).
        num_tokens = q.shape[0]
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(num_tokens, self.q_size)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(num_tokens, self.kv_size)
        return super().position_encode(positions, q, k)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
