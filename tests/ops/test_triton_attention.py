"""The Triton prefill/extend attention (paged_prefill_attention) against
ops.paged_attention_reference.

Runs on CUDA where there is a GPU; without one, under Triton's interpreter on
CPU tensors (TRITON_INTERPRET=1, set before Python starts); skipped where
triton is not installed (CI) or neither applies.
"""

import importlib.util
import math
import os

import pytest
import torch
from test_attention import TOLERANCES, make_batch

from pagoda import ops

# Every test is collected and skipped where it cannot run (CI has no triton).
if importlib.util.find_spec("triton") is None:
    SKIP = "triton is not installed"
elif torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    SKIP = None
else:
    SKIP = "needs a CUDA GPU, or TRITON_INTERPRET=1 to interpret on the CPU"
pytestmark = pytest.mark.skipif(SKIP is not None, reason=str(SKIP))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if SKIP is None:
    from pagoda.model_executor.layers.triton_attention import paged_prefill_attention

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# GQA ratios 1, 2, 4, 8 and 3.
HEADS = [(8, 8), (8, 4), (8, 2), (8, 1), (6, 2)]


def run(batch, max_query_len=None, out=None):
    """The kernel into a NaN-poisoned output (every row must be written),
    checked against the fp64 reference."""
    q_lens = batch["query_start_loc"].diff()
    if max_query_len is None:
        max_query_len = int(q_lens.max()) if len(q_lens) else 0
    if out is None:
        out = torch.full(batch["query"].shape, float("nan"), dtype=batch["query"].dtype, device=DEVICE)
    got = paged_prefill_attention(**batch, max_query_len=max_query_len, out=out)
    assert got is out
    want = ops.paged_attention_reference(**batch, compute_dtype=torch.float64)
    torch.testing.assert_close(got, want, **TOLERANCES[batch["query"].dtype])
    return got


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_crossing_block_boundaries(dtype, heads, block_size):
    seq_lens = [1, 15, 16, 17, 32, 33, 70]
    run(make_batch(seq_lens, seq_lens, *heads, 64, block_size, dtype, DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_size", [64, 128])
def test_prefix_cached_context_and_new_chunk(dtype, block_size, head_size):
    # 250 cached + 50 new (the chunk starts mid-block and spans unmasked and
    # diagonal key tiles), 16 cached + 17 new (a prefix-cache hit of one
    # block), 129 cached + 150 new (two query tiles of 128).
    run(make_batch([300, 33, 279], [50, 17, 150], 8, 2, head_size, block_size, dtype, DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("fused_qkv", [False, True])
def test_mixed_batch(dtype, heads, fused_qkv):
    # prefill, chunked prefill, decodes, a first token, a prefix hit, a
    # sequence with no new tokens this step, a decode on a block boundary.
    seq_lens = [40, 100, 17, 1, 33, 64, 32]
    q_lens = [40, 30, 1, 1, 17, 0, 1]
    run(make_batch(seq_lens, q_lens, *heads, 64, 16, dtype, DEVICE, fused_qkv=fused_qkv))


@pytest.mark.parametrize("dtype", DTYPES)
def test_single_token_sequences(dtype):
    seq_lens = [1, 2, 16, 17, 33, 200]
    run(make_batch(seq_lens, [1] * len(seq_lens), 8, 2, 128, 16, dtype, DEVICE))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_size", [8, 24, 80, 96, 256])
def test_padded_and_other_head_sizes(dtype, head_size):
    run(make_batch([33, 5, 70], [1, 5, 20], 4, 2, head_size, 16, dtype, DEVICE))


@pytest.mark.parametrize("block_size", [1, 8, 64])
def test_other_block_sizes(block_size):
    run(make_batch([1, 17, 130, 64], [1, 17, 9, 64], 6, 3, 64, block_size, torch.bfloat16, DEVICE))


def test_max_query_len_is_an_upper_bound():
    batch = make_batch([40, 20], [40, 3], 4, 2, 64, 16, torch.float16, DEVICE)
    torch.testing.assert_close(run(batch, max_query_len=300), run(batch), rtol=0, atol=0)


def test_strided_output_leaves_other_columns():
    batch = make_batch([20, 50], [20, 10], 6, 2, 64, 16, torch.bfloat16, DEVICE, fused_qkv=True)
    buffer = torch.randn(30, 6 * 64 + 8, dtype=torch.bfloat16, device=DEVICE)
    before = buffer.clone()
    run(batch, out=buffer[:, : 6 * 64].unflatten(-1, (6, 64)))
    assert torch.equal(buffer[:, 6 * 64 :], before[:, 6 * 64 :])


def test_large_scores_are_stable():
    batch = make_batch([300, 40], [30, 40], 4, 2, 64, 16, torch.float32, DEVICE)
    batch["query"] = batch["query"] * 30  # scores of a few hundred: exp overflows without the running max
    batch["scale"] = 1.0
    out = paged_prefill_attention(**batch, max_query_len=40)
    assert torch.isfinite(out).all()
    want = ops.paged_attention_reference(**batch, compute_dtype=torch.float64)
    torch.testing.assert_close(out, want, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("seq_lens,q_lens", [([], []), ([5, 16], [0, 0])])
def test_no_tokens(seq_lens, q_lens):
    batch = make_batch(seq_lens, q_lens, 4, 2, 64, 16, torch.bfloat16, DEVICE)
    assert paged_prefill_attention(**batch, max_query_len=0).shape == (0, 4, 64)


@pytest.mark.parametrize(
    "changes,error,message",
    [
        (dict(query=torch.randn(8, 256)), ValueError, r"query must be \[num_tokens, num_heads, head_size\]"),
        (dict(query=torch.ones(8, 4, 64, dtype=torch.int32)), TypeError, "query must be float32, bfloat16"),
        (dict(key_cache=torch.randn(6, 16, 2, 64, dtype=torch.float16)), TypeError, "key_cache has dtype"),
        (dict(value_cache=torch.randn(7, 16, 2, 64)), ValueError, "value_cache must be contiguous with key_cache"),
        (dict(query=torch.randn(8, 3, 64)), ValueError, "query's 3 heads must be a multiple of the cache's 2"),
        (dict(query=torch.randn(8, 4, 32)), ValueError, "key_cache's head size is 64 but query's is 32"),
        (dict(seq_lens=torch.tensor([20, 5])), ValueError, "seq_lens must be a contiguous int32"),
        (dict(query_start_loc=torch.tensor([0, 3], dtype=torch.int32)), ValueError, r"query_start_loc .*\(3,\)"),
        (dict(block_tables=torch.zeros(2, 3, dtype=torch.int64)), ValueError, "block_tables must be int32"),
    ],
)
def test_bad_arguments(changes, error, message):
    batch = make_batch([20, 5], [3, 5], 4, 2, 64, 16, torch.float32, "cpu")
    batch.update(changes)
    with pytest.raises(error, match=message):
        paged_prefill_attention(**batch, max_query_len=5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the layer uses Triton only on CUDA tensors")
def test_attention_layer_dispatches_prefill_to_triton(monkeypatch):
    """Attention.forward: Triton when a sequence has several new tokens,
    ops.paged_attention for pure decode batches."""
    from pagoda.forward_context import AttentionMetadata, set_forward_context
    from pagoda.model_executor.layers import attention, triton_attention

    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs["max_query_len"])
        return paged_prefill_attention(*args, **kwargs)

    monkeypatch.setattr(triton_attention, "paged_prefill_attention", counted)
    num_heads, num_kv_heads, head_size = 8, 2, 64
    layer = attention.Attention(num_heads, head_size, 1 / math.sqrt(head_size), num_kv_heads)
    for seq_lens, q_lens in [([40, 7], [40, 1]), ([41, 8], [1, 1])]:
        batch = make_batch(seq_lens, q_lens, num_heads, num_kv_heads, head_size, 16, torch.bfloat16, DEVICE)
        layer.kv_cache = (batch["key_cache"], batch["value_cache"])
        num_tokens = sum(q_lens)
        q = batch["query"].flatten(1)
        # K/V of the new tokens as the cache already holds them: reshape_and_cache rewrites the same values.
        slots = torch.cat([_slots(batch, s, n) for s, n in enumerate(q_lens)])
        k = batch["key_cache"].flatten(0, 1)[slots].flatten(1)
        v = batch["value_cache"].flatten(0, 1)[slots].flatten(1)
        metadata = AttentionMetadata(slots, batch["block_tables"], batch["seq_lens"], batch["query_start_loc"],
                                     max(q_lens), max(seq_lens))
        with set_forward_context(metadata):
            got = layer(q, k, v).view(num_tokens, num_heads, head_size)
        want = ops.paged_attention_reference(**batch, compute_dtype=torch.float64)
        torch.testing.assert_close(got, want, **TOLERANCES[torch.bfloat16])
    assert calls == [40]


def _slots(batch, seq, q_len):
    """Cache slots of sequence seq's q_len newest tokens."""
    block_size = batch["key_cache"].shape[1]
    seq_len = int(batch["seq_lens"][seq])
    positions = torch.arange(seq_len - q_len, seq_len, device=DEVICE)
    blocks = batch["block_tables"][seq, positions // block_size].long()
    return blocks * block_size + positions % block_size


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("longest", [2, 16, 100, 128, 8192])
def test_variant_query_lens_cover_every_step(dtype, head_size, longest):
    """Every longest run of 2..longest new tokens uses the tile config of one
    of the warm-up lengths (what the GPU runner compiles at start-up)."""
    from pagoda.model_executor.layers.triton_attention import _head_pad, _tile_config, variant_query_lens

    head_pad = _head_pad(head_size)
    lens = variant_query_lens(head_size, dtype, longest)
    assert all(2 <= n <= longest for n in lens)
    warm = [_tile_config(head_pad, n, dtype) for n in lens]
    assert all(_tile_config(head_pad, n, dtype) in warm for n in range(2, longest + 1))
    assert len(warm) == len({tuple(sorted(c.items())) for c in warm})  # one run per variant
