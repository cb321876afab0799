"""rms_norm and fused_add_rms_norm against the pure-torch reference."""

import pytest
import torch
from op_testing import TOLERANCES, strided_rows

from pagoda import ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 1), (1, 17), (3, 64), (7, 4097), (0, 64), (2, 3, 96), (33, 576)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm(device, dtype, shape):
    x = torch.randn(shape, dtype=dtype, device=device) * 3
    weight = torch.randn(shape[-1], dtype=dtype, device=device)
    out = ops.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(out, ops.rms_norm_reference(x, weight, 1e-6), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_strided_rows(device, dtype):
    x = strided_rows(9, 333, dtype, device)
    weight = torch.randn(333, dtype=dtype, device=device)
    out = strided_rows(9, 333, dtype, device)
    ops.rms_norm(x, weight, 1e-5, out=out)
    torch.testing.assert_close(out, ops.rms_norm_reference(x, weight, 1e-5), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_add_rms_norm(device, dtype, shape):
    x = torch.randn(shape, dtype=dtype, device=device)
    residual = torch.randn(shape, dtype=dtype, device=device)
    weight = torch.randn(shape[-1], dtype=dtype, device=device)
    want_x, want_residual = ops.fused_add_rms_norm_reference(x, residual, weight, 1e-6)
    ops.fused_add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(residual, want_residual, **TOLERANCES[dtype])
    torch.testing.assert_close(x, want_x, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_strided_rows(device, dtype):
    x = strided_rows(5, 130, dtype, device)
    residual = strided_rows(5, 130, dtype, device, pad=3)
    weight = torch.randn(130, dtype=dtype, device=device)
    want_x, want_residual = ops.fused_add_rms_norm_reference(x, residual, weight, 1e-6)
    ops.fused_add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(residual, want_residual, **TOLERANCES[dtype])
    torch.testing.assert_close(x, want_x, **TOLERANCES[dtype])


def test_rms_norm_leaves_padding_alone(device):
    buffer = torch.randn(4, 70, device=device)
    before = buffer.clone()
    out = buffer[:, :64]
    ops.rms_norm(torch.randn(4, 64, device=device), torch.ones(64, device=device), 1e-6, out=out)
    torch.testing.assert_close(buffer[:, 64:], before[:, 64:], rtol=0, atol=0)

