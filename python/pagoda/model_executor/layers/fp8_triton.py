"""Per-token FP8 quantization of activations in one Triton launch (GPU).

quantize_tokens computes exactly fp8.quantize_rows: each program takes one
row, finds its largest magnitude BLOCK elements at a time, stores the row's
scale (max(amax, MIN_AMAX) times the fp32 reciprocal of FP8_MAX), then
multiplies each element by the scale's reciprocal (correctly rounded, div_rn,
as torch's reciprocal), clamps to +-FP8_MAX and rounds to e4m3. The row's
second read comes from L1/L2 (a row of a decode or prefill batch is a few to
tens of KB).

rms_norm_quant and silu_and_mul_quant are the same quantization fused onto
the op that produces the row (the CUDA kernels' rounding, then
quantize_rows' steps on the row held in registers): one launch where there
were two, and the row never goes to memory in the model's dtype. A program
holds a whole row, so a batch runs one or two programs a multiprocessor and
their arithmetic is their time: silu_and_mul_quant takes the exponential and
the division in the GPU's fast fp32 forms (a few fp32 ulps from expf's and
IEEE division's), which the rounding of silu to the model's dtype absorbs but
next to a rounding boundary (H100, 256 rows of Llama-3.1-8B's MLP: 17.2 ->
6.2 us with the reciprocal; no more values off the CUDA op's than the
reciprocal alone gives).

The quantized rows go into buffers as tall as cuBLASLt's next multiple of
_CUBLAS_ROWS (see there), which scaled_gemm hands it whole.

scaled_gemm multiplies the quantized rows by an e4m3 weight with both scale
vectors applied, as torch._scaled_mm does. For a few rows it runs its own
kernel: cuBLASLt's FP8 kernels tile the rows by 64 or more and reach a third
to a half of the bandwidth floor there (Llama-3.1-8B's down_proj at 16 rows
on the H200: 38 us where its 59 MB need 14). The kernel swaps the operands,
as vLLM's CUTLASS kernels do for small batches: the weight's rows are the
tensor cores' M side (64 a program, many programs), the batch's rows their N
side (16 to 128), and each program streams its weight rows once through a
deep pipeline (tools/benchmarks/bench_fp8_linear.py). Both paths sum in the
tensor cores' own accumulator (fast accumulation; cublas_scaled_mm).
"""

from __future__ import annotations

