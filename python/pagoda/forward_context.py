"""The attention metadata of one forward pass, set by the model runner around
the model call and read by every Attention layer (instead of globals set and
reset by hand).

One layout serves prefill, chunked prefill, prefix-cache hits and decode alike:
the new tokens of all sequences are concatenated; sequence s owns rows
query_start_loc[s]:query_start_loc[s+1] and has seq_lens[s] tokens of context
including its new ones; its KV cache blocks are block_tables[s].

The first num_decodes sequences have one new token each (the scheduler puts
decodes first). The rest, when any, are described again by `prefill` in the
layout of varlen flash attention, so the GPU runs decodes and prefills with
the kernel made for each (see model_executor/layers/attention.py).

split_attention(hook) makes every Attention layer hand its inputs to the hook
instead of attending: piecewise CUDA graphs capture the model around the
attention calls (worker/cuda_graph_runner.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch


@dataclass
class PrefillMetadata:
    """The sequences after the leading decodes, renumbered from 0."""

    query_start_loc: torch.Tensor  # int32 [num_prefills + 1]: their new tokens, from row num_decodes
    seq_start_loc: torch.Tensor  # int32 [num_prefills + 1]: cumulative context lengths (new tokens included)
    max_query_len: int
    max_seq_len: int
    # int64 [seq_start_loc[-1]]: the cache slot of every context token, in order;
    # None when no sequence has a cached prefix (the new K/V are the whole context).
    context_slots: torch.Tensor | None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [num_tokens]: cache slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor  # int32 [num_seqs]: context length including the new tokens
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]: cumulative new-token counts
    max_query_len: int
    max_seq_len: int
    num_decodes: int = 0  # leading sequences with one new token each
    prefill: PrefillMetadata | None = None  # set by the model runner when a sequence after them has more


_current: AttentionMetadata | None = None


@contextlib.contextmanager
def set_forward_context(metadata: AttentionMetadata) -> Iterator[None]:
    global _current
    previous, _current = _current, metadata
    try:
        yield
    finally:
        _current = previous


def get_attention_metadata() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("no forward context: run the model inside set_forward_context(...)")
    return _current


_split: Callable | None = None


@contextlib.contextmanager
def split_attention(hook: Callable) -> Iterator[None]:
    """Inside: Attention.forward(*inputs) returns hook(layer, *inputs), the
    inputs being Attention.attend's (q, k, v[, positions, rotary_emb, qk_norms])."""
    global _split
    previous, _split = _split, hook
    try:
        yield
    finally:
        _split = previous


def get_attention_split() -> Callable | None:
    return _split
