"""rotary_embedding (NeoX and GPT-J styles) against the pure-torch reference."""

import pytest
import torch
from op_testing import TOLERANCES

from pagoda import ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
MAX_POSITION = 512


def make_case(num_tokens, num_heads, num_kv_heads, head_size, dtype, device):
    """query and key as strided views into one fused qkv projection output."""
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, dtype=dtype, device=device)
    query, key, _ = qkv.split([num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size], dim=-1)
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), device=device)
    return positions, query, key


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("num_tokens", [0, 1, 7, 33])
@pytest.mark.parametrize("heads", [(1, 1), (8, 2), (9, 3)])
@pytest.mark.parametrize("head_size,rot_dim", [(64, 64), (128, 128), (80, 32), (6, 2)])
def test_rotary_embedding(device, dtype, is_neox, num_tokens, heads, head_size, rot_dim):
    num_heads, num_kv_heads = heads
    positions, query, key = make_case(num_tokens, num_heads, num_kv_heads, head_size, dtype, device)
    cache = ops.rotary_cos_sin_cache(head_size, MAX_POSITION, rot_dim=rot_dim).to(device)
    want_q, want_k = ops.rotary_embedding_reference(positions, query, key, head_size, cache, is_neox)
    ops.rotary_embedding(positions, query, key, head_size, cache, is_neox)
    torch.testing.assert_close(query, want_q, **TOLERANCES[dtype])
    torch.testing.assert_close(key, want_k, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rotary_cache_in_query_dtype(device, dtype):
    positions, query, key = make_case(5, 4, 2, 64, dtype, device)
    cache = ops.rotary_cos_sin_cache(64, MAX_POSITION, dtype=dtype).to(device)
    want_q, want_k = ops.rotary_embedding_reference(positions, query, key, 64, cache, True)
    ops.rotary_embedding(positions, query, key, 64, cache, True)
    torch.testing.assert_close(query, want_q, **TOLERANCES[dtype])
    torch.testing.assert_close(key, want_k, **TOLERANCES[dtype])


@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_query_only_3d(device, is_neox):
    positions = torch.randint(0, MAX_POSITION, (6,), device=device)
    query = torch.randn(6, 4, 32, device=device)
    cache = ops.rotary_cos_sin_cache(32, MAX_POSITION).to(device)
    want_q, _ = ops.rotary_embedding_reference(positions, query, None, 32, cache, is_neox)
    ops.rotary_embedding(positions, query, None, 32, cache, is_neox)
    torch.testing.assert_close(query, want_q, **TOLERANCES[torch.float32])


def test_rotary_position_zero_is_identity(device):
    query = torch.randn(3, 2, 16, device=device)
    original = query.clone()
    cache = ops.rotary_cos_sin_cache(16, 8).to(device)
    ops.rotary_embedding(torch.zeros(3, dtype=torch.long, device=device), query, None, 16, cache, True)
    torch.testing.assert_close(query, original, rtol=0, atol=0)

