"""The Triton per-token FP8 quantization (fp8_triton.quantize_tokens) against
its definition, fp8.quantize_rows: the same scales and the same e4m3 values,
bit for bit.

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
    from pagoda.model_executor.layers.fp8_triton import quantize_tokens


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
