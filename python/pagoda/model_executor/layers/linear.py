"""Linear layers under vLLM's names, without tensor parallelism yet.

The names mark where tensor parallelism will split the weights (column
parallel: output rows; row parallel: input columns plus an all-reduce). The
fused layers concatenate several Hugging Face projections along the output
dimension so one matmul does them all; their weight_loader puts each
checkpoint part (and its bias) at its offset.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda import ops
from pagoda.model_executor.weight_utils import default_weight_loader, new_parameter


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias. On the CPU, Pagoda's kernel where it measured
    faster than torch (tools/benchmarks/bench_cpu_linear.py): fp32 with 2 to 64
    rows -- decode batches -- and bf16/fp16 always; torch's elsewhere (a lone
    fp32 row is memory-bound either way; prefill is a large GEMM)."""
    rows = x.numel() // max(x.shape[-1], 1)
    if x.device.type == "cpu" and (x.dtype != torch.float32 or 2 <= rows <= 64):
        return ops.linear(x, weight, bias)
    return F.linear(x, weight, bias)


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.weight = new_parameter(output_size, input_size, dtype=dtype, weight_loader=self.weight_loader)
        self.bias = new_parameter(output_size, dtype=dtype, weight_loader=self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        default_weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    """Same weights on every rank."""


class ColumnParallelLinear(LinearBase):
    """Tensor parallelism will give each rank a slice of the output rows."""


class RowParallelLinear(LinearBase):
    """Tensor parallelism will give each rank a slice of the input columns and
    all-reduce the outputs."""


class _FusedColumnLinear(ColumnParallelLinear):
    """Output rows split into named parts: shard_id -> (offset, size)."""

    def __init__(self, input_size: int, parts: dict, bias: bool, dtype: torch.dtype | None):
        self.parts = parts
        super().__init__(input_size, sum(size for _, size in parts.values()), bias, dtype)
        for param in (self.weight, self.bias):
            if param is not None:
                param.shard_ids = tuple(parts)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:  # a checkpoint that is already fused
            return default_weight_loader(param, loaded_weight)
        if shard_id not in self.parts:
            raise ValueError(f"unknown shard {shard_id!r}; this layer has {list(self.parts)}")
        offset, size = self.parts[shard_id]
        default_weight_loader(param.narrow(0, offset, size), loaded_weight)


class MergedColumnParallelLinear(_FusedColumnLinear):
    """Several projections of one input, e.g. an MLP's gate and up (shard ids
    0, 1, ... in the order of output_sizes)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, dtype: torch.dtype | None = None):
        offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]
        super().__init__(input_size, {i: (offsets[i], size) for i, size in enumerate(output_sizes)}, bias, dtype)


class QKVParallelLinear(_FusedColumnLinear):
    """q, k and v projections in one matmul; output [T, (H + 2 * Hkv) * head_size]
    with q first, then k, then v (shard ids "q", "k", "v")."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ):
        self.q_size = total_num_heads * head_size
        self.kv_size = (total_num_kv_heads or total_num_heads) * head_size
        q, kv = self.q_size, self.kv_size
        parts = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}
        super().__init__(hidden_size, parts, bias, dtype)
