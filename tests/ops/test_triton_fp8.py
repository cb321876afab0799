"""The FP8 layer's Triton kernels: the per-token quantization
(fp8_triton.quantize_tokens) against its definition, fp8.quantize_rows (the
same scales and the same e4m3 values, bit for bit), into buffers of
cuBLASLt's row multiple; the GEMM (fp8_triton.scaled_gemm, its own kernel
for few rows on Hopper) against the exact product, its summing error a small
part of the quantization's, and the pad rows never in its output.

Needs a CUDA GPU: Triton's interpreter (3.9) rounds fp32 to e4m3 wrongly
(125.87 becomes 64, not 128), so it cannot stand in for one here.
"""

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    SKIP = "triton is not installed"
elif not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    SKIP = "needs a CUDA GPU (Triton's interpreter rounds to e4m3 wrongly)"
else:
    SKIP = None
pytestmark = pytest.mark.skipif(SKIP is not None, reason=str(SKIP))
DEVICE = "cuda"
if SKIP is None:
    from pagoda.model_executor.layers.fp8 import quantize_rows
    from pagoda.model_executor.layers.fp8_triton import (cublas_scaled_mm, quantize_tokens, scaled_gemm,
                                                          skinny_gemm_block_m)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 16), (7, 1000), (3, 1025), (33, 4096), (2, 14336)])
def test_quantize_tokens_equals_quantize_rows(dtype, shape):
    rows, cols = shape
    torch.manual_seed(rows * cols)
    x = (torch.randn(rows, cols) * torch.logspace(-2, 2, rows).unsqueeze(1)).to(dtype).to(DEVICE)
    if rows > 2:
        x[1] = 0  # a zero row: the floor scale, zeros
        x[2, -1] = 1e4  # an outlier at the last column: the last block's maximum counts
    q, scale = quantize_tokens(x)
    want_q, want_scale = quantize_rows(x)
    assert q.shape == x.shape and scale.shape == (rows, 1)
    assert torch.equal(scale, want_scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_quantize_tokens_of_a_strided_view_and_no_rows():
    x = torch.randn(6, 64, dtype=torch.bfloat16, device=DEVICE)
    view = x[::2]  # rows 128 elements apart
    q, scale = quantize_tokens(view)
    want_q, want_scale = quantize_rows(view)
    assert torch.equal(scale, want_scale) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    q, scale = quantize_tokens(x[:0])
    assert q.shape == (0, 64) and scale.shape == (0, 1)


def _operands(rows, n, k):
    """(x, weight) in fp32 and (q, scale, weight_q, weight_scale) quantized."""
    torch.manual_seed(rows * 7 + n + k)
    x = torch.randn(rows, k, device=DEVICE) * torch.logspace(-1, 1, rows, device=DEVICE).unsqueeze(1)
    weight = torch.randn(n, k, device=DEVICE) * 0.02
    q, scale = quantize_rows(x)
    weight_q, weight_scale = quantize_rows(weight)
    return (x, weight), (q, scale, weight_q, weight_scale.view(1, -1).contiguous())


# Rows on both sides of each tile height and of the cuBLASLt boundaries (64 rows;
# 256, or one wave of programs, beyond); N x K from Qwen3-0.6B and Llama-3.1-8B
# and odd sizes (K = 128: one step of K).
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 33, 64, 65, 100, 128, 129, 200, 256, 300])
@pytest.mark.parametrize("n, k", [(64, 128), (1024, 3072), (4096, 1024), (192, 384), (6144, 4096)])
def test_scaled_gemm_sums_far_closer_than_the_quantization(rows, n, k):
    """Against the exact product of the same e4m3 operands (fp64). Both paths
    sum in the FP8 tensor cores' accumulator (about 14 mantissa bits) for all
    of K, as vLLM's FP8 kernels do (cublas_scaled_mm says why). Each output
    stays within 2^-9 of its products' absolute sum (tests/models/test_fp8.py's
    bound; a wrong scale, row or column is off by the order of the product),
    and the sum's error in each row (relative L2) is at most a quarter of what
    rounding the operands to e4m3 cost that row, so the whole error grows by
    at most 3% (H100: 1e-3 against about 4% at K = 4096)."""
    (x, weight), (q, scale, weight_q, weight_scale) = _operands(rows, n, k)
    a, w = q.double() * scale.double(), weight_q.double() * weight_scale.double().t()
    exact = a @ w.t()
    bound = 2**-9 * (a.abs() @ w.abs().t())
    got = scaled_gemm(q, scale, weight_q, weight_scale, torch.float32)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    error = (got.double() - exact).abs()
    assert torch.all(error <= bound), (error - bound).max()
    summing = error.norm(dim=1) / exact.norm(dim=1)
    unquantized = x.double() @ weight.double().t()
    quantizing = (exact - unquantized).norm(dim=1) / unquantized.norm(dim=1)
    assert torch.all(summing <= quantizing / 4), (summing / quantizing).max()
    got = scaled_gemm(q, scale, weight_q, weight_scale, torch.bfloat16)  # one more rounding, to bf16
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    assert torch.all((got.double() - exact).abs() <= 2**-8 * exact.abs() + bound)


