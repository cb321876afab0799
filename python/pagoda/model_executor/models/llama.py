"""Llama 2/3 and Mistral (Hugging Face's LlamaForCausalLM / MistralForCausalLM);
also the base of Qwen2 and Qwen3, which differ only in their attention block.

Tokens of all sequences are concatenated: input_ids/positions [T], hidden
states [T, hidden]. Attention reads the batch layout from the forward context.

Under tensor parallelism each rank runs its share of the query and KV heads
and of the MLP's intermediate features (qkv_proj and gate_up_proj column
parallel, o_proj and down_proj row parallel: one all-reduce each); hidden
states are whole on every rank.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from pagoda import ops
from pagoda.distributed.parallel_state import get_tensor_model_parallel_world_size
from pagoda.distributed.utils import verify_tensor_parallel
from pagoda.model_executor.layers.activation import SiluAndMul
from pagoda.model_executor.layers.attention import Attention
from pagoda.model_executor.layers.layernorm import RMSNorm
from pagoda.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    cpu_kernel_takes,
)
from pagoda.forward_context import get_attention_metadata
from pagoda.model_executor.layers.rotary_embedding import RotaryEmbedding, get_rope, rope_parameters_from_config
from pagoda.model_executor.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagoda.model_executor.weight_utils import LazyTensor, load_named_weights

logger = logging.getLogger(__name__)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaMLP(nn.Module):
    def __init__(self, config, dtype: torch.dtype):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} (gated MLPs here use silu)")
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, bias, dtype)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias, dtype)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, config, dtype: torch.dtype):
        super().__init__()
        total_num_heads = config.num_attention_heads
        total_num_kv_heads = getattr(config, "num_key_value_heads", None) or total_num_heads
        self.head_dim = head_dim_of(config)
        qkv_bias, o_bias = self.biases(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, total_num_heads, total_num_kv_heads, qkv_bias, dtype
        )
        # This rank's heads.
        num_heads, num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(total_num_heads * self.head_dim, config.hidden_size, o_bias, dtype)
        theta, rope_scaling, partial_rotary_factor = rope_parameters_from_config(config)
        self.rotary_emb = get_rope(
            self.head_dim,
            int(self.head_dim * partial_rotary_factor),
            config.max_position_embeddings,
            theta,
            is_neox_style=True,  # Hugging Face's rotate_half layout
            rope_scaling=rope_scaling,
            dtype=dtype,
        )
        self.attn = Attention(num_heads, self.head_dim, self.head_dim**-0.5, num_kv_heads)

    @staticmethod
    def biases(config) -> tuple[bool, bool]:
        """(qkv_proj bias, o_proj bias)."""
        bias = getattr(config, "attention_bias", False)
        return bias, bias

    def qk_norms(self) -> tuple[RMSNorm, RMSNorm] | None:
        """RMSNorms over each head of q and k before RoPE (Qwen3); Llama has none."""
        return None

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.o_proj(self.attn(q, k, v, positions, self.rotary_emb, self.qk_norms()))


class LlamaDecoderLayer(nn.Module):
    # (producer, its output's only reader): under --quantization fp8 the
    # producer quantizes its output for the linear (fp8.quantize_linear_weights).
    fp8_input_producers = (("input_layernorm", "self_attn.qkv_proj"), ("post_attention_layernorm", "mlp.gate_up_proj"),
                           ("mlp.act_fn", "mlp.down_proj"))

    def __init__(self, config, dtype: torch.dtype, attention_cls: type[LlamaAttention]):
        super().__init__()
        self.self_attn = attention_cls(config, dtype)
        self.mlp = LlamaMLP(config, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream travels beside the hidden states so that each
        residual add fuses into the next norm (see RMSNorm.forward)."""
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


@dataclass
class FusedLayerArgs:
    """What ops.llama_decoder_layers takes besides the step's inputs (see there)."""

    weights: list[torch.Tensor]
    weight_types: list[int]  # GGUF types, or ops.DENSE_WEIGHT
    kv_caches: list[torch.Tensor]
    cos_sin_cache: torch.Tensor
    is_neox: bool
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    eps: float
    quantize_input: bool  # the packed linears take int8 inputs (quantization="gguf_int8")


