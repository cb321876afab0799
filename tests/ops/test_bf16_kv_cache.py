"""A bfloat16 KV cache under float32 keys and queries (--kv-cache-dtype
bfloat16 with an fp32 model, CPU kernels): reshape_and_cache rounds K/V to
bf16 bit for bit as torch's .to(torch.bfloat16) does (nearest even), and
paged_attention reads the bf16 pages with fp32 queries. The attention
reference is paged_attention_reference on the same bf16 pages, widened
exactly and computed in fp64, so what is checked is the kernel's fp32
arithmetic (fp32's tolerance), not bf16's rounding (tests/engine/test_smollm2.py
bounds that). CUDA refuses the combination with a clear error."""

import pytest
import torch
from test_attention import HEADS, TOLERANCES, make_batch

from pagoda import _native, ops

BF16 = torch.bfloat16


def bf16_cache_batch(*args, **kwargs):
    """make_batch in fp32 with the caches rounded to bf16."""
    batch = make_batch(*args, **kwargs)
    batch["key_cache"], batch["value_cache"] = batch["key_cache"].to(BF16), batch["value_cache"].to(BF16)
    return batch


def check_attention(batch):
    out = torch.full(batch["query"].shape, float("nan"))  # poisoned: every element must be written
    got = ops.paged_attention(**batch, out=out)
    want = ops.paged_attention_reference(**batch, compute_dtype=torch.float64)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, **TOLERANCES[torch.float32])


def check_write(key, value, key_cache, value_cache, slot_mapping):
    want_key, want_value = ops.reshape_and_cache_reference(key, value, key_cache, value_cache, slot_mapping)
    ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    # Bit for bit torch's rounding, and every slot not written is untouched.
    assert torch.equal(key_cache.view(torch.int16), want_key.view(torch.int16))
    assert torch.equal(value_cache.view(torch.int16), want_value.view(torch.int16))


# (3, 36): rows of 108 values, not a whole number of vectors for either build.
@pytest.mark.parametrize("num_tokens", [0, 1, 7, 17, 100])
@pytest.mark.parametrize("num_kv_heads,head_size", [(1, 64), (3, 64), (2, 80), (3, 36), (1, 5)])
def test_write_rounds_like_torch(num_tokens, num_kv_heads, head_size):
    num_blocks, block_size = num_tokens // 16 + 3, 16
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size).to(BF16)
    value_cache = torch.randn_like(key_cache)
    # A fused qkv projection's strided views, as the model passes them.
    qkv = torch.randn(num_tokens, 5 * num_kv_heads * head_size) * 10
    key = qkv[:, 3 * num_kv_heads * head_size : 4 * num_kv_heads * head_size].unflatten(-1, (num_kv_heads, head_size))
    value = qkv[:, 4 * num_kv_heads * head_size :].unflatten(-1, (num_kv_heads, head_size))
    slot_mapping = torch.randperm(num_blocks * block_size)[:num_tokens]
    if num_tokens > 2:
        slot_mapping[1] = -1  # a padding token: skipped
    check_write(key, value, key_cache, value_cache, slot_mapping)


def test_write_rounding_edge_values():
    """Ties (even and odd bf16 below), the largest finite values (one rounds to
    inf as in torch), subnormals, infinities, signed zeros."""
    bits = torch.tensor(
        [0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0x7F7FFFFF, 0x7F7F7FFF, 0xFF7FFFFF,
         0x00000001, 0x00008000, 0x00018000, 0x807FFFFF, 0x7F800000, 0xFF800000, 0x80000000, 0x00000000,
         0x3EAAAAAB],
        dtype=torch.int64,
    ).to(torch.int32)
    row = bits.view(torch.float32)
    key = torch.cat([row, -row]).repeat(4).view(2, 2, 32)  # 2 tokens of 2 heads x 32
    key_cache = torch.zeros(2, 16, 2, 32, dtype=BF16)
    check_write(key, key.flip(-1), key_cache, key_cache.clone(), torch.tensor([3, 20]))


def test_write_nan_stays_nan():
    key = torch.full((1, 1, 40), float("nan"))
    key_cache = torch.zeros(1, 16, 1, 40, dtype=BF16)
    value_cache = key_cache.clone()
    ops.reshape_and_cache(key, key.neg(), key_cache, value_cache, torch.tensor([5]))
    assert key_cache[0, 5].isnan().all() and value_cache[0, 5].isnan().all()


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("head_size", [64, 128, 36])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode(heads, head_size, block_size):
    seq_lens = [1, 15, 16, 17, 32, 33, 100, 1000]
    check_attention(bf16_cache_batch(seq_lens, [1] * len(seq_lens), *heads, head_size, block_size))