@pytest.mark.parametrize("rows", [1, 129, 300])
def test_quantized_rows_come_in_cublas_height_and_the_pad_never_reaches_the_output(rows):
    """The quantizer's buffers are a multiple of 128 rows tall; scaled_gemm
    gives cuBLASLt that height (its output's storage shows it) and returns
    exactly the unpadded product, whatever the pad holds (NaN here)."""
    n, k = 6144, 4096  # many programs: cuBLASLt beyond 64 rows
    torch.manual_seed(rows)
    x = torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16)
    q, scale = quantize_tokens(x)
    tall = -(-rows // 128) * 128
    assert q.untyped_storage().nbytes() == tall * k and scale.untyped_storage().nbytes() == tall * 4
    torch.as_strided(scale, (tall, 1), (1, 1))[rows:] = float("nan")
    torch.as_strided(q, (tall, k), (k, 1)).view(torch.uint8)[rows:] = 0x7F  # e4m3's NaN
    _, (_, _, weight, weight_scale) = _operands(1, n, k)
    got = scaled_gemm(q, scale, weight, weight_scale, torch.bfloat16)
    want = cublas_scaled_mm(q.clone(), scale.clone(), weight, weight_scale, torch.bfloat16)
    assert got.shape == (rows, n) and torch.equal(got, want)
    if rows > 64:
        assert got.untyped_storage().nbytes() == tall * n * 2


@pytest.mark.skipif(SKIP is None and torch.cuda.get_device_capability() != (9, 0), reason="the kernel runs on Hopper")
def test_few_rows_take_the_triton_kernel_on_hopper():
    assert skinny_gemm_block_m(1, 4096, 14336) == 16
    assert skinny_gemm_block_m(33, 6144, 4096) == 64
    assert skinny_gemm_block_m(64, 28672, 4096) == 64  # up to 64 rows whatever the waves
    # Beyond 64 rows while the programs (N / 64 x rows / BLOCK_M) fit one
    # wave, BLOCK_M 64 where they do, else 128.
    assert skinny_gemm_block_m(256, 1024, 3072) == 64  # 64 programs
    assert skinny_gemm_block_m(300, 1024, 3072) is None  # more than 256 rows
    assert skinny_gemm_block_m(65, 28672, 4096) is None  # 448 programs of 128 rows
    assert skinny_gemm_block_m(100, 6144, 4096) == 128  # 192 programs of 64 rows, 96 of 128
    assert skinny_gemm_block_m(200, 6144, 4096) is None  # 192 programs of 128 rows
    one_wave = torch.cuda.get_device_properties().multi_processor_count >= 128
    assert skinny_gemm_block_m(128, 4096, 14336) == (64 if one_wave else None)  # 128 programs
    assert skinny_gemm_block_m(129, 4096, 14336) == (128 if one_wave else None)  # 128 programs of 128 rows
    assert skinny_gemm_block_m(16, 4100, 4096) is None  # N not a multiple of 64
    assert skinny_gemm_block_m(16, 4096, 4160) is None  # K not a multiple of 128
