"""Prefill/extend attention on CUDA through the varlen FlashAttention-2 kernel
that torch ships (the one behind SDPA's flash backend), so prefill runs at the
speed of the best dense causal kernel on the machine.

That kernel reads contiguous K/V, not pages. A batch whose sequences have no
cached prefix needs none: the new tokens' K/V are the whole context (as
computed: with an FP8 cache only later steps see them rounded). A batch
with a prefix (chunked prefill, prefix-cache hits) gathers each sequence's
context from the cache first, through metadata.prefill.context_slots (the new
tokens are in the cache already); the gather reads and writes the context's
K/V once per layer, which is small beside the attention over it, and holds
one layer's context K/V at a time. An FP8 cache is widened to the query's
dtype as it is gathered (unit scale, so the values are the cache's).

The kernel's causal mask is aligned to the end of the keys: new token j of a
sequence with q_len new tokens and seq_len context tokens sees keys 0 ..
seq_len - q_len + j, which is the paged kernels' rule.
"""

from __future__ import annotations

import functools

import torch

from pagoda.forward_context import PrefillMetadata

_DTYPES = (torch.float16, torch.bfloat16)
_MAX_HEAD_SIZE = 256


def supported(dtype: torch.dtype, device: torch.device, head_size: int) -> bool:
    """Whether torch's flash kernel serves this layer: CUDA (not ROCm), an
    Ampere or newer GPU, fp16/bf16, a head size up to 256 in steps of 8."""
    return (
        device.type == "cuda"
        and dtype in _DTYPES
        and head_size % 8 == 0
        and head_size <= _MAX_HEAD_SIZE
        and _flash_device(device.index)
        and torch.backends.cuda.flash_sdp_enabled()
    )


@functools.cache
def _flash_device(index: int | None) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 8


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    prefill: PrefillMetadata,
    scale: float,
) -> torch.Tensor:
    """query [T, H, D], key/value [T, Hkv, D]: the prefill sequences' new
    tokens (views of a fused qkv are fine), already written to the caches
    [num_blocks, block_size, Hkv, D]. Returns [T, H, D] in query's dtype."""
    if prefill.context_slots is not None:
        key, value = (_gather(cache, prefill.context_slots, query.dtype) for cache in (key_cache, value_cache))
    return torch.ops.aten._flash_attention_forward(
        query, key, value,
        prefill.query_start_loc, prefill.seq_start_loc,
        prefill.max_query_len, prefill.max_seq_len,
        0.0,  # dropout
        True,  # causal
        False,  # return_debug_mask
        scale=scale,
    )[0]


def _gather(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    flat = cache.view(-1, cache.shape[2], cache.shape[3])
    return flat.index_select(0, slots).to(dtype)
