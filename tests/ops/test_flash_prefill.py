"""The CUDA attention layer on mixed batches: leading decodes through the
paged decode kernel, the prefills after them through torch's varlen flash
kernel (flash_prefill.py) -- fresh prompts from their own K/V, chunks and
prefix hits from K/V gathered out of the pages -- against
ops.paged_attention_reference on the same pages. The metadata come from the
model runner's InputBuffers, as in a real step. CUDA only."""

import math

import numpy as np
import pytest
import torch
from test_attention import TOLERANCES, make_batch

from pagoda import _native, ops
from pagoda.core.scheduler import ScheduledRequest, SchedulerOutput
from pagoda.forward_context import set_forward_context
from pagoda.model_executor.layers import attention, flash_prefill
from pagoda.worker.input_buffers import InputBuffers

CUDA = torch.cuda.is_available() and _native.has_cuda_ops()
pytestmark = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU and Pagoda's CUDA ops")
FP8 = torch.float8_e4m3fn

# (context length, new tokens) per sequence; decodes (one new token) first.
BATCHES = {
    "fresh prompts": [(33, 33), (100, 100), (1, 1), (17, 17)],
    "decodes then fresh prompts": [(40, 1), (7, 1), (300, 1), (33, 33), (129, 129)],
    "decodes, a chunk over a prefix, a prompt": [(40, 1), (200, 64), (17, 17)],
    "prefix hits only": [(48, 16), (65, 1), (1000, 3)],
    "a long prompt": [(2048, 2048)],
}


def run_layer(batches_key, heads, head_size, block_size, dtype, cache_dtype=None):
    num_heads, num_kv_heads = heads
    seq_q = BATCHES[batches_key]
    seq_lens, q_lens = [s for s, _ in seq_q], [q for _, q in seq_q]
    batch = make_batch(seq_lens, q_lens, num_heads, num_kv_heads, head_size, block_size, dtype, "cuda")
    if cache_dtype is not None:
        batch["key_cache"], batch["value_cache"] = (c.float().clamp(-448, 448).to(cache_dtype)
                                                    for c in (batch["key_cache"], batch["value_cache"]))
    tables = batch["block_tables"].cpu().numpy()
    items = [ScheduledRequest(f"r{i}", [0] * q, s - q, [int(b) for b in tables[i]], True, s, reset_blocks=True)
             for i, (s, q) in enumerate(seq_q)]
    buffers = InputBuffers(sum(q_lens), len(seq_q), tables.shape[1], block_size, torch.device("cuda"))
    metadata = buffers.prepare(SchedulerOutput(items), tables.astype(np.int32)).metadata
    layer = attention.Attention(num_heads, head_size, 1 / math.sqrt(head_size), num_kv_heads)
    layer.kv_cache = (batch["key_cache"], batch["value_cache"])
    # The new tokens' K/V as the cache holds them: reshape_and_cache writes the same values back.
    slots = metadata.slot_mapping
    k, v = (c.flatten(0, 1)[slots].to(dtype).flatten(1) for c in (batch["key_cache"], batch["value_cache"]))
    with set_forward_context(metadata):
        got = layer(batch["query"].flatten(1), k, v).view(sum(q_lens), num_heads, head_size)
    want = ops.paged_attention_reference(**batch, compute_dtype=torch.float64)
    torch.testing.assert_close(got, want, **TOLERANCES[dtype])
    return metadata


@pytest.fixture
def flash_calls(monkeypatch):
    """Counts the flash path's calls (it must be the one taken)."""
    calls = []
    original = flash_prefill.prefill_attention

    def counted(*args, **kwargs):
        calls.append(args[5].context_slots is not None)
        return original(*args, **kwargs)

    monkeypatch.setattr(flash_prefill, "prefill_attention", counted)
    return calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (6, 2), (8, 1)])
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_mixed_batches_match_the_reference(batch, head_size, heads, dtype, flash_calls):
    metadata = run_layer(batch, heads, head_size, 16, dtype)
    num_decodes = next(i for i, (_, q) in enumerate(BATCHES[batch]) if q > 1)
    assert metadata.num_decodes == num_decodes
    assert flash_calls == [any(s > q for s, q in BATCHES[batch][num_decodes:])]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("batch", ["decodes, a chunk over a prefix, a prompt", "prefix hits only"])
def test_block_sizes(batch, block_size, flash_calls):
    run_layer(batch, (8, 2), 128, block_size, torch.bfloat16)
    assert flash_calls == [True]


@pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability() < (8, 9), reason="FP8 caches need capability 8.9+")
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_fp8_cache_is_widened_as_it_is_gathered(batch, flash_calls):
    run_layer(batch, (8, 2), 128, 16, torch.bfloat16, FP8)
    assert len(flash_calls) == 1


def test_float32_takes_the_triton_kernel(flash_calls):
    """The flash kernel has no float32: such a batch goes to Triton whole."""
    run_layer("decodes, a chunk over a prefix, a prompt", (4, 2), 64, 16, torch.float32)
    assert flash_calls == []
