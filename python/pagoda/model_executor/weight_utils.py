"""Putting checkpoint tensors (Hugging Face names) into a model's parameters.

Parameters carry their own `weight_loader(param, loaded_weight[, shard_id])`
(vLLM's convention): a fused parameter such as qkv_proj knows where q, k and v
go. A fused parameter also lists its `shard_ids`, so that a checkpoint missing
one part of it is caught as surely as one missing a whole parameter.

Under tensor parallelism loaded_weight is always the whole checkpoint tensor
and the weight_loader narrows it to this rank's slice; a parameter that holds
a slice records the whole tensor's shape as `full_shape`. loaded_weight may be
a LazyTensor (safetensors): narrowing it reads nothing, so a rank reads only
its slice of the file.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from pagoda import ops


class LazyTensor:
    """A checkpoint tensor not read yet, with the little of torch.Tensor's
    interface weight loaders use (shape, dim, narrow). load() reads what the
    narrowing left through safetensors' get_slice, and floating tensors come
    out in `dtype`. Valid while the iterator that yielded it is at it (the
    file handle closes when the iterator moves on)."""

    def __init__(self, handle, name: str, dtype: torch.dtype, shape=None, index: tuple[slice, ...] | None = None):
        self._handle, self._name, self._dtype = handle, name, dtype
        self.shape = torch.Size(handle.get_slice(name).get_shape() if shape is None else shape)
        self._index = index

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> LazyTensor:
        dim %= self.dim()
        if not 0 <= start <= start + length <= self.shape[dim]:
            raise ValueError(f"cannot narrow dim {dim} of size {self.shape[dim]} to [{start}, {start + length})")
        if length == self.shape[dim]:  # the whole dim (every narrow at TP=1): still the plain read
            return self
        index = list(self._index or (slice(0, n) for n in self.shape))
        offset = index[dim].start
        index[dim] = slice(offset + start, offset + start + length)
        shape = (*self.shape[:dim], length, *self.shape[dim + 1 :])
        return LazyTensor(self._handle, self._name, self._dtype, shape, tuple(index))

    def load(self, cast: bool = True) -> torch.Tensor:
        """The tensor; cast=False leaves floating tensors in the file's dtype
        (for a copy_ into a parameter, which casts without a second temporary)."""
        # Unnarrowed (every tensor at TP=1): the plain read.
        if self._index is None:
            tensor = self._handle.get_tensor(self._name)
        else:
            tensor = self._handle.get_slice(self._name)[self._index]
        return tensor.to(self._dtype) if cast and tensor.is_floating_point() else tensor


class PackedWeight:
    """A GGUF matrix kept in its quantized block layout: data is uint8 [rows,
    row bytes] (the file's bytes), weight_type GGML's type id, shape the
    logical [rows, cols]. Rows narrow like a tensor's (whole blocks each);
    columns only as a whole."""

    def __init__(self, data: torch.Tensor, weight_type: int, shape: tuple[int, int]):
        self.data, self.weight_type, self.shape = data, weight_type, torch.Size(shape)

    def dim(self) -> int:
        return 2

    def narrow(self, dim: int, start: int, length: int) -> PackedWeight:
        dim %= 2
        if length == self.shape[dim]:
            return self
        if dim == 1:
            raise ValueError("a GGUF-packed weight cannot be split by columns (tensor parallel row layers)")
        return PackedWeight(self.data.narrow(0, start, length), self.weight_type, (length, self.shape[1]))


def pack_parameter(param: nn.Parameter, packed: PackedWeight) -> None:
    """Makes a [rows, cols] parameter hold GGUF blocks of packed's type
    (uint8 [rows, packed row bytes]; param.gguf_type says which), so that
    the layer's weight_loader copies rows of blocks into it and its forward
    calls the packed kernels. Idempotent for the parts of a fused parameter."""
    weight_type = getattr(param, "gguf_type", None)
    if weight_type is None:
        param.data = torch.empty(param.shape[0], packed.data.shape[1], dtype=torch.uint8, device=param.device)
        param.gguf_type = packed.weight_type
    elif weight_type != packed.weight_type:
        raise ValueError(f"parts of one fused weight are packed in GGUF types {weight_type} and {packed.weight_type}")


def quantize_packed_inputs(model: nn.Module) -> int:
    """Repacks the packed GGUF weights (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) in
    place into the int8 path's
    panel layout (ops.gguf_to_panels) and marks them (gguf_quantize_input) so
    that dense() has them multiply inputs rounded to int8 per block, and a
    table among them (a tied embedding) is looked up in that layout. Returns
    how many."""
    marked = 0
    for param in model.parameters():  # each tensor once, tied ones too
        if getattr(param, "gguf_type", None) in ops.GGUF_INT8_TYPES:
            ops.gguf_to_panels(param.data, param.gguf_type)
            param.gguf_quantize_input = True
            marked += 1
    return marked


def check_shape(expected: tuple[int, ...], loaded_weight: torch.Tensor | LazyTensor) -> None:
    if tuple(expected) != tuple(loaded_weight.shape):
        raise ValueError(f"shape mismatch: parameter {tuple(expected)}, checkpoint {tuple(loaded_weight.shape)}")


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor | LazyTensor | PackedWeight) -> None:
    if isinstance(loaded_weight, PackedWeight):  # param holds blocks (pack_parameter)
        loaded_weight = loaded_weight.data
    check_shape(param.shape, loaded_weight)
    if isinstance(loaded_weight, LazyTensor):
        loaded_weight = loaded_weight.load(cast=False)
    param.data.copy_(loaded_weight)  # casts to the parameter's dtype


def new_parameter(*shape: int, dtype: torch.dtype | None, weight_loader=default_weight_loader) -> nn.Parameter:
    """Uninitialized (torch.empty: untouched pages cost no memory until the
    loader writes them), no grad, with its weight_loader attached."""
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.weight_loader = weight_loader
    return param


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor | LazyTensor]],
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
            if isinstance(tensor, PackedWeight):
                pack_parameter(param, tensor)
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