import functools

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
def _store_quantized_row(y, offsets, mask, q_row, scale_ptr, row, FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr):
    # quantize_rows of one row held whole in y (fp32, zeros past its end).
    scale = tl.maximum(tl.max(tl.abs(y), axis=0), MIN_AMAX) * (1.0 / FP8_MAX)
    tl.store(scale_ptr + row, scale)
    q = tl.clamp(y * tl.div_rn(1.0, scale), -FP8_MAX, FP8_MAX)
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
    inverse = tl.div_rn(1.0, scale)
    for start in range(0, cols, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < cols
        values = tl.load(x_row + offsets, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(values * inverse, -FP8_MAX, FP8_MAX)
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
    # cuda/activation.cu's rounding, y = round(round(g / (1 + exp(-g))) * u),
    # with the fast exponential and division (module docstring); then
    # quantize_rows(y).
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    mask = offsets < d
    dtype = x_ptr.dtype.element_ty
    x_row = x_ptr + row * x_stride
    g = tl.load(x_row + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_row + d + offsets, mask=mask, other=0.0).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    y = (silu * u).to(dtype).to(tl.float32)
    _store_quantized_row(y, offsets, mask, q_ptr + row * q_stride, scale_ptr, row, FP8_MAX, MIN_AMAX)


# cuBLASLt's FP8 GEMM takes up to 1.6x longer for a batch just past a
# multiple of 128 rows than for the next multiple (its tile's height; H100,
# Llama-3.1-8B's gate_up_proj: 136 rows 88 us, 256 rows 65 us; 2000 rows of
# its down_proj 235 us, 2048 rows 192 us; docs/BENCHMARKS.md). In the sweep
# (8 layers, 64 to 8192 rows) the multiple was at most 6% slower than the
# rows below it, except Qwen3-0.6B's gate_up_proj at 4000 rows (1.19x). So
# the quantizers allocate their output that tall and return its first rows;
# scaled_gemm gives cuBLASLt the whole height and keeps the output's first
# rows. The rows past the batch are never written: a GEMM's output row
# depends on its own input row only, so whatever they hold lands in output
# rows that are dropped.
_CUBLAS_ROWS = 128


def _cublas_rows(rows: int) -> int:
    return triton.cdiv(rows, _CUBLAS_ROWS) * _CUBLAS_ROWS


def _quantized_output(rows: int, cols: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    tall = _cublas_rows(rows)
    return (torch.empty((tall, cols), dtype=FP8_DTYPE, device=device)[:rows],
            torch.empty((tall, 1), dtype=torch.float32, device=device)[:rows])


def _with_rows(t: torch.Tensor, rows: int) -> torch.Tensor | None:
    """t (contiguous [r, c]) with its storage's next rows up to `rows` (the
    height _quantized_output allocated), or None where the storage ends
    before."""
    cols = t.shape[1]
    if not t.is_contiguous() or t.untyped_storage().nbytes() < (t.storage_offset() + rows * cols) * t.element_size():
        return None
    return t.as_strided((rows, cols), (cols, 1))


def _row_launch(block: int) -> dict:
    """A row kernel's block and warps (a warp per 512 elements, 4 to 16)."""
    return dict(BLOCK=block, num_warps=max(4, min(16, block // 512)))


def _fused_row_launch(cols: int) -> dict | None:
    """A fused kernel's launch: a program holds its row whole, so rows of up
    to _WIDE_BLOCK; None beyond."""
    block = triton.next_power_of_2(cols)
    return None if block > _WIDE_BLOCK else _row_launch(block)


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
                                         MIN_AMAX=MIN_AMAX, **_row_launch(block))
    return q, scale


# Where the swapped kernel runs instead of cuBLASLt: the weight's N a multiple
# of _SKINNY_BLOCK_N and K of _SKINNY_BLOCK_K, and a batch of up to
# _SKINNY_BLOCK_M_MAX rows (one program's tile), or of up to _SKINNY_MAX_ROWS
# while its programs (N / 64 x rows / BLOCK_M of them, BLOCK_M 64 or else 128)
# fit in one wave, one program a multiprocessor (the stages fill its shared
# memory). A second wave nearly doubles the kernel's time, and cuBLASLt is
# then faster. Within one wave the kernel beats cuBLASLt, whose tiles leave
# half the multiprocessors idle on N = 4096 (H200, Llama-3.1-8B's down_proj at
# 144-256 rows: 31-33 us against 38; docs/BENCHMARKS.md).
_SKINNY_BLOCK_N, _SKINNY_BLOCK_M_MAX, _SKINNY_MAX_ROWS = 64, 64, 256
_SKINNY_WIDE_BLOCK_M = 128
# K is taken 128 deep a dot with 8 stages: 256 or 512 deep with 3-6 stages,
# or 12 stages, are within 5% of it at 1-128 rows (H100). A 128-row tile's
# stages are 1.5x as large, so it takes 6 (H200: 8 within 5% of it, 4 up to
# 21% slower). The dot leaves the sum in the tensor cores' accumulator for
# all of K (Triton's default on Hopper), as cublas_scaled_mm does, so both
# paths give the same bits on the same rows (a promotion to fp32 every 128
# products made the layer, its quantization included, 2-10% slower at 1-128
# rows; cublas_scaled_mm says why the error is small).
_SKINNY_BLOCK_K, _SKINNY_STAGES, _SKINNY_WIDE_STAGES = 128, 8, 6


@triton.jit(do_not_specialize=["rows"])
def _skinny_gemm_kernel(x_ptr, w_ptr, x_scale_ptr, w_scale_ptr, out_ptr, rows, k, x_stride, w_stride, out_stride,
                        BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    # out[m, n] = (sum_k x[m, k] w[n, k]) x_scale[m] w_scale[n]: a program
    # takes BLOCK_N weight rows and BLOCK_M batch rows, all of K.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * w_stride + offs_k[None, :]
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * x_stride + offs_k[None, :]
    in_batch = offs_m < rows
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for _ in range(0, k, BLOCK_K):
        w = tl.load(w_ptrs)
        x = tl.load(x_ptrs, mask=in_batch[:, None], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    x_scale = tl.load(x_scale_ptr + offs_m, mask=in_batch, other=0.0)
    acc = acc * tl.load(w_scale_ptr + offs_n)[:, None] * x_scale[None, :]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[None, :] * out_stride + offs_n[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=in_batch[None, :])


@functools.cache
def _hopper_multiprocessors() -> int | None:
    """The multiprocessor count on Hopper (sm_90), else None: the kernel's
    tiles and stages are sized for, and measured on, Hopper's 228 KB of shared
    memory per multiprocessor (not ROCm's 9.4)."""
    if torch.version.hip is not None or torch.cuda.get_device_capability() != (9, 0):
        return None
    return torch.cuda.get_device_properties().multi_processor_count


def skinny_gemm_block_m(rows: int, n: int, k: int) -> int | None:
    """The swapped kernel's batch rows per program (BLOCK_M) for this GEMM, or
    None where cuBLASLt takes it (see _SKINNY_MAX_ROWS; a shape that does not
    tile; not Hopper)."""
    multiprocessors = _hopper_multiprocessors()
    if n % _SKINNY_BLOCK_N or k % _SKINNY_BLOCK_K or multiprocessors is None:
        return None
    if rows <= _SKINNY_BLOCK_M_MAX:
        return max(16, triton.next_power_of_2(rows))
    if rows > _SKINNY_MAX_ROWS:
        return None
    for block_m in (_SKINNY_BLOCK_M_MAX, _SKINNY_WIDE_BLOCK_M):
        if n // _SKINNY_BLOCK_N * triton.cdiv(rows, block_m) <= multiprocessors:
            return block_m
    return None


def cublas_scaled_mm(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """torch._scaled_mm as scaled_gemm calls it (operands as there). Fast
    accumulation, as vLLM's CUTLASS FP8 kernels for Hopper take it: the
    tensor cores keep the sum in their own accumulator (about 14 mantissa
    bits) for all of K, where the default moves it to fp32 every 128
    products. H100, Llama-3.1-8B's GEMMs at 256 rows 1-14% faster, end to end
    +3.5%; the sum's error (1e-3 of the output, relative L2, at K = 4096) is
    a few percent of what rounding the operands to e4m3 costs (about 4%;
    tests/ops/test_triton_fp8.py bounds it at a quarter)."""
    return torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=weight_scale, out_dtype=out_dtype,
                            use_fast_accum=True)


def scaled_gemm(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    """(q * scale) @ (weight * weight_scale).T in out_dtype: q e4m3 [rows, K]
    with scale fp32 [rows, 1], weight e4m3 [N, K] with weight_scale fp32
    [1, N]; fp32 accumulation and scaling, one rounding to out_dtype."""
    rows, k = q.shape
    n = weight.shape[0]
    contiguous = q.stride(1) == 1 and weight.stride(1) == 1
    block_m = skinny_gemm_block_m(rows, n, k) if rows and contiguous else None
    if block_m is None:
        tall = _cublas_rows(rows)
        tall_q, tall_scale = _with_rows(q, tall), _with_rows(scale, tall)
        if tall_q is None or tall_scale is None:
            tall_q, tall_scale = q, scale
        return cublas_scaled_mm(tall_q, tall_scale, weight, weight_scale, out_dtype)[:rows]
    out = torch.empty((rows, n), dtype=out_dtype, device=q.device)
    grid = (n // _SKINNY_BLOCK_N, triton.cdiv(rows, block_m))
    _skinny_gemm_kernel[grid](q, weight, scale, weight_scale, out, rows, k, q.stride(0), weight.stride(0),
                              out.stride(0), BLOCK_N=_SKINNY_BLOCK_N, BLOCK_M=block_m, BLOCK_K=_SKINNY_BLOCK_K,
                              num_stages=_SKINNY_STAGES if block_m <= _SKINNY_BLOCK_M_MAX else _SKINNY_WIDE_STAGES,
                              num_warps=4)
    return out
