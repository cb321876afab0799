"""FP8 (e4m3) quantization and the FP8 linear layer (model_executor/layers/fp8.py)
against their definitions: rounding within half a unit in the last place,
the GEMM equal to the product of the dequantized operands, and which
parameters quantize_linear_weights turns to FP8."""

import pytest
import torch
from torch import nn

from pagoda import ops
from pagoda.model_executor.layers.fp8 import (
    ALIGNMENT,
    FP8_DTYPE,
    FP8_MAX,
    QuantizedRows,
    fp8_linear,
    fused_rms_norm_quant,
    fused_silu_and_mul_quant,
    quantize_linear_weights,
    quantize_rows,
)
from pagoda.model_executor.layers.linear import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear, dense
from pagoda.model_executor.layers.vocab_embedding import ParallelLMHead

# The GPU's path where there is one (torch._scaled_mm takes row-wise scales on
# the CPU only from torch 2.13 on, the pinned version).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# e4m3: 3 mantissa bits, so a normal value rounds to within 2^-4 of itself
# (relative); below the smallest normal, 2^-6, the spacing is 2^-9, so the
# absolute error is at most 2^-10 (both in units of the row's scale).
HALF_ULP = 2.0**-4
SUBNORMAL_HALF_SPACING = 2.0**-10


def rows_of_many_magnitudes(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Random rows scaled from 1e-3 to 1e3, with a row of zeros and a row
    holding one large outlier (most of it then lands in e4m3's subnormals)."""
    x = torch.randn(rows, cols) * torch.logspace(-3, 3, rows).unsqueeze(1)
    x[1] = 0
    x[2, -1] = 1e4
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("cols", [1, 16, 577])
def test_quantize_rows_rounds_within_half_an_ulp(dtype, cols):
    x = rows_of_many_magnitudes(9, cols, dtype)
    q, scale = quantize_rows(x)
    assert q.dtype == FP8_DTYPE and q.shape == x.shape and scale.shape == (9, 1) and scale.dtype == torch.float32
    amax = x.float().abs().amax(dim=1, keepdim=True)
    torch.testing.assert_close(scale[amax > 0], (amax / FP8_MAX)[amax > 0], rtol=2**-23, atol=0)  # to an ulp
    assert torch.all(scale > 0) and torch.all(q[1].float() == 0)  # the zero row: a finite scale, zeros
    assert not torch.isnan(q.float()).any()
    exact = x.double()
    error = (q.double() * scale.double() - exact).abs()
    bound = torch.maximum(exact.abs() * HALF_ULP, scale.double() * SUBNORMAL_HALF_SPACING)
    assert torch.all(error <= bound * (1 + 1e-6)), (error - bound).max()
    assert torch.all(q.float().abs().amax(dim=1)[amax.squeeze(1) > 0] == FP8_MAX)  # each row's largest is the top


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 32, 16), (17, 48, 64), (5, 4096, 32)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_is_the_product_of_the_quantized_operands(dtype, shape, bias):
    rows, k, n = shape
    torch.manual_seed(rows * k + n)
    x = torch.randn(rows, k, dtype=dtype, device=DEVICE)
    weight = torch.randn(n, k, dtype=dtype, device=DEVICE) * 0.05
    b = torch.randn(n, dtype=dtype, device=DEVICE) if bias else None
    wq, wscale = quantize_rows(weight)
    out = fp8_linear(x, wq, wscale.view(1, -1), b)
    assert out.dtype == dtype and out.shape == (rows, n)
    xq, xscale = quantize_rows(x)
    a, w = xq.double() * xscale.double(), wq.double() * wscale.double()
    product = a @ w.T
    bias64 = b.double() if b is not None else torch.zeros(n, dtype=torch.float64, device=DEVICE)
    # Exact products summed, rounded to dtype, then the bias added in dtype:
    # two roundings, each within 2^-8 of its operands. The sum's own error is
    # bounded by the sum of the products' magnitudes: fp32 on the CPU, about
    # 14 bits on Hopper's FP8 tensor cores (DeepSeek-V3's measurement), so
    # 2^-9 of it covers K up to thousands; a wrong scale or index is off by
    # the order of the product itself.
    error = (out.double() - product - bias64).abs()
    bound = 2**-7 * (product.abs() + bias64.abs()) + 2**-9 * (a.abs() @ w.abs().T)
    assert torch.all(error <= bound), (error - bound).max()
    # ... and about 4% (relative L2) from the unquantized product.
    exact = x.double() @ weight.double().T + bias64
    assert (out.double() - exact).norm() / exact.norm() < 0.06


def test_fp8_linear_keeps_leading_dimensions_and_empty_batches():
    weight, scale = quantize_rows(torch.randn(32, 16, dtype=torch.bfloat16, device=DEVICE))
    x = torch.randn(2, 3, 16, dtype=torch.bfloat16, device=DEVICE)
    out = fp8_linear(x, weight, scale.view(1, -1))
    assert out.shape == (2, 3, 32)
    torch.testing.assert_close(out.view(6, 32), fp8_linear(x.view(6, 16), weight, scale.view(1, -1)))
    assert fp8_linear(x[:0], weight, scale.view(1, -1)).shape == (0, 3, 32)
    quantized = QuantizedRows(*quantize_rows(x.view(6, 16)), x.dtype)
    assert torch.equal(fp8_linear(quantized, weight, scale.view(1, -1)), fp8_linear(x.view(6, 16), weight, scale.view(1, -1)))
    empty = QuantizedRows(*quantize_rows(x.view(6, 16)[:0]), x.dtype)
    assert fp8_linear(empty, weight, scale.view(1, -1)).shape == (0, 32)


def assert_quantized_alike(got: QuantizedRows, want_q: torch.Tensor, want_scale: torch.Tensor, dtype: torch.dtype):
    """Exactly quantize_rows of the unfused op's output on the CPU (the same
    ops in turn). On CUDA the fused kernels sum the norm's squares in another
    order than the CUDA norm and take SiLU's exponential and division in fast
    fp32, so a rounding of the row may land one unit of the model's dtype
    apart: scales within two such units; each value, as
    both quantizations round their own input to within half an e4m3 unit and
    the inputs are within a unit of the model's dtype, within an e4m3 unit
    and two of the dtype (or twice the subnormal bound); at most 1% of the
    values not bit-equal."""
    assert got.dtype == dtype and got.q.dtype == FP8_DTYPE and got.q.shape == want_q.shape
    assert got.scale.shape == want_scale.shape and got.scale.dtype == torch.float32
    if got.q.device.type == "cpu":
        assert torch.equal(got.scale, want_scale) and torch.equal(got.q.view(torch.uint8), want_q.view(torch.uint8))
        return
    torch.testing.assert_close(got.scale, want_scale, rtol=2 * torch.finfo(dtype).eps, atol=0)
    want = want_q.double() * want_scale.double()
    error = (got.q.double() * got.scale.double() - want).abs()
    eps = torch.finfo(dtype).eps
    assert torch.all(error <= want.abs() * (2**-3 + 2 * eps) + want_scale.double() * 2**-9 * 2), (
        (error - want.abs() * (2**-3 + 2 * eps)).max())
    assert (got.q.view(torch.uint8) != want_q.view(torch.uint8)).sum() <= 0.01 * want_q.numel()


def activation_rows(rows: int, cols: int, dtype: torch.dtype, largest: float = 2.0) -> torch.Tensor:
    """Rows of standard normal values scaled from 10^-2 to 10^largest."""
    scales = torch.logspace(-2, largest, max(rows, 1))[:rows].unsqueeze(1)
    return (torch.randn(rows, cols) * scales).to(dtype).to(DEVICE)


# 20000 columns: wider than the fused CUDA kernels hold in registers (they
# then run the two ops apart).
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [0, 1, 7, 256])
@pytest.mark.parametrize("cols", [48, 4096, 20000])
@pytest.mark.parametrize("with_residual", [False, True])
def test_fused_rms_norm_quant_is_quantize_rows_of_the_norm(dtype, rows, cols, with_residual):
    torch.manual_seed(rows + cols)
    x, residual = activation_rows(rows, cols, dtype), activation_rows(rows, cols, dtype)
    weight = (torch.rand(cols) + 0.5).to(dtype).to(DEVICE)
    want_residual = residual.clone()
    if with_residual:
        normed = x.clone()
        ops.fused_add_rms_norm(normed, want_residual, weight, 1e-6)
    else:
        normed = ops.rms_norm(x, weight, 1e-6)
    got_residual = residual.clone()
    got = fused_rms_norm_quant(x.clone(), weight, 1e-6, got_residual if with_residual else None)
    assert torch.equal(got_residual, want_residual)
    assert_quantized_alike(got, *quantize_rows(normed), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [0, 1, 7, 256])
