"""Per-token FP8 quantization of activations in one Triton launch (GPU).

quantize_tokens computes exactly fp8.quantize_rows: each program takes one
row, finds its largest magnitude BLOCK elements at a time, stores the row's
scale (max(amax, MIN_AMAX) times the fp32 reciprocal of FP8_MAX), then
divides each element by it (correctly rounded, div_rn, as torch divides
tensors), clamps to +-FP8_MAX and rounds to e4m3. The row's second read comes
from L1/L2 (a row of a decode or prefill batch is a few to tens of KB).

rms_norm_quant and silu_and_mul_quant are the same quantization fused onto
the op that produces the row (the CUDA kernels' rounding, then
quantize_rows' steps on the row held in registers): one launch where there
were two, and the row never goes to memory in the model's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from pagoda.model_executor.layers.fp8 import FP8_DTYPE, FP8_MAX, MIN_AMAX

# A row is read BLOCK elements at a time. A decode batch has a program for
# each of its few rows only, so each must be fast: up to WIDE_ROWS rows, a
# block of up to WIDE_BLOCK elements by up to 16 warps (one iteration per
# pass); more rows fill the GPU by themselves and run narrower programs (on
# the H200, Llama-3.1-8B's down_proj input: 1 row 8.8 -> 6.8 us wide, 1024
# rows 22 us narrow against 32 wide; tools/benchmarks/bench_fp8_linear.py).
_WIDE_ROWS, _WIDE_BLOCK, _NARROW_BLOCK = 256, 16384, 1024


@triton.jit
def _store_quantized_row(y, offsets, mask, q_row, scale_ptr, row, FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr):
    # quantize_rows of one row held whole in y (fp32, zeros past its end).
    scale = tl.maximum(tl.max(tl.abs(y), axis=0), MIN_AMAX) * (1.0 / FP8_MAX)
    tl.store(scale_ptr + row, scale)
    q = tl.clamp(tl.div_rn(y, scale), -FP8_MAX, FP8_MAX)
    tl.store(q_row + offsets, q.to(q_row.dtype.element_ty), mask=mask)


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


@triton.jit
def _rms_norm_quant_kernel(x_ptr, residual_ptr, weight_ptr, q_ptr, scale_ptr, cols, cols_f, x_stride,
                           residual_stride, q_stride, eps, FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr,
                           HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    # The CUDA norm's rounding (cuda/norm.cu): r = round(x + residual),
    # y = round(w * round(r * inv_rms)), inv_rms = 1 / sqrt(sum(r^2) / cols +
    # eps) in fp32 with IEEE division and square root; then quantize_rows(y).
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    mask = offsets < cols
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * x_stride + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r_ptrs = residual_ptr + row * residual_stride + offsets
        summed = (x + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)).to(dtype)
        tl.store(r_ptrs, summed, mask=mask)
        x = summed.to(tl.float32)
    inv = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(x * x, axis=0), cols_f) + eps))
    w = tl.load(weight_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    y = (w * (x * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    _store_quantized_row(y, offsets, mask, q_ptr + row * q_stride, scale_ptr, row, FP8_MAX, MIN_AMAX)


@triton.jit
def _silu_and_mul_quant_kernel(x_ptr, q_ptr, scale_ptr, d, x_stride, q_stride, FP8_MAX: tl.constexpr,
                               MIN_AMAX: tl.constexpr, BLOCK: tl.constexpr):
    # cuda/activation.cu's rounding: y = round(round(g / (1 + expf(-g))) * u);
    # then quantize_rows(y).
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    mask = offsets < d
    dtype = x_ptr.dtype.element_ty
    x_row = x_ptr + row * x_stride
    g = tl.load(x_row + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_row + d + offsets, mask=mask, other=0.0).to(tl.float32)
    silu = tl.div_rn(g, 1.0 + libdevice.exp(-g)).to(dtype).to(tl.float32)
    y = (silu * u).to(dtype).to(tl.float32)
    _store_quantized_row(y, offsets, mask, q_ptr + row * q_stride, scale_ptr, row, FP8_MAX, MIN_AMAX)


def _quantized_output(rows: int, cols: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty((rows, cols), dtype=FP8_DTYPE, device=device),
            torch.empty((rows, 1), dtype=torch.float32, device=device))


def _fused_row_launch(cols: int) -> dict | None:
    """A fused kernel's block and warps: a program holds its row whole, so
    rows of up to _WIDE_BLOCK; None beyond."""
    block = triton.next_power_of_2(cols)
    return None if block > _WIDE_BLOCK else dict(BLOCK=block, num_warps=max(4, min(16, block // 512)))


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q, scale) = quantize_rows of the CUDA RMSNorm's output of x [..., cols]
    (with residual: residual += x in place, then the norm of the sum; x is
    not written), or None where the kernel does not take the rows (wider than
    it holds, x not contiguous along them, a residual not contiguous)."""
    cols = x.shape[-1]
    launch = _fused_row_launch(cols)
    if launch is None or x.stride(-1) != 1 or (residual is not None and not residual.is_contiguous()):
        return None
    rows2d = x.reshape(-1, cols)
    res2d = rows2d if residual is None else residual.view(-1, cols)
    q, scale = _quantized_output(rows2d.shape[0], cols, x.device)
    if rows2d.shape[0]:
        _rms_norm_quant_kernel[(rows2d.shape[0],)](rows2d, res2d, weight, q, scale, cols, float(cols), rows2d.stride(0),
                                                   res2d.stride(0), q.stride(0), eps, FP8_MAX=FP8_MAX,
                                                   MIN_AMAX=MIN_AMAX, HAS_RESIDUAL=residual is not None, **launch)
    return q, scale


def silu_and_mul_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q, scale) = quantize_rows of the CUDA silu_and_mul of x [..., 2 d], or
    None where the kernel does not take the rows (as rms_norm_quant)."""
    d = x.shape[-1] // 2
    launch = _fused_row_launch(d)
    if launch is None or x.stride(-1) != 1:
        return None
    rows2d = x.reshape(-1, 2 * d)
    q, scale = _quantized_output(rows2d.shape[0], d, x.device)
    if rows2d.shape[0]:
        _silu_and_mul_quant_kernel[(rows2d.shape[0],)](rows2d, q, scale, d, rows2d.stride(0), q.stride(0),
                                                       FP8_MAX=FP8_MAX, MIN_AMAX=MIN_AMAX, **launch)
    return q, scale


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q e4m3 [rows, cols], scale fp32 [rows, 1]) of x [rows, cols] (rows
    contiguous along cols)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, cols = x.shape
    q, scale = _quantized_output(rows, cols, x.device)
    if rows:
        block = min(triton.next_power_of_2(cols), _WIDE_BLOCK if rows <= _WIDE_ROWS else _NARROW_BLOCK)
        _quantize_tokens_kernel[(rows,)](x, q, scale, cols, x.stride(0), q.stride(0), FP8_MAX=FP8_MAX,
                                         MIN_AMAX=MIN_AMAX, BLOCK=block, num_warps=max(4, min(16, block // 512)))
    return q, scale
