"""Putting checkpoint tensors (Hugging Face names) into a model's parameters.

Parameters carry their own `weight_loader(param, loaded_weight[, shard_id])`
(vLLM's convention): a fused parameter such as qkv_proj knows where q, k and v
go. A fused parameter also lists its `shard_ids`, so that a checkpoint missing
one part of it is caught as surely as one missing a whole parameter.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded_weight.shape)}")
    param.data.copy_(loaded_weight)  # casts to the parameter's dtype


def new_parameter(*shape: int, dtype: torch.dtype | None, weight_loader=default_weight_loader) -> nn.Parameter:
    """Uninitialized (torch.empty: untouched pages cost no memory until the
    loader writes them), no grad, with its weight_loader attached."""
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.weight_loader = weight_loader
    return param


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_params_mapping: Iterable[tuple[str, str, object]] = (),
    rename: Callable[[str], str | None] = lambda name: name,
) -> None:
    """Loads every (name, tensor) of `weights` and checks that nothing is left
    out. stacked_params_mapping: (fused module, checkpoint module, shard id),
    e.g. ("qkv_proj", "q_proj", "q"), matched on whole name components.
    rename maps a checkpoint name to the model's, or to None to skip it."""
    params = dict(model.named_parameters())
    expected = {(name, shard) for name, p in params.items() for shard in getattr(p, "shard_ids", (None,))}
    loaded: set[tuple[str, object]] = set()
    for checkpoint_name, tensor in weights:
        # Old checkpoints saved RoPE's inverse frequencies; we compute our own.
        name = None if checkpoint_name.endswith("rotary_emb.inv_freq") else rename(checkpoint_name)
        if name is None:
            continue
        parts, shard = name.split("."), None
        for fused, part, shard_id in stacked_params_mapping:
            if part in parts:
                parts[parts.index(part)] = fused
                name, shard = ".".join(parts), shard_id
                break
        if name not in params:
            raise ValueError(f"unexpected weight {checkpoint_name!r} for {type(model).__name__}")
        param = params[name]
        try:
            if shard is None:
                param.weight_loader(param, tensor)
            else:
                param.weight_loader(param, tensor, shard)
        except ValueError as e:
            raise ValueError(f"cannot load {checkpoint_name!r} into {name!r}: {e}") from None
        loaded.add((name, shard))
    whole = {name for name, shard in loaded if shard is None}  # e.g. a checkpoint with qkv already fused
    missing = sorted(
        name + ("" if shard is None else f" ({shard})") for name, shard in expected - loaded if name not in whole
    )
    if missing:
        raise ValueError(f"weights missing from the checkpoint for {type(model).__name__}: {', '.join(missing)}")
