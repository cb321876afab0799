"""Normalization layers: RMSNorm on Pagoda's kernels, LayerNorm (OPT) in torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda import ops
from pagoda.model_executor.layers.fp8 import QuantizedRows, fused_rms_norm_quant
from pagoda.model_executor.weight_utils import new_parameter


class RMSNorm(nn.Module):
    # Set by fp8.quantize_linear_weights where an FP8 linear is the output's
    # only reader: the output comes quantized (fp8.QuantizedRows).
    fp8_output = False

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = new_parameter(hidden_size, dtype=dtype)
        self.weight.data.fill_(1.0)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | QuantizedRows | tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
        """Without residual: rms_norm(x). With it (vLLM's fused form): residual
        += x, then returns (rms_norm(residual), residual); both x and residual
        are overwritten in place, saving a pass over the activations."""
        if self.fp8_output:
            out = fused_rms_norm_quant(x, self.weight, self.eps, residual)
            return out if residual is None else (out, residual)
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return x, residual


class LayerNorm(nn.Module):
    def __init__(
        self, hidden_size: int, eps: float = 1e-5, elementwise_affine: bool = True, dtype: torch.dtype | None = None
    ):
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps
        self.weight = new_parameter(hidden_size, dtype=dtype) if elementwise_affine else None
        self.bias = new_parameter(hidden_size, dtype=dtype) if elementwise_affine else None
        if elementwise_affine:
            self.weight.data.fill_(1.0)
            self.bias.data.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)