class LlamaModel(nn.Module):
    def __init__(self, config, dtype: torch.dtype, attention_cls: type[LlamaAttention]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, dtype, attention_cls) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        # Run the layers in one native op where fused_layer_args() allows it
        # (tests turn it off to compare with the per-op path).
        self.fuse_layers = True
        self._fused_args: FusedLayerArgs | None = None
        self._fused_for: torch.Tensor | None = None  # the layer-0 key cache _fused_args was worked out for

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        fused = self.fused_layer_args() if self.fuse_layers else None
        if fused is not None and (
            ops.DENSE_WEIGHT not in fused.weight_types or cpu_kernel_takes(input_ids.numel(), fused.weights[0].dtype)
        ):
            residual, hidden_states = hidden_states, self.layers[0].input_layernorm(hidden_states)
            m = get_attention_metadata()
            ops.llama_decoder_layers(
                hidden_states, residual, positions, fused.weights, fused.weight_types, fused.kv_caches,
                fused.cos_sin_cache, fused.is_neox, m.slot_mapping, m.block_tables, m.seq_lens, m.query_start_loc,
                fused.num_heads, fused.num_kv_heads, fused.head_size, fused.scale, fused.eps, fused.quantize_input,
            )
            return hidden_states
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def fused_layer_args(self) -> FusedLayerArgs | None:
        """The fused op's arguments where it computes exactly what the layers'
        forward does -- on the CPU on one rank, every linear without a bias and
        kept in GGUF blocks (fp32) or dense in the model's dtype, Llama's own
        attention and MLP (not Qwen3's q/k norms), KV caches bound -- else
        None. With dense weights forward() runs it only for steps whose rows
        dense() gives to Pagoda's kernel (decode batches; prefill's GEMMs stay
        on torch). Worked out once the runner has bound the caches, and again
        only if it binds others."""
        key_cache = self.layers[0].self_attn.attn.kv_cache
        if key_cache is not None and key_cache[0] is self._fused_for:
            return self._fused_args
        self._fused_args = self._build_fused_layer_args()
        self._fused_for = None if key_cache is None else key_cache[0]
        return self._fused_args

    def _build_fused_layer_args(self) -> FusedLayerArgs | None:
        dtype = self.norm.weight.dtype
        if self.norm.weight.device.type != "cpu":
            return None
        if get_tensor_model_parallel_world_size() != 1:
            return None
        weights, weight_types, kv_caches, int8_inputs = [], [], [], set()
        norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for layer, next_norm in zip(self.layers, norms):
            attn, mlp = layer.self_attn, layer.mlp
            if (type(attn).forward is not LlamaAttention.forward
                    or attn.qk_norms() is not None
                    or type(mlp) is not LlamaMLP or type(attn.rotary_emb) is not RotaryEmbedding
                    or attn.attn.kv_cache is None):
                return None
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            types = [self._fused_weight_type(lin.weight, dtype) for lin in linears]
            if None in types or any(lin.bias is not None for lin in linears):
                return None
            weights += [attn.qkv_proj.weight, attn.o_proj.weight, layer.post_attention_layernorm.weight,
                        mlp.gate_up_proj.weight, mlp.down_proj.weight, next_norm.weight]
            weight_types += types
            int8_inputs |= {getattr(lin.weight, "gguf_quantize_input", False) for lin in linears
                            if getattr(lin.weight, "gguf_type", None) in ops.GGUF_INT8_TYPES}
            kv_caches += attn.attn.kv_cache
        first = self.layers[0].self_attn
        eps = {layer.input_layernorm.eps for layer in self.layers} | {layer.post_attention_layernorm.eps
                                                                      for layer in self.layers} | {self.norm.eps}
        shapes = {(layer.self_attn.attn.num_heads, layer.self_attn.attn.num_kv_heads, layer.self_attn.head_dim,
                   layer.self_attn.attn.scale, layer.self_attn.rotary_emb) for layer in self.layers}
        if len(eps) != 1 or len(shapes) != 1 or len(int8_inputs) > 1:
            return None
        return FusedLayerArgs(
            weights, weight_types, kv_caches, first.rotary_emb.cos_sin_cache, first.rotary_emb.is_neox_style,
            first.attn.num_heads, first.attn.num_kv_heads, first.head_dim, first.attn.scale, eps.pop(),
            int8_inputs == {True},
        )

    @staticmethod
    def _fused_weight_type(weight: torch.Tensor, dtype: torch.dtype) -> int | None:
        """The fused op's type for a linear's weight: its GGUF type when packed
        (fp32 models), DENSE_WEIGHT when a plain matrix of the model's dtype,
        None when the op cannot take it (FP8 weights, packed beside bf16)."""
        gguf_type = getattr(weight, "gguf_type", None)
        if gguf_type is not None:
            return gguf_type if dtype == torch.float32 else None
        if weight.dtype != dtype or getattr(weight, "fp8_scale", None) is not None:
            return None
        return ops.DENSE_WEIGHT


class LlamaForCausalLM(nn.Module):
    attention_cls: type[LlamaAttention] = LlamaAttention
    # (fused parameter, Hugging Face module, shard id)
    stacked_params_mapping = [
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]

    def __init__(self, hf_config, dtype: torch.dtype):
        super().__init__()
        self.config = hf_config
        verify_tensor_parallel(hf_config, get_tensor_model_parallel_world_size())
        if getattr(hf_config, "use_sliding_window", False):
            raise ValueError("sliding-window attention (use_sliding_window=True) is not supported")
        if getattr(hf_config, "sliding_window", None) and getattr(hf_config, "model_type", "") == "mistral":
            logger.warning(
                "ignoring sliding_window=%s: attention sees the whole context, which differs from "
                "the model beyond that many tokens",
                hf_config.sliding_window,
            )
        self.model = LlamaModel(hf_config, dtype, self.attention_cls)
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, dtype)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | LazyTensor]]) -> None:
        # Some tied checkpoints still carry a copy of the embedding as lm_head.
        skip = "lm_head.weight" if self.tie_word_embeddings else None
        load_named_weights(self, weights, self.stacked_params_mapping, lambda n: None if n == skip else n)