@pytest.mark.parametrize("d", [48, 14336, 20000])
def test_fused_silu_and_mul_quant_is_quantize_rows_of_the_activation(dtype, rows, d):
    torch.manual_seed(rows + d)
    x = activation_rows(rows, 2 * d, dtype, largest=1.0)  # gate x up stays finite in fp16
    got = fused_silu_and_mul_quant(x)
    assert_quantized_alike(got, *quantize_rows(ops.silu_and_mul(x)), dtype)


def test_quantize_linear_weights_converts_aligned_linear_layers_only():
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = nn.ModuleDict({
            "up": MergedColumnParallelLinear(64, [32, 32], dtype=torch.bfloat16),
            "down": RowParallelLinear(64, 48, bias=True, dtype=torch.bfloat16),
            "odd": ReplicatedLinear(64, ALIGNMENT + 3, dtype=torch.bfloat16),
            "lm_head": ParallelLMHead(100, 64, dtype=torch.bfloat16),
        })
    for p in model.parameters():
        p.data.normal_()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    assert quantize_linear_weights(model) == (2, 1)
    for name in ("up", "down"):
        weight = model[name].weight
        assert weight.dtype == FP8_DTYPE and not weight.requires_grad and weight.fp8_scale.shape == (1, weight.shape[0])
        dequantized = weight.double() * weight.fp8_scale.double().T
        assert (dequantized - before[f"{name}.weight"].double()).norm() / before[f"{name}.weight"].double().norm() < 0.05
    assert model["down"].bias.dtype == torch.bfloat16
    for name in ("odd.weight", "lm_head.weight"):
        assert model.get_parameter(name).dtype == torch.bfloat16
    x = torch.randn(3, 64, dtype=torch.bfloat16, device=DEVICE)
    weight = model["down"].weight
    torch.testing.assert_close(model["down"](x), fp8_linear(x, weight, weight.fp8_scale, model["down"].bias))
    torch.testing.assert_close(dense(x, weight), fp8_linear(x, weight, weight.fp8_scale))
