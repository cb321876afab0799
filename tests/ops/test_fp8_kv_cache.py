"""The float8 KV cache (--kv-cache-dtype fp8): reshape_and_cache rounds K/V to
e4m3 (unit scale, saturated at +-448), and the decode kernel and the Triton
prefill kernel read the e4m3 pages. The reference is paged_attention_reference
on the same fp8 caches widened exactly, so what is checked is the kernels'
arithmetic, not fp8's rounding (the engine tests bound that).

The kernels run on CUDA GPUs of capability 8.9+ only; on the CPU an fp8 cache
is a clear error, which is checked everywhere."""

import pytest
import torch
from test_attention import TOLERANCES, make_batch

from pagoda import _native, ops

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
CUDA = torch.cuda.is_available() and _native.has_cuda_ops() and torch.cuda.get_device_capability() >= (8, 9)
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU of capability 8.9+ and Pagoda's CUDA ops")


def to_fp8(cache: torch.Tensor) -> torch.Tensor:
    """torch's e4m3 rounding (nearest even); torch gives NaN past 448, the kernel saturates."""
    return cache.float().clamp(-E4M3_MAX, E4M3_MAX).to(FP8)


def fp8_batch(*args, **kwargs):
    batch = make_batch(*args, **kwargs)
    batch["key_cache"], batch["value_cache"] = to_fp8(batch["key_cache"]), to_fp8(batch["value_cache"])
    return batch


def check_decode_kernel(batch):
    out = torch.full(batch["query"].shape, float("nan"), dtype=batch["query"].dtype, device=batch["query"].device)
    got = ops.paged_attention(**batch, out=out)
    want = ops.paged_attention_reference(**batch, compute_dtype=torch.float64)
    torch.testing.assert_close(got, want, **TOLERANCES[batch["query"].dtype])


def test_cpu_refuses_fp8_cache():
    batch = fp8_batch([5], [1], 4, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA GPUs only"):
        ops.paged_attention(**batch)
    key = torch.randn(1, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA GPUs only"):
        ops.reshape_and_cache(key, key, batch["key_cache"], batch["value_cache"], torch.zeros(1, dtype=torch.long))


def test_fp8_cache_needs_16_bit_inputs():
    cache = torch.zeros(2, 16, 2, 64, dtype=FP8)
    key = torch.randn(1, 2, 64)
    with pytest.raises(TypeError, match="needs bfloat16 or float16"):
        ops.reshape_and_cache(key, key, cache, cache.clone(), torch.zeros(1, dtype=torch.long))
    with pytest.raises(TypeError, match="must match"):  # the two caches of one layer share a dtype
        ops.reshape_and_cache(key.bfloat16(), key.bfloat16(), cache, cache.bfloat16(), torch.zeros(1, dtype=torch.long))


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fused", [False, True])
def test_reshape_and_cache_rounds_to_e4m3(dtype, fused):
    tokens, heads, head_size, block_size = 37, 4, 128, 16
    width = heads * head_size
    if fused:  # views of a fused qkv, as the models pass them
        qkv = 3 * torch.randn(tokens, 3 * width, dtype=dtype, device="cuda")
        key, value = (qkv[:, i * width : (i + 1) * width].unflatten(-1, (heads, head_size)) for i in (1, 2))
    else:
        key, value = (3 * torch.randn(tokens, heads, head_size, dtype=dtype, device="cuda") for _ in range(2))
    key[0, 0, :4] = torch.tensor([1000.0, -1000.0, E4M3_MAX, 2**-10], dtype=dtype)  # saturation, a subnormal
    caches = [torch.zeros(5, block_size, heads, head_size, dtype=FP8, device="cuda") for _ in range(2)]
    slots = torch.randperm(5 * block_size, device="cuda")[:tokens]
    slots[3] = -1  # padding: skipped
    ops.reshape_and_cache(key, value, *caches, slots)
    want = ops.reshape_and_cache_reference(to_fp8(key), to_fp8(value), *(c.clone() for c in caches), slots)
    for got, expected in zip(caches, want):
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    assert caches[0].flatten(0, 1)[slots[0], 0, :2].float().tolist() == [E4M3_MAX, -E4M3_MAX]


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (16, 2), (12, 1)])
def test_decode_reads_fp8_pages(dtype, head_size, heads):
    batch = fp8_batch([1, 17, 40, 300], [1, 1, 1, 1], *heads, head_size, dtype=dtype, device="cuda")
    check_decode_kernel(batch)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_fp8_pages_over_partitions_and_mixed_batches(dtype, block_size):
    # Long contexts split over partitions; prefill chunks and decode rows in one call.
    check_decode_kernel(fp8_batch([5000, 4097], [1, 1], 8, 2, 128, block_size, dtype, "cuda"))
    check_decode_kernel(fp8_batch([33, 70, 9], [33, 5, 1], 8, 4, 128, block_size, dtype, "cuda"))


@needs_cuda
def test_fp8_cache_refuses_other_kernels():
    batch = fp8_batch([20], [1], 4, 2, 72, dtype=torch.bfloat16, device="cuda")  # head size 72: no tensor-core kernel
    with pytest.raises(ValueError, match="tensor-core kernel"):
        ops.paged_attention(**batch)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_size", [64, 128])
def test_triton_prefill_reads_fp8_pages(dtype, head_size):
    from pagoda.model_executor.layers.triton_attention import paged_prefill_attention

    batch = fp8_batch([200, 64, 31], [200, 16, 31], 8, 2, head_size, dtype=dtype, device="cuda")
    got = paged_prefill_attention(**batch, max_query_len=200)
    want = ops.paged_attention_reference(**batch, compute_dtype=torch.float64)
    torch.testing.assert_close(got, want, **TOLERANCES[dtype])
