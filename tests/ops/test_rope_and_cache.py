"""rope_and_cache (per-head q/k RMSNorms, rotary embedding, KV cache write in
one op) against its pure-torch reference, and against the separate ops it
stands for; on CUDA (one kernel) also with a float8 cache."""

import pytest
import torch
from op_testing import TOLERANCES

from pagoda import _native, ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
MAX_POSITION = 512
BLOCK_SIZE = 16
NUM_BLOCKS = 8


def make_case(num_tokens, num_heads, num_kv_heads, head_size, rot_dim, dtype, device, norms, cache_dtype=None,
              row_padding=0):
    """q/k/v as strided views of one fused qkv output (rows row_padding
    elements longer than the heads), caches filled with noise (so that
    untouched slots are checked too), distinct slots with one padding token
    (-1) when there are several tokens."""
    width = (num_heads + 2 * num_kv_heads) * head_size
    qkv = torch.randn(num_tokens, width + row_padding, dtype=dtype, device=device)[:, :width]
    query, key, value = qkv.split([num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size], -1)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, device=device)[:num_tokens]
    if num_tokens > 2:
        slots[1] = -1
    cache_shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_size)
    caches = [torch.randn(cache_shape, device=device).to(cache_dtype or dtype) for _ in range(2)]
    weights = [torch.rand(head_size, dtype=dtype, device=device) + 0.5 for _ in range(2)] if norms else [None, None]
    return dict(
        positions=torch.randint(0, MAX_POSITION, (num_tokens,), device=device),
        query=query, key=key, value=value, key_cache=caches[0], value_cache=caches[1], slot_mapping=slots,
        head_size=head_size, cos_sin_cache=ops.rotary_cos_sin_cache(head_size, MAX_POSITION, rot_dim=rot_dim).to(device),
        q_norm_weight=weights[0], k_norm_weight=weights[1], eps=1e-6,
    )


def rotated_tolerance(dtype):
    """The usual relative tolerance, plus an absolute one of two units in the
    last place at 1 (the inputs' scale): a rotated element is a difference of
    two products, and an ulp in a normed input survives where they cancel."""
    return dict(TOLERANCES[dtype], atol=max(TOLERANCES[dtype]["atol"], 2 * torch.finfo(dtype).eps))


def check(case, cache_tolerance):
    want_q, want_k, want_kc, want_vc = ops.rope_and_cache_reference(**case)
    value_before = case["value"].clone()
    ops.rope_and_cache(**case)
    tol = rotated_tolerance(case["query"].dtype)
    torch.testing.assert_close(case["query"], want_q, **tol)
    torch.testing.assert_close(case["key"], want_k, **tol)
    torch.testing.assert_close(case["value"], value_before, rtol=0, atol=0)
    torch.testing.assert_close(case["key_cache"].float(), want_kc.float(), **cache_tolerance)
    torch.testing.assert_close(case["value_cache"].float(), want_vc.float(), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("norms", [False, True])
@pytest.mark.parametrize("num_tokens", [0, 1, 17])
@pytest.mark.parametrize("heads", [(1, 1), (8, 2), (9, 3)])
@pytest.mark.parametrize("head_size,rot_dim", [(64, 64), (128, 128), (80, 32), (6, 2), (256, 128)])
def test_rope_and_cache(device, dtype, is_neox, norms, num_tokens, heads, head_size, rot_dim):
    """On CUDA the head sizes take every access width (a lane moves 8, 4, 2 or
    1 elements at a time: 256, 128, 64 and 80, 6)."""
    case = make_case(num_tokens, *heads, head_size, rot_dim, dtype, device, norms)
    check(dict(case, is_neox=is_neox), rotated_tolerance(dtype))


@pytest.mark.parametrize("row_padding", [1, 2])
def test_rows_not_aligned_to_the_access_width(device, row_padding):
    """Rows 1 or 2 elements longer than their heads: on CUDA the kernel falls
    back to accesses as narrow as the strides allow (128-element heads take
    4-wide ones otherwise)."""
    case = make_case(9, 8, 2, 128, 128, torch.bfloat16, device, True, row_padding=row_padding)
    check(dict(case, is_neox=True), rotated_tolerance(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norms", [False, True])
def test_equals_the_separate_ops(device, dtype, norms):
    """The op against rms_norm per head, rotary_embedding and reshape_and_cache
    run one after the other on the same device: equal on the CPU (it runs
    them), within a unit in the last place on CUDA (one kernel, which sums
    the squares in another order)."""
    case = make_case(33, 16, 8, 128, 128, dtype, device, norms)
    parts = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    q, k = parts["query"], parts["key"]
    if norms:
        q.copy_(ops.rms_norm(q.reshape(-1, 128), parts["q_norm_weight"], 1e-6).view(q.shape))
        k.copy_(ops.rms_norm(k.reshape(-1, 128), parts["k_norm_weight"], 1e-6).view(k.shape))
    ops.rotary_embedding(parts["positions"], q, k, 128, parts["cos_sin_cache"], True)
    ops.reshape_and_cache(k.view(33, 8, 128), parts["value"].view(33, 8, 128), parts["key_cache"],
                          parts["value_cache"], parts["slot_mapping"])
    ops.rope_and_cache(**case, is_neox=True)
    exact = device == "cpu"
    tol = dict(rtol=0, atol=0) if exact else rotated_tolerance(dtype)
    for name in ("query", "key", "key_cache", "value_cache"):
        torch.testing.assert_close(case[name], parts[name], **tol)


def test_shared_table_in_model_dtype(device):
    case = make_case(5, 4, 2, 64, 64, torch.bfloat16, device, True)
    case["cos_sin_cache"] = case["cos_sin_cache"].to(torch.bfloat16)
    check(dict(case, is_neox=True), rotated_tolerance(torch.bfloat16))


@pytest.mark.skipif(not (torch.cuda.is_available() and _native.has_cuda_ops()), reason="needs Pagoda's CUDA ops")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norms", [False, True])
@pytest.mark.parametrize("head_size", [256, 128, 64, 6])
def test_float8_cache(dtype, norms, head_size):
    """The rotated key rounded to e4m3 as reshape_and_cache rounds it (the
    reference's torch rounding; inputs stay far below e4m3's 448); the head
    sizes store 8, 4, 2 and 1 cache bytes at a time."""
    case = make_case(17, 16, 8, head_size, head_size, dtype, "cuda", norms, cache_dtype=torch.float8_e4m3fn)
    # One e4m3 step where the kernel's and torch's keys differ by a bf16 ulp.
    check(dict(case, is_neox=True), dict(rtol=0.125, atol=2e-3))


def test_bad_norm_weight_is_a_value_error(device):
    case = make_case(3, 4, 2, 64, 64, torch.float32, device, True)
    case["k_norm_weight"] = case["k_norm_weight"][:32]
    with pytest.raises(ValueError, match="k_norm_weight must be a contiguous 1-D tensor of head_size = 64"):
        ops.rope_and_cache(**case, is_neox=True)


def test_value_shape_must_match_key(device):
    case = make_case(3, 4, 2, 64, 64, torch.float32, device, False)
    case["value"] = case["value"][:, :64]
    with pytest.raises(ValueError, match="value has"):
        ops.rope_and_cache(**case, is_neox=True)
