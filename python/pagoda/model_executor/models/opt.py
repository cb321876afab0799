"""OPT (Hugging Face's OPTForCausalLM, e.g. facebook/opt-125m): learned
positional embeddings, LayerNorm before (do_layer_norm_before, most sizes) or
after (opt-350m) each block, a plain fc1 -> activation -> fc2 MLP, biases
everywhere, embeddings of word_embed_proj_dim projected in and out when that
differs from hidden_size, and an LM head tied to the embedding.

Under tensor parallelism the attention heads and fc1/fc2's ffn_dim are split
(out_proj and fc2 row parallel); the positional embedding and the small
project_in/project_out stay whole on every rank."""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.distributed.parallel_state import get_tensor_model_parallel_world_size
from pagoda.distributed.utils import verify_tensor_parallel
from pagoda.model_executor.layers.activation import get_act_fn
from pagoda.model_executor.layers.attention import Attention
from pagoda.model_executor.layers.layernorm import LayerNorm
from pagoda.model_executor.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from pagoda.model_executor.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagoda.model_executor.weight_utils import LazyTensor, load_named_weights, new_parameter


class OPTLearnedPositionalEmbedding(nn.Module):
    """Whole on every rank: splitting a table this small would cost an
    all-reduce per step for nothing."""

    # OPT's table starts at row 2 (a fairseq padding convention): position p
    # reads row p + 2.
    offset = 2

    def __init__(self, max_positions: int, embedding_dim: int, dtype: torch.dtype):
        super().__init__()
        self.weight = new_parameter(max_positions + self.offset, embedding_dim, dtype=dtype)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(positions + self.offset, self.weight)


class OPTAttention(nn.Module):
    def __init__(self, config, dtype: torch.dtype):
        super().__init__()
        hidden, num_heads = config.hidden_size, config.num_attention_heads
        head_dim = hidden // num_heads
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, num_heads, num_heads, config.enable_bias, dtype)
        self.out_proj = RowParallelLinear(hidden, hidden, config.enable_bias, dtype)
        # Hugging Face scales q before q @ k^T; scaling the scores is the same.
        self.attn = Attention(self.qkv_proj.num_heads, head_dim, head_dim**-0.5)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).chunk(3, dim=-1)
        return self.out_proj(self.attn(q, k, v))


class OPTDecoderLayer(nn.Module):
    def __init__(self, config, dtype: torch.dtype):
        super().__init__()
        hidden, affine = config.hidden_size, config.layer_norm_elementwise_affine
        self.do_layer_norm_before = config.do_layer_norm_before
        self.self_attn = OPTAttention(config, dtype)
        self.self_attn_layer_norm = LayerNorm(hidden, elementwise_affine=affine, dtype=dtype)
        self.fc1 = ColumnParallelLinear(hidden, config.ffn_dim, config.enable_bias, dtype)
        self.activation_fn = get_act_fn(config.activation_function)
        self.fc2 = RowParallelLinear(config.ffn_dim, hidden, config.enable_bias, dtype)
        self.final_layer_norm = LayerNorm(hidden, elementwise_affine=affine, dtype=dtype)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        pre = self.do_layer_norm_before
        residual = hidden_states
        hidden_states = self.self_attn(self.self_attn_layer_norm(hidden_states) if pre else hidden_states)
        hidden_states = residual + hidden_states
        if not pre:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        residual = hidden_states
        hidden_states = self.final_layer_norm(hidden_states) if pre else hidden_states
        hidden_states = residual + self.fc2(self.activation_fn(self.fc1(hidden_states)))
        return hidden_states if pre else self.final_layer_norm(hidden_states)


class OPTDecoder(nn.Module):
    def __init__(self, config, dtype: torch.dtype):
        super().__init__()
        hidden, proj_dim = config.hidden_size, config.word_embed_proj_dim
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, proj_dim, dtype)
        self.embed_positions = OPTLearnedPositionalEmbedding(config.max_position_embeddings, hidden, dtype)
        projected = proj_dim != hidden
        self.project_in = ReplicatedLinear(proj_dim, hidden, False, dtype) if projected else None
        self.project_out = ReplicatedLinear(hidden, proj_dim, False, dtype) if projected else None
        has_final_norm = config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False)
        affine = config.layer_norm_elementwise_affine
        self.final_layer_norm = LayerNorm(hidden, elementwise_affine=affine, dtype=dtype) if has_final_norm else None
        self.layers = nn.ModuleList(OPTDecoderLayer(config, dtype) for _ in range(config.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        if self.project_in is not None:
            hidden_states = self.project_in(hidden_states)
        hidden_states = hidden_states + self.embed_positions(positions)
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        if self.final_layer_norm is not None:
            hidden_states = self.final_layer_norm(hidden_states)
        if self.project_out is not None:
            hidden_states = self.project_out(hidden_states)
        return hidden_states


class OPTModel(nn.Module):
    def __init__(self, config, dtype: torch.dtype):
        super().__init__()
        self.decoder = OPTDecoder(config, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.decoder(input_ids, positions)


class OPTForCausalLM(nn.Module):
    stacked_params_mapping = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v")]

    def __init__(self, hf_config, dtype: torch.dtype):
        super().__init__()
        self.config = hf_config
        verify_tensor_parallel(hf_config, get_tensor_model_parallel_world_size())
        self.model = OPTModel(hf_config, dtype)
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.word_embed_proj_dim, dtype)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.decoder.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """hidden states [T, word_embed_proj_dim] (after project_out)."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | LazyTensor]]) -> None:
        def rename(name: str) -> str | None:
            if name == "lm_head.weight" and self.tie_word_embeddings:
                return None
            # Older OPT checkpoints (the original facebook/opt-* uploads) lack the "model." prefix.
            return "model." + name if name.startswith("decoder.") else name

        load_named_weights(self, weights, self.stacked_params_mapping, rename)
