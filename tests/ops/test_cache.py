"""reshape_and_cache (paged KV cache writes) against the pure-torch reference."""

import pytest
import torch

from op_testing import skip_without_kernel

from pagoda import ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture
def device(device):
    return skip_without_kernel("reshape_and_cache", device)


def make_caches(num_blocks, block_size, num_kv_heads, head_size, dtype, device):
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, dtype=dtype, device=device)
    return key_cache, torch.randn_like(key_cache)


def fused_kv(num_tokens, num_heads, num_kv_heads, head_size, dtype, device):
    """key and value as strided views of one fused qkv projection output."""
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, dtype=dtype, device=device)
    _, key, value = qkv.split([num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size], dim=-1)
    return key.unflatten(-1, (num_kv_heads, head_size)), value.unflatten(-1, (num_kv_heads, head_size))


def check(key, value, key_cache, value_cache, slot_mapping):
    want_key_cache, want_value_cache = ops.reshape_and_cache_reference(key, value, key_cache, value_cache, slot_mapping)
    ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    # A copy: bit for bit, and every slot not written is untouched.
    torch.testing.assert_close(key_cache, want_key_cache, rtol=0, atol=0)
    torch.testing.assert_close(value_cache, want_value_cache, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [0, 1, 7, 100])
# (3, 36): a row of 216 bytes in 16-bit types, not a whole number of 16-byte vectors.
@pytest.mark.parametrize("num_kv_heads,head_size", [(1, 64), (3, 64), (8, 128), (2, 80), (4, 256), (3, 36)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_reshape_and_cache(device, dtype, num_tokens, num_kv_heads, head_size, block_size):
    num_blocks = num_tokens // block_size + 3
    key_cache, value_cache = make_caches(num_blocks, block_size, num_kv_heads, head_size, dtype, device)
    key = torch.randn(num_tokens, num_kv_heads, head_size, dtype=dtype, device=device)
    value = torch.randn_like(key)
    slot_mapping = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    check(key, value, key_cache, value_cache, slot_mapping)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_fused_qkv_views(device, dtype):
    key, value = fused_kv(37, 9, 3, 64, dtype, device)
    assert not key.is_contiguous()
    key_cache, value_cache = make_caches(6, 16, 3, 64, dtype, device)
    slot_mapping = torch.randperm(6 * 16, device=device)[:37]
    check(key, value, key_cache, value_cache, slot_mapping)


def test_reshape_and_cache_padding_slots_are_skipped(device):
    key_cache, value_cache = make_caches(4, 16, 2, 64, torch.bfloat16, device)
    key = torch.randn(6, 2, 64, dtype=torch.bfloat16, device=device)
    value = torch.randn_like(key)
    slot_mapping = torch.tensor([5, -1, 17, -1, -1, 63], device=device)
    before_key, before_value = key_cache.clone(), value_cache.clone()
    check(key, value, key_cache, value_cache, slot_mapping)
    written = torch.zeros(4 * 16, dtype=torch.bool, device=device)
    written[[5, 17, 63]] = True
    assert torch.equal(key_cache.flatten(0, 1)[~written], before_key.flatten(0, 1)[~written])
    assert torch.equal(value_cache.flatten(0, 1)[~written], before_value.flatten(0, 1)[~written])
    assert torch.equal(key_cache.flatten(0, 1)[17], key[2])
    assert torch.equal(value_cache.flatten(0, 1)[63], value[5])


def test_reshape_and_cache_all_padding(device):
    key_cache, value_cache = make_caches(2, 16, 1, 64, torch.float32, device)
    key = torch.randn(3, 1, 64, device=device)
    check(key, key.clone(), key_cache, value_cache, torch.full((3,), -1, device=device))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_reshape_and_cache_cuda_skips_slots_past_the_end():
    """The CUDA op cannot check slots on the host without a sync: a slot past
    the cache's end is skipped like a padding slot, never written out of
    bounds."""
    device = skip_without_kernel("reshape_and_cache", "cuda")
    key_cache, value_cache = make_caches(2, 16, 2, 64, torch.bfloat16, device)
    key = torch.randn(3, 2, 64, dtype=torch.bfloat16, device=device)
    value = torch.randn_like(key)
    before_key, before_value = key_cache.clone(), value_cache.clone()
    ops.reshape_and_cache(key, value, key_cache, value_cache, torch.tensor([32, 7, 1 << 40], device=device))
    before_key.flatten(0, 1)[7] = key[1]
    before_value.flatten(0, 1)[7] = value[1]
    assert torch.equal(key_cache, before_key) and torch.equal(value_cache, before_value)


def test_reshape_and_cache_then_attention_reads_it_back(device):
    """The layout the two ops share: slot = block * block_size + offset."""
    block_size, num_kv_heads, head_size = 16, 2, 64
    key_cache, value_cache = make_caches(5, block_size, num_kv_heads, head_size, torch.float32, device)
    key = torch.randn(20, num_kv_heads, head_size, device=device)
    value = torch.randn_like(key)
    block_table = torch.tensor([[3, 0]], dtype=torch.int32, device=device)
    positions = torch.arange(20, device=device)
    slot_mapping = block_table[0, positions // block_size].long() * block_size + positions % block_size
    ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    # One query that attends to everything equally (q = 0) averages the values.
    query = torch.zeros(1, num_kv_heads, head_size, device=device)
    seq_lens = torch.tensor([20], dtype=torch.int32, device=device)
    query_start_loc = torch.tensor([0, 1], dtype=torch.int32, device=device)
    out = ops.paged_attention(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, 1.0)
    torch.testing.assert_close(out[0], value.mean(0), rtol=1e-5, atol=1e-6)


# --- errors (CPU: values are checked on the host) ---------------------------


def args(num_tokens=4, num_kv_heads=2, head_size=64, num_blocks=3, block_size=16, dtype=torch.float32):
    key = torch.randn(num_tokens, num_kv_heads, head_size, dtype=dtype)
    key_cache, value_cache = make_caches(num_blocks, block_size, num_kv_heads, head_size, dtype, "cpu")
    return dict(
        key=key,
        value=torch.randn_like(key),
        key_cache=key_cache,
        value_cache=value_cache,
        slot_mapping=torch.arange(num_tokens),
    )


def call(**kwargs):
    torch.ops.pagoda.reshape_and_cache(
        kwargs["key"], kwargs["value"], kwargs["key_cache"], kwargs["value_cache"], kwargs["slot_mapping"]
    )


def test_slot_past_the_cache_end():
    a = args()
    a["slot_mapping"] = torch.tensor([0, 1, 48, 2])
    with pytest.raises(ValueError, match=r"slot_mapping\[2\] = 48 is outside the cache's 48 slots"):
        call(**a)


def test_slot_mapping_dtype():
    a = args()
    a["slot_mapping"] = a["slot_mapping"].int()
    with pytest.raises(TypeError, match="slot_mapping must be int64"):
        call(**a)


def test_slot_mapping_length():
    a = args()
    a["slot_mapping"] = torch.arange(3)
    with pytest.raises(ValueError, match="slot_mapping must be a 1-D tensor of num_tokens = 4"):
        call(**a)


def test_cache_dtype_mismatch():
    a = args()
    a["key_cache"] = a["key_cache"].half()  # (bf16 under fp32 K/V is allowed: test_bf16_kv_cache.py)
    with pytest.raises(TypeError, match="key_cache has dtype"):
        call(**a)


def test_key_dtype_unsupported():
    a = args()
    a["key"] = a["key"].double()
    with pytest.raises(TypeError, match="key must be float32, bfloat16 or float16"):
        call(**a)


def test_cache_heads_mismatch():
    a = args()
    a["key_cache"], a["value_cache"] = make_caches(3, 16, 4, 64, torch.float32, "cpu")
    with pytest.raises(ValueError, match="key_cache holds 4 kv heads of size 64 but key has 2 heads"):
        call(**a)


def test_value_shape_mismatch():
    a = args()
    a["value"] = torch.randn(4, 2, 32)
    with pytest.raises(ValueError, match="value has shape"):
        call(**a)


def test_value_cache_shape_mismatch():
    a = args()
    a["value_cache"] = torch.randn(4, 16, 2, 64)
    with pytest.raises(ValueError, match="value_cache has shape"):
        call(**a)


def test_cache_not_contiguous():
    a = args()
    a["key_cache"] = torch.randn(3, 2, 16, 64).transpose(1, 2)
    with pytest.raises(ValueError, match="key_cache must be contiguous"):
        call(**a)


def test_key_heads_not_contiguous():
    a = args()
    a["key"] = torch.randn(4, 64, 2).transpose(1, 2)
    with pytest.raises(ValueError, match="key must be contiguous in its last two dimensions"):
        call(**a)


def test_key_wrong_rank():
    a = args()
    a["key"] = torch.randn(4, 128)
    a["value"] = torch.randn(4, 128)
    with pytest.raises(ValueError, match=r"key must be \[num_tokens, num_heads, head_size\]"):
        call(**a)


def test_opcheck():
    a = args()
    a["slot_mapping"] = torch.tensor([3, -1, 40, 7])
    torch.library.opcheck(
        torch.ops.pagoda.reshape_and_cache.default,
        (a["key"], a["value"], a["key_cache"], a["value_cache"], a["slot_mapping"]),
    )
