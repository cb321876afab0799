"""FP8 weights and activations for the linear layers (--quantization fp8).

W8A8 in float8 e4m3, as vLLM's dynamic FP8: each linear layer's weight is
quantized once at load (from the bf16/fp16 checkpoint) with one scale per
output channel; each step's activations are quantized per token (one scale
per row, from that row's largest magnitude); torch._scaled_mm multiplies them
on the FP8 tensor cores (Hopper's QGMMA; CUDA capability 8.9+) with both
scale vectors applied in its epilogue, out in the model's dtype, or on
Hopper for batches of up to 64 rows (up to 256 while they fit one wave) a
Triton kernel of our own (fp8_triton.scaled_gemm; cuBLASLt's FP8 kernels are
far from the bandwidth floor there). A weight takes half the bytes of bf16,
and the FP8 tensor cores' peak rate is twice bf16's (docs/BENCHMARKS.md).

The embedding and the LM head stay in the model's dtype (as in vLLM: the
logits are the most sensitive part and a small share of the FLOPs).

Error: e4m3 keeps 3 mantissa bits, so a value rounds to within 2^-4 of
itself relative (half a unit in the last place); below e4m3's smallest
normal (2^-6 times the scale) the absolute error is at most 2^-10 times the
scale. On the GPU the products are summed in the FP8 tensor cores' own
accumulator (fast accumulation, as vLLM's FP8 kernels on Hopper), which adds
a few percent of that rounding's error (fp8_triton.cublas_scaled_mm).
tests/models/test_fp8.py holds the kernels to that and the models to greedy
agreement with bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
# A row of zeros still gets a finite, nonzero scale (its values quantize to 0).
MIN_AMAX = 1e-12
# _scaled_mm's tensor-core tiles need both GEMM dimensions in multiples of 16;
# a layer with another shape keeps its weight in the model's dtype.
ALIGNMENT = 16


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): x [rows, cols] as e4m3 with one fp32 scale per row
    ([rows, 1]), x ~= q * scale. The pure-torch definition: weights at load,
    activations on the CPU, and the reference of the Triton kernel."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_(min=MIN_AMAX)
    # Products by fp32 reciprocals, not quotients: torch's CUDA division by a
    # scalar is one, and a division per value took the Triton kernels most of
    # their time; this way the result is the same on every device and in
    # Triton. The reciprocal adds at most an fp32 ulp before e4m3's rounding.
    scale = amax * (1 / FP8_MAX)
    q = (x.float() * scale.reciprocal()).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


@dataclass
class QuantizedRows:
    """An activation [..., cols] already quantized per row (q e4m3, scale fp32
    [rows, 1], as quantize_rows gives) by the op that produced it: a norm or
    the MLP's activation with the quantization fused in (fp8_output), so the
    FP8 linear after it reads e4m3 and launches no quantization of its own.
    dtype: the activation's own dtype, the linear's output dtype."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


def fused_rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float,
                         residual: torch.Tensor | None = None) -> QuantizedRows:
    """quantize_rows of RMSNorm's output: of rms_norm(x), or, with residual,
    of fused_add_rms_norm's (residual += x in place, then its norm; x may be
    overwritten). On CUDA one Triton launch, which never writes the
    normalized rows in the model's dtype; elsewhere (or for rows too wide for
    it) the two ops in turn."""
    from pagoda import ops

    if x.device.type == "cuda":
        from pagoda.model_executor.layers import fp8_triton  # GPU only: CPU installs need no triton

        fused = fp8_triton.rms_norm_quant(x, weight, eps, residual)
        if fused is not None:
            return QuantizedRows(*fused, x.dtype)
    if residual is None:
        normed = ops.rms_norm(x, weight, eps)
    else:
        ops.fused_add_rms_norm(x, residual, weight, eps)
        normed = x
    return QuantizedRows(*quantize_tokens(normed.reshape(-1, normed.shape[-1])), x.dtype)


def fused_silu_and_mul_quant(x: torch.Tensor) -> QuantizedRows:
    """quantize_rows of silu_and_mul(x) (x = [gate | up]): on CUDA one Triton
    launch, elsewhere (or for rows too wide for it) the two ops in turn."""
    from pagoda import ops

    if x.device.type == "cuda":
        from pagoda.model_executor.layers import fp8_triton

        fused = fp8_triton.silu_and_mul_quant(x)
        if fused is not None:
            return QuantizedRows(*fused, x.dtype)
    out = ops.silu_and_mul(x)
    return QuantizedRows(*quantize_tokens(out.reshape(-1, out.shape[-1])), x.dtype)


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows of an activation [tokens, hidden]: on CUDA one Triton
    launch (a read for the maxima, a read and a write for the values) instead
    of torch's six elementwise passes."""
    if x.device.type != "cuda":
        return quantize_rows(x)
    from pagoda.model_executor.layers import fp8_triton  # GPU only: CPU installs need no triton

    return fp8_triton.quantize_tokens(x)


def fp8_linear(x: torch.Tensor | QuantizedRows, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ dequantized(weight).T + bias in x's dtype. weight: e4m3 [N, K] with
    weight_scale fp32 [1, N] (quantize_linear_weights). x may come quantized
    already (QuantizedRows)."""
    if isinstance(x, QuantizedRows):
        (q, scale), lead, dtype = (x.q, x.scale), x.q.shape[:-1], x.dtype
    else:
        lead, dtype = x.shape[:-1], x.dtype
        q, scale = quantize_tokens(x.reshape(-1, x.shape[-1]))
    if q.shape[0] == 0:
        return q.new_empty(*lead, weight.shape[0], dtype=dtype)
    if q.is_cuda:
        from pagoda.model_executor.layers import fp8_triton

        out = fp8_triton.scaled_gemm(q, scale, weight, weight_scale, dtype)
    else:
        out = torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=weight_scale, out_dtype=dtype)
    if bias is not None:
        out.add_(bias)
    return out.view(*lead, weight.shape[0])


def quantize_linear_weights(model: nn.Module) -> tuple[int, int]:
    """Quantizes the weight of every linear layer (pagoda's LinearBase) whose
    shape the FP8 GEMM takes, in place, one layer at a time (peak memory: the
    model plus one layer's fp32 temporaries, three copies of its weight in
    fp32). Each weight becomes e4m3 with an
    `fp8_scale` attribute (fp32 [1, N]) that dense() dispatches on. Returns
    (layers quantized, layers left in the model's dtype)."""
    from pagoda.model_executor.layers.linear import LinearBase

    quantized = kept = 0
    for module in model.modules():
        if not isinstance(module, LinearBase):
            continue
        weight = module.weight
        if weight.shape[0] % ALIGNMENT or weight.shape[1] % ALIGNMENT:
            kept += 1
            continue
        q, scale = quantize_rows(weight.data)
        fp8_weight = nn.Parameter(q, requires_grad=False)
        fp8_weight.fp8_scale = scale.view(1, -1).contiguous()
        module.weight = fp8_weight
        quantized += 1
    # A norm or activation whose only reader is an FP8 linear quantizes its
    # output itself (one launch instead of two; the module names the pairs).
    for module in model.modules():
        for producer, consumer in getattr(module, "fp8_input_producers", ()):
            if hasattr(module.get_submodule(consumer).weight, "fp8_scale"):
                module.get_submodule(producer).fp8_output = True
    return quantized, kept
