"""Rotary position embedding: a cos|sin table per position, applied in place to
q and k by the rotary_embedding kernel.

The table is fp32 whatever the model's dtype: the kernel reads fp32 angles
with bf16/fp16 q and k, and large positions lose their accuracy in bf16.
Inverse frequencies follow Hugging Face's formulas exactly (default, "linear",
"llama3"), so tables match transformers' bit for bit in fp32.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pagoda import ops


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size: int, rotary_dim: int, max_position: int, inv_freq: torch.Tensor, is_neox_style: bool):
        super().__init__()
        self.head_size, self.rotary_dim, self.is_neox_style = head_size, rotary_dim, is_neox_style
        # Computed on the CPU whatever the target device: one table, bit for
        # bit, on every device.
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32, device="cpu"), inv_freq.cpu())
        table = torch.cat([angles.cos(), angles.sin()], dim=-1)
        self.register_buffer("cos_sin_cache", table.to(torch.get_default_device()), persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """In place on query/key ([T, heads * head_size], strided rows allowed);
        returns them for convenience."""
        ops.rotary_embedding(positions, query, key, self.head_size, self.cos_sin_cache, self.is_neox_style)
        return query, key


def _default_inv_freq(base: float, rotary_dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict, max_position: int) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed down by `factor`, short ones kept,
    the band between interpolated."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling.get("original_max_position_embeddings") or max_position
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


_ROPE_CACHE: dict[tuple, RotaryEmbedding] = {}


def get_rope(
    head_size: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    is_neox_style: bool = True,
    rope_scaling: dict | None = None,
    dtype: torch.dtype | None = None,
) -> RotaryEmbedding:
    """One shared module per distinct setting (as vLLM): every layer of a model
    uses the same table. `dtype` is the model's; the table stays fp32 (see the
    module docstring). The table lives on torch's default device (the model
    is built under `with torch.device(...)`), so that is part of the key."""
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    key = (head_size, rotary_dim, max_position, float(base), is_neox_style, repr(sorted((rope_scaling or {}).items())),
           torch.get_default_device())
    if key in _ROPE_CACHE:
        return _ROPE_CACHE[key]
    inv_freq = _default_inv_freq(base, rotary_dim)
    if rope_type == "linear":
        inv_freq = inv_freq / rope_scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope_scaling, max_position)
    elif rope_type != "default":
        raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: default, linear, llama3")
    rope = _ROPE_CACHE[key] = RotaryEmbedding(head_size, rotary_dim, max_position, inv_freq, is_neox_style)
    return rope


def rope_parameters_from_config(hf_config) -> tuple[float, dict | None, float]:
    """(rope_theta, rope_scaling or None for plain RoPE, partial_rotary_factor)
    from a Hugging Face config. transformers 5.x keeps everything in
    `rope_parameters` (rope_theta included; `rope_scaling` is an alias);
    4.x had `rope_theta` and `rope_scaling` (possibly None) as attributes."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"per-layer-type rope parameters are not supported: {params}")
    theta = params.get("rope_theta") or getattr(hf_config, "rope_theta", None) or 10000.0
    partial = params.get("partial_rotary_factor") or getattr(hf_config, "partial_rotary_factor", None) or 1.0
    rope_type = params.get("rope_type", params.get("type", "default"))
    scaling = None if rope_type == "default" else {**params, "rope_type": rope_type}
    return float(theta), scaling, float(partial)
