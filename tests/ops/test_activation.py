"""silu_and_mul against the pure-torch reference."""

import pytest
import torch
from op_testing import TOLERANCES, strided_rows

from pagoda import ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2), (5, 34), (3, 8194), (0, 16), (2, 3, 22), (64, 3072)])
def test_silu_and_mul(device, dtype, shape):
    x = torch.randn(shape, dtype=dtype, device=device) * 4
    torch.testing.assert_close(ops.silu_and_mul(x), ops.silu_and_mul_reference(x), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_strided_rows(device, dtype):
    x = strided_rows(11, 2 * 101, dtype, device)
    out = strided_rows(11, 101, dtype, device, pad=7)
    ops.silu_and_mul(x, out=out)
    torch.testing.assert_close(out, ops.silu_and_mul_reference(x), **TOLERANCES[dtype])


def test_silu_and_mul_extreme_values(device):
    x = torch.tensor([[-100.0, 0.0, 100.0, 1e-8, 2.0, 2.0, 2.0, 2.0]], device=device)
    torch.testing.assert_close(ops.silu_and_mul(x), ops.silu_and_mul_reference(x), rtol=1e-5, atol=1e-6)

