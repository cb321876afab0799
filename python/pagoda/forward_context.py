"""The attention metadata of one forward pass, set by the model runner around
the model call and read by every Attention layer (instead of globals set and
reset by hand).

One layout serves prefill, chunked prefill, prefix-cache hits and decode alike:
the new tokens of all sequences are concatenated; sequence s owns rows
query_start_loc[s]:query_start_loc[s+1] and has seq_lens[s] tokens of context
including its new ones; its KV cache blocks are block_tables[s].
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [num_tokens]: cache slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor  # int32 [num_seqs]: context length including the new tokens
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]: cumulative new-token counts
    max_query_len: int
    max_seq_len: int


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
