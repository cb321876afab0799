"""Helpers shared by the kernel tests: tolerances, awkward inputs, skips."""

import pytest
import torch

from pagoda import _native

TOLERANCES = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    # Up to two units in the last place: the kernels sum in another order than
    # torch, and rms_norm rounds twice (as Hugging Face does).
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5),
    torch.float16: dict(rtol=2.5e-3, atol=1e-5),
}


def strided_rows(rows: int, width: int, dtype, device, pad: int = 5) -> torch.Tensor:
    """A [rows, width] view whose row stride is width + pad (not contiguous)."""
    return torch.randn(rows, width + pad, dtype=dtype, device=device)[:, :width]


def skip_without_kernel(op: str, device: str) -> str:
    """`device`, or a skip when the op has no kernel for it yet."""
    if device != "cpu" and not _native.has_kernel(op, device):
        pytest.skip(f"no {device} implementation of {op} yet")
    return device