@pytest.mark.parametrize("num_seqs", [1, 17])
def test_decode_batch_sizes(num_seqs):
    # SmolLM2's shape (9 heads on 3 kv heads of 64); one sequence splits its
    # keys over the threads, 17 take whole chunks.
    seq_lens = [130 + 7 * s for s in range(num_seqs)]
    check_attention(bf16_cache_batch(seq_lens, [1] * num_seqs, 9, 3, 64, fused_qkv=True))


@pytest.mark.parametrize("heads", HEADS)
def test_prefill(heads):
    seq_lens = [1, 15, 16, 17, 33, 70]
    check_attention(bf16_cache_batch(seq_lens, seq_lens, *heads, 64))


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("head_size", [64, 72])
def test_mixed_batch(heads, head_size):
    # prefill, chunked prefill (70 cached + 30 new), decode, a first token, a
    # prefix-cache hit (16 cached + 17 new), no new tokens, a decode on a
    # block boundary.
    seq_lens = [40, 100, 17, 1, 33, 64, 32]
    q_lens = [40, 30, 1, 1, 17, 0, 1]
    check_attention(bf16_cache_batch(seq_lens, q_lens, *heads, head_size, fused_qkv=True))


def test_write_then_attend_follows_fp32_cache():
    """The whole path: fp32 K/V written into a bf16 cache and attended over
    stays within bf16's rounding of the fp32 cache's result."""
    torch.manual_seed(0)
    seq_lens = [37, 5, 64]
    batch = make_batch(seq_lens, seq_lens, 8, 2, 64)
    tokens = sum(seq_lens)
    key, value = torch.randn(tokens, 2, 64), torch.randn(tokens, 2, 64)
    block_size, tables = 16, batch["block_tables"]
    slots = torch.tensor([int(tables[s, p // block_size]) * block_size + p % block_size
                          for s, n in enumerate(seq_lens) for p in range(n)])
    results = []
    for dtype in (torch.float32, BF16):
        caches = batch["key_cache"].to(dtype), batch["value_cache"].to(dtype)
        ops.reshape_and_cache(key, value, *caches, slots)
        results.append(ops.paged_attention(batch["query"], *caches, tables, batch["seq_lens"],
                                           batch["query_start_loc"], batch["scale"]))
    torch.testing.assert_close(results[1], results[0], **TOLERANCES[BF16])


@pytest.mark.parametrize(
    "query_dtype,cache_dtype",
    [(torch.float32, torch.float16), (BF16, torch.float32), (torch.float16, BF16)],
)
def test_other_mixed_dtypes_refused(query_dtype, cache_dtype):
    batch = make_batch([5], [1], 4, 2, 64, dtype=query_dtype)
    cache = batch["key_cache"].to(cache_dtype)
    with pytest.raises(TypeError, match="key_cache has dtype"):
        ops.paged_attention(**dict(batch, key_cache=cache, value_cache=cache.clone()))
    key = torch.randn(1, 2, 64, dtype=query_dtype)
    with pytest.raises(TypeError, match="key_cache has dtype"):
        ops.reshape_and_cache(key, key, cache, cache.clone(), torch.zeros(1, dtype=torch.long))


def test_key_and_value_caches_share_a_dtype():
    key = torch.randn(1, 2, 64)
    cache = torch.zeros(2, 16, 2, 64, dtype=BF16)
    with pytest.raises(TypeError, match="value_cache has dtype"):
        ops.reshape_and_cache(key, key, cache, cache.float(), torch.zeros(1, dtype=torch.long))


@pytest.mark.skipif(not (torch.cuda.is_available() and _native.has_cuda_ops()), reason="needs Pagoda's CUDA ops")
def test_cuda_refuses_bf16_cache_under_fp32():
    batch = bf16_cache_batch([5], [1], 4, 2, 64, device="cuda")
    with pytest.raises(ValueError, match="on the CPU only"):
        ops.paged_attention(**batch)
    key = torch.randn(1, 2, 64, device="cuda")
    with pytest.raises(ValueError, match="on the CPU only"):
        ops.reshape_and_cache(key, key, batch["key_cache"], batch["value_cache"],
                              torch.zeros(1, dtype=torch.long, device="cuda"))
