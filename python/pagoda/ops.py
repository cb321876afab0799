"""Python face of the compiled ops (torch.ops.pagoda.*), and their pure-torch
references.

The wrappers allocate outputs and pass through to the op; the op itself checks
dtypes, devices and shapes (TypeError/ValueError naming the argument). The
`*_reference` functions define what each kernel computes; tests compare the
kernels with them.
"""

from __future__ import annotations

import torch

from pagoda import _native

_C = _native.load()


# Fake (meta) implementations, for torch.compile and CUDA-graph tracing: every
# op mutates its arguments in place and returns nothing.
for _name in ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding"):
    torch.library.register_fake(f"pagoda::{_name}")(lambda *args, **kwargs: None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)), normalized in fp32 (as Hugging Face's LlamaRMSNorm)."""
    if out is None:
        out = torch.empty_like(x)
    torch.ops.pagoda.rms_norm(out, x, weight, eps)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual += x; x = rms_norm(residual)."""
    torch.ops.pagoda.fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x = [gate | up] on the last dimension; returns silu(gate) * up."""
    if out is None:
        out = torch.empty(*x.shape[:-1], x.shape[-1] // 2, dtype=x.dtype, device=x.device)
    torch.ops.pagoda.silu_and_mul(out, x)
    return out


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    """In place on query and key: rotate the first rot_dim dims of each head by
    the angles of cos_sin_cache[positions] (NeoX or GPT-J pairing)."""
    torch.ops.pagoda.rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)


# --- pure-torch references -------------------------------------------------


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h.to(x.dtype).float()).to(x.dtype)


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns the new (x, residual)."""
    new_residual = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_reference(new_residual, weight, eps), new_residual


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    gate = torch.nn.functional.silu(x[..., :d].float()).to(x.dtype)
    return (gate.float() * x[..., d:].float()).to(x.dtype)


def rotary_embedding_reference(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns rotated copies of (query, key)."""
    rot_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions.flatten()].float().chunk(2, dim=-1)

    def rotate(t: torch.Tensor) -> torch.Tensor:
        shape = t.shape
        per_token = t.flatten(positions.dim()).unflatten(-1, (-1, head_size))
        heads = per_token.reshape(positions.numel(), per_token.shape[-2], head_size).float()
        rot, rest = heads[..., :rot_dim], heads[..., rot_dim:]
        c, s = cos[:, None, :], sin[:, None, :]
        if is_neox:
            x1, x2 = rot.chunk(2, dim=-1)
            rotated = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            rotated = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
        return torch.cat([rotated, rest], dim=-1).to(t.dtype).reshape(shape)

    return rotate(query), None if key is None else rotate(key)


def rotary_cos_sin_cache(
    head_size: int, max_position: int, base: float = 10000.0, rot_dim: int | None = None, dtype=torch.float32
) -> torch.Tensor:
    """The [max_position, rot_dim] cos|sin table of standard RoPE."""
    rot_dim = head_size if rot_dim is None else rot_dim
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype)
