"""The collectives of the tensor-parallel layers, over the TP group. With one
rank they return their input untouched: no torch.distributed call at all."""

from __future__ import annotations

import torch
import torch.distributed as dist

from pagoda.distributed.parallel_state import get_tensor_model_parallel_group, get_tensor_model_parallel_world_size

# torch 2.13 renamed all_gather_into_tensor (the GPU host runs 2.11); both
# gather into one tensor of the inputs concatenated on dim 0.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the TP ranks, in place on x (returned)."""
    if get_tensor_model_parallel_world_size() == 1:
        return x
    dist.all_reduce(x, group=get_tensor_model_parallel_group())
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The ranks' x concatenated on `dim` in rank order (a new tensor)."""
    world_size = get_tensor_model_parallel_world_size()
    if world_size == 1:
        return x
    dim %= x.dim()
    gathered = torch.empty((world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(gathered, x.contiguous(), group=get_tensor_model_parallel_group())
    if dim == 0:
        return gathered
    # [world * d0, ...] -> [world, d0, ...] -> rank blocks side by side on dim.
    shape = (*x.shape[:dim], world_size * x.shape[dim], *x.shape[dim + 1 :])
    return gathered.view(world_size, *x.shape).movedim(0, dim).reshape(shape)
