"""linear against torch.nn.functional.linear in fp64, once per CPU kernel
build: with --cpu-isa=avx512_bf16 (on a CPU with AVX512_BF16) bf16 runs on
VDPBF16PS, with --cpu-isa=avx512 on the fp32-FMA fallback."""

import pytest
import torch
from op_testing import skip_without_kernel, strided_rows

from pagoda import ops

# Sums of up to 1536 products in fp32 (another order than the fp64 reference).
TOLERANCES = {
    torch.float32: dict(rtol=1e-4, atol=1e-4),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
}


@pytest.fixture
def device(device):
    return skip_without_kernel("linear", device)


def make(m, k, n, dtype, device, bias=True):
    x = torch.randn(m, k, device=device).to(dtype)
    weight = (torch.randn(n, k, device=device) / max(k, 1) ** 0.5).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    return x, weight, b


@pytest.mark.parametrize("m", [0, 1, 3, 16, 33, 64])
@pytest.mark.parametrize("k", [1, 7, 64, 576, 1536])
@pytest.mark.parametrize("n", [1, 5, 960, 3072])
def test_linear_fp32(device, m, k, n):
    x, weight, bias = make(m, k, n, torch.float32, device, bias=(m + k + n) % 2 == 0)
    out = ops.linear(x, weight, bias)
    assert out.shape == (m, n)
    torch.testing.assert_close(out, ops.linear_reference(x, weight, bias), **TOLERANCES[torch.float32])


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,k,n", [(1, 576, 960), (5, 17, 13), (16, 576, 576), (33, 1536, 7), (64, 64, 3072)])
def test_linear_bias(device, m, k, n, bias):
    x, weight, b = make(m, k, n, torch.float32, device, bias=bias)
    torch.testing.assert_close(ops.linear(x, weight, b), ops.linear_reference(x, weight, b), **TOLERANCES[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,k,n", [(1, 576, 960), (3, 7, 5), (16, 1536, 576), (33, 64, 3072), (0, 8, 8)])
def test_linear_half(device, dtype, m, k, n):
    x, weight, bias = make(m, k, n, dtype, device)
    torch.testing.assert_close(ops.linear(x, weight, bias), ops.linear_reference(x, weight, bias), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_strided_rows(device, dtype):
    x = strided_rows(9, 333, dtype, device)
    weight, bias = torch.randn(130, 333, device=device).to(dtype) / 18, torch.randn(130, device=device).to(dtype)
    buffer = torch.randn(9, 141, device=device).to(dtype)
    before = buffer.clone()
    out = buffer[:, 4:134]  # row stride 141, offset 4
    ops.linear(x, weight, bias, out=out)
    torch.testing.assert_close(out, ops.linear_reference(x, weight, bias), **TOLERANCES[dtype])
    torch.testing.assert_close(buffer[:, :4], before[:, :4], rtol=0, atol=0)
    torch.testing.assert_close(buffer[:, 134:], before[:, 134:], rtol=0, atol=0)


def test_linear_leading_dims_and_1d(device):
    x = torch.randn(2, 3, 40, device=device)
    weight = torch.randn(24, 40, device=device)
    out = ops.linear(x, weight)
    assert out.shape == (2, 3, 24)
    torch.testing.assert_close(out, ops.linear_reference(x, weight), **TOLERANCES[torch.float32])
    v = torch.randn(40, device=device)
    torch.testing.assert_close(ops.linear(v, weight), ops.linear_reference(v, weight), **TOLERANCES[torch.float32])


def test_linear_empty_dims(device):
    x = torch.randn(4, 0, device=device)
    bias = torch.randn(6, device=device)
    torch.testing.assert_close(ops.linear(x, torch.empty(6, 0, device=device), bias), bias.expand(4, 6))
    assert ops.linear(torch.randn(4, 8, device=device), torch.empty(0, 8, device=device)).shape == (4, 0)


def bf16_error_bound(x, weight, bias):
    """Elementwise bound on |linear(x, weight, bias) - exact| for bf16 operands.

    A product of two bf16 values (8-bit significands) is exact in fp32 (24
    bits), on either path (VDPBF16PS or the fp32 FMAs), so the only errors are
    the fp32 additions -- in any order at most (K + 1) * 2^-24 of the sum of
    |x w| and |bias| -- and the final rounding to bf16 (half a unit in the last
    place: at most 2^-8 relative). The reference is exact (fp64 from the same
    bf16 operands), so any other error (a lost or doubled pair, a stray lane
    past K) breaks the bound."""
    k = x.shape[-1]
    exact = ops.linear_reference(x.double(), weight.double(), None if bias is None else bias.double())
    magnitude = x.double().abs() @ weight.double().abs().T
    if bias is not None:
        magnitude += bias.double().abs()
    return exact, 2**-8 * exact.abs() + (1 + 2**-8) * (k + 1) * 2**-24 * magnitude


# Odd K, K around the 32-element step of VDPBF16PS and the 16/8 lanes of the
# FMA path; 1 and 17 rows (tiles of 4 and a remainder); N not a multiple of
# the 3-row block.
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m", [1, 4, 17])
@pytest.mark.parametrize("k", [1, 2, 15, 31, 33, 64, 577])
@pytest.mark.parametrize("n", [1, 4, 578])
def test_linear_bf16_within_rounding(m, k, n, bias):
    x, weight, b = make(m, k, n, torch.bfloat16, "cpu", bias=bias)
    exact, bound = bf16_error_bound(x, weight, b)
    error = (ops.linear(x, weight, b).double() - exact).abs()
    assert (error <= bound).all(), f"{ops._C.cpu_isa()}: error {error.max()} at {error.argmax()}"


def test_linear_bf16_strided_rows_within_rounding():
    x = strided_rows(17, 333, torch.bfloat16, "cpu")
    weight = (torch.randn(130, 333) / 18).bfloat16()
    exact, bound = bf16_error_bound(x, weight, None)
    assert ((ops.linear(x, weight).double() - exact).abs() <= bound).all()


def test_linear_bf16_path(cpu_isa):
    """The avx512_bf16 kernels multiply on VDPBF16PS, which treats a denormal
    operand as zero (Intel SDM); the fp32-FMA path keeps the exact product. So
    this tells which path ran: a check that the dispatch really switches."""
    x = torch.tensor([[2.0**-130, 1.0]], dtype=torch.bfloat16)  # a bf16 denormal
    weight = torch.tensor([[2.0**100, 0.0]], dtype=torch.bfloat16)
    expected = 0.0 if cpu_isa == "avx512_bf16" else 2.0**-30
    assert ops.linear(x, weight).item() == expected


def test_linear_errors():
    x, weight = torch.randn(3, 8), torch.randn(5, 8)
    with pytest.raises(TypeError, match="input must be float32"):
        ops.linear(x.int(), weight.int())
    with pytest.raises(TypeError, match="weight has dtype"):
        ops.linear(x, weight.bfloat16())
    with pytest.raises(TypeError, match="bias has dtype"):
        ops.linear(x, weight, torch.randn(5, dtype=torch.float64))
    with pytest.raises(TypeError, match="out has dtype"):
        torch.ops.pagoda.linear(torch.empty(3, 5, dtype=torch.bfloat16), x, weight, None)
    with pytest.raises(ValueError, match="in_features"):
        ops.linear(x, torch.randn(5, 7))
    with pytest.raises(ValueError, match="weight must be 2-D"):
        ops.linear(x, torch.randn(8))
    with pytest.raises(ValueError, match="weight must be contiguous"):
        ops.linear(x, torch.randn(8, 5).t())
    with pytest.raises(ValueError, match="bias must be"):
        ops.linear(x, weight, torch.randn(4))
    with pytest.raises(ValueError, match="out must have shape"):
        torch.ops.pagoda.linear(torch.empty(3, 4), x, weight, None)
    with pytest.raises(ValueError, match="input must be contiguous in its last dimension"):
        ops.linear(torch.randn(8, 3).t(), weight)


def test_linear_opcheck():
    torch.library.opcheck(torch.ops.pagoda.linear.default, (torch.empty(3, 5), torch.randn(3, 8), torch.randn(5, 8), None))
    torch.library.opcheck(
        torch.ops.pagoda.linear.default, (torch.empty(3, 5), torch.randn(3, 8), torch.randn(5, 8), torch.randn(5))
    )
