"""Qwen2 (Hugging Face's Qwen2ForCausalLM): Llama's architecture with a bias on
the q/k/v projections (and none on o_proj)."""

from __future__ import annotations

from pagoda.model_executor.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    @staticmethod
    def biases(config) -> tuple[bool, bool]:
        return True, False


class Qwen2ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen2Attention
