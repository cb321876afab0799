"""Per-token FP8 quantization of activations in one Triton launch (GPU).

Computes exactly fp8.quantize_rows: each program takes one row, finds its
largest magnitude BLOCK elements at a time, stores the row's scale
(max(amax, MIN_AMAX) times the fp32 reciprocal of FP8_MAX), then divides each
element by it (correctly rounded, div_rn, as torch divides tensors), clamps
to +-FP8_MAX and rounds to e4m3. The row's second read comes from L1/L2 (a
row of a decode or prefill batch is a few to tens of KB).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.model_executor.layers.fp8 import FP8_DTYPE, FP8_MAX, MIN_AMAX

# A row is read BLOCK elements at a time. A decode batch has a program for
# each of its few rows only, so each must be fast: up to WIDE_ROWS rows, a
# block of up to WIDE_BLOCK elements by up to 16 warps (one iteration per
# pass); more rows fill the GPU by themselves and run narrower programs (on
# the H200, Llama-3.1-8B's down_proj input: 1 row 8.8 -> 6.8 us wide, 1024
# rows 22 us narrow against 32 wide; tools/benchmarks/bench_fp8_linear.py).
_WIDE_ROWS, _WIDE_BLOCK, _NARROW_BLOCK = 256, 16384, 1024


@triton.jit
def _quantize_tokens_kernel(x_ptr, q_ptr, scale_ptr, cols, x_stride, q_stride,
                            FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    q_row = q_ptr + row * q_stride
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, cols, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        values = tl.load(x_row + offsets, mask=offsets < cols, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(values))
    scale = tl.maximum(tl.max(amax, axis=0), MIN_AMAX) * (1.0 / FP8_MAX)
    tl.store(scale_ptr + row, scale)
    for start in range(0, cols, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < cols
        values = tl.load(x_row + offsets, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(tl.div_rn(values, scale), -FP8_MAX, FP8_MAX)
        tl.store(q_row + offsets, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q e4m3 [rows, cols], scale fp32 [rows, 1]) of x [rows, cols] (rows
    contiguous along cols)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        block = min(triton.next_power_of_2(cols), _WIDE_BLOCK if rows <= _WIDE_ROWS else _NARROW_BLOCK)
        _quantize_tokens_kernel[(rows,)](x, q, scale, cols, x.stride(0), q.stride(0), FP8_MAX=FP8_MAX,
                                         MIN_AMAX=MIN_AMAX, BLOCK=block, num_warps=max(4, min(16, block // 512)))
    return q, scale
