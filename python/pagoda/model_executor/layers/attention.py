"""Paged attention layer: writes the new tokens' K/V into this layer's cache
and attends over each sequence's cached context, for a whole mixed batch
(prefill, chunked prefill, prefix hits and decode). The CPU runs the whole
batch through ops.paged_attention. On CUDA, decode batches do too; a batch
with several new tokens in some sequence splits at metadata.num_decodes: the
leading decodes go to ops.paged_attention, the prefills to the varlen flash
kernel (flash_prefill.py) where it serves the dtype and head size, else the
whole batch to the Triton prefill kernel (triton_attention.py).

The model runner owns the caches: it allocates one (key_cache, value_cache)
pair per layer, each [num_blocks, block_size, num_kv_heads, head_size] in the
KV cache dtype (the model's, or --kv-cache-dtype's), binds them with bind_kv_caches(), and runs the model inside
set_forward_context(AttentionMetadata(...)).

Under tensor parallelism a layer's num_heads and num_kv_heads are this rank's
share of the heads (the models pass their QKVParallelLinear's), so the caches
sized from them hold this rank's KV heads only.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda import ops
from pagoda.forward_context import get_attention_metadata, get_attention_split
from pagoda.model_executor.layers import flash_prefill
from pagoda.model_executor.layers.layernorm import RMSNorm
from pagoda.model_executor.layers.rotary_embedding import RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None):
        super().__init__()
        self.num_heads, self.head_size, self.scale = num_heads, head_size, scale
        self.num_kv_heads = num_kv_heads or num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None  # bound by the model runner

    def forward(self, *inputs) -> torch.Tensor:
        """attend(*inputs); under split_attention (piecewise CUDA graphs being
        captured) the split hook takes the inputs instead."""
        split = get_attention_split()
        if split is not None:
            return split(self, *inputs)
        return self.attend(*inputs)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor | None = None,
        rotary_emb: RotaryEmbedding | None = None,
        qk_norms: tuple[RMSNorm, RMSNorm] | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, H*D], k/v [T, Hkv*D] (strided views of a fused qkv are fine:
        the kernels take any token stride) -> [T, H*D], written into out
        where given. With rotary_emb, q and k are position-encoded here (in
        place, after RMSNorms over each head where qk_norms are given),
        together with the cache write in one kernel on CUDA."""
        if self.kv_cache is None:
            raise RuntimeError("Attention layer has no KV cache: bind one with bind_kv_caches(model, caches)")
        metadata = get_attention_metadata()
        key_cache, value_cache = self.kv_cache
        if rotary_emb is None:
            ops.reshape_and_cache(k.unflatten(-1, (self.num_kv_heads, self.head_size)),
                                  v.unflatten(-1, (self.num_kv_heads, self.head_size)), key_cache, value_cache,
                                  metadata.slot_mapping)
        else:
            # One eps for both norms: models build them from one config value.
            q_norm, k_norm = qk_norms or (None, None)
            ops.rope_and_cache(
                positions, q, k, v, key_cache, value_cache, metadata.slot_mapping, self.head_size,
                rotary_emb.cos_sin_cache, rotary_emb.is_neox_style,
                q_norm_weight=None if q_norm is None else q_norm.weight,
                k_norm_weight=None if k_norm is None else k_norm.weight,
                eps=0.0 if q_norm is None else q_norm.eps,
            )
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_size)
        k = k.view(num_tokens, self.num_kv_heads, self.head_size)
        v = v.view(num_tokens, self.num_kv_heads, self.head_size)
        if out is not None:
            out = out.view(num_tokens, self.num_heads, self.head_size)
        args = (q, key_cache, value_cache, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
                self.scale)
        if not q.is_cuda or metadata.max_query_len <= 1:
            out = ops.paged_attention(*args, out=out)
        elif metadata.prefill is not None and flash_prefill.supported(q.dtype, q.device, self.head_size):
            if out is None:
                out = torch.empty_like(q)
            n = metadata.num_decodes
            if n:
                ops.paged_attention(q[:n], key_cache, value_cache, metadata.block_tables[:n], metadata.seq_lens[:n],
                                    metadata.query_start_loc[: n + 1], self.scale, out=out[:n])
            out[n:] = flash_prefill.prefill_attention(q[n:], k[n:], v[n:], key_cache, value_cache, metadata.prefill,
                                                      self.scale)
        else:
            # Prefill/extend is matrix-bound: Triton's tensor-core kernel. Imported
            # here so that CPU-only installs never need triton.
            from pagoda.model_executor.layers import triton_attention

            result = triton_attention.paged_prefill_attention(*args, max_query_len=metadata.max_query_len)
            out = result if out is None else out.copy_(result)
        return out.view(num_tokens, self.num_heads * self.head_size)


def attention_layers(model: nn.Module) -> list[Attention]:
    """The model's Attention layers in execution order (layer 0 first)."""
    return [m for m in model.modules() if isinstance(m, Attention)]


def bind_kv_caches(model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """kv_caches[i] = (key_cache, value_cache) of attention_layers(model)[i]."""
    layers = attention_layers(model)
    if len(kv_caches) != len(layers):
        raise ValueError(f"got {len(kv_caches)} KV caches for {len(layers)} attention layers")
    for layer, cache in zip(layers, kv_caches):
        layer.kv_cache = cache
