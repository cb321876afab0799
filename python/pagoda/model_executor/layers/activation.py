"""Activations: the fused SiLU-and-multiply kernel of gated MLPs, and the plain
ones of non-gated MLPs (OPT), chosen by Hugging Face's activation name."""

from __future__ import annotations

import torch
from torch import nn

from pagoda import ops
from pagoda.model_executor.layers.fp8 import QuantizedRows, fused_silu_and_mul_quant


class SiluAndMul(nn.Module):
    """x = [gate | up] on the last dimension -> silu(gate) * up."""

    fp8_output = False  # as RMSNorm's: set where an FP8 linear reads the output

    def forward(self, x: torch.Tensor) -> torch.Tensor | QuantizedRows:
        if self.fp8_output:
            return fused_silu_and_mul_quant(x)
        return ops.silu_and_mul(x)


_ACTIVATIONS = {
    "relu": lambda: nn.ReLU(),
    "gelu": lambda: nn.GELU(),
    "gelu_new": lambda: nn.GELU(approximate="tanh"),
    "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"),
    "silu": lambda: nn.SiLU(),
}


def get_act_fn(name: str) -> nn.Module:
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(sorted(_ACTIVATIONS))}")
    return _ACTIVATIONS[name]()
