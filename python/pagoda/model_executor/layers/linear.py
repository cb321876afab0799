"""Linear layers under vLLM's names, sharded for tensor parallelism.

Column parallel layers split the output features: each rank holds a slice of
the weight's rows (and of the bias) and computes that slice of the output.
Row parallel layers split the input features: each rank holds a slice of the
weight's columns, takes the matching slice of the input (what a column
parallel layer before it produced) and the partial outputs are all-reduced.
A column parallel layer followed by a row parallel one thus costs one
all-reduce. The fused layers concatenate several Hugging Face projections
along the output dimension so one matmul does them all, each part sharded on
its own; their weight_loader puts this rank's slice of each checkpoint part
(and its bias) at its offset.

Every parameter records the whole tensor's shape as `full_shape`: the
weight_loader takes the whole checkpoint tensor (or a LazyTensor of it) and
narrows it to this rank's slice. With one rank nothing is split and no
collective runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda import ops
from pagoda.distributed.communication_op import tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce
from pagoda.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from pagoda.distributed.utils import divide, num_kv_heads_per_rank
from pagoda.model_executor.layers.fp8 import fp8_linear
from pagoda.model_executor.weight_utils import check_shape, default_weight_loader, new_parameter


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias. On the CPU, Pagoda's kernel where it measured
    faster than torch (tools/benchmarks/bench_cpu_linear.py): fp32 with 2 to
    64 rows -- decode batches -- fp16 always, bf16 up to 64 rows (any number
    where the CPU lacks AVX512_BF16); torch's elsewhere (a lone fp32 row is
    memory-bound either way; prefill is a large GEMM). A weight
    kept in GGUF blocks (gguf_type set by the loader) goes to the packed
    kernel at any number of rows (fp32 products on blocks dequantized in
    registers: as fast as torch's fp32 GEMM on the dequantized weight from
    64 to 1024 rows, docs/BENCHMARKS.md; on inputs rounded to int8 where
    quantize_packed_inputs marked it), an FP8 one (fp8_scale set by
    quantize_linear_weights) to the FP8 GEMM."""
    gguf_type = getattr(weight, "gguf_type", None)
    if gguf_type is not None:
        return ops.gguf_linear(x, weight, gguf_type, bias,
                               quantize_input=getattr(weight, "gguf_quantize_input", False))
    fp8_scale = getattr(weight, "fp8_scale", None)
    if fp8_scale is not None:
        return fp8_linear(x, weight, fp8_scale, bias)
    if x.device.type == "cpu" and cpu_kernel_takes(x.numel() // max(x.shape[-1], 1), x.dtype):
        return ops.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def cpu_kernel_takes(rows: int, dtype: torch.dtype) -> bool:
    """Whether dense() multiplies `rows` rows of dtype on the CPU with Pagoda's
    kernel (ops.linear) rather than torch's."""
    return (
        dtype == torch.float16
        or dtype == torch.float32 and 2 <= rows <= 64
        or dtype == torch.bfloat16 and (rows <= 64 or not _TORCH_BF16_GEMM_FAST)
    )


# Where the CPU has AVX512_BF16, torch's bf16 GEMM (oneDNN) multiplies on it as
# Pagoda's kernel does and is faster above 64 rows (prefill: 300-430 against
# 190-300 GFLOP/s on SmolLM2's shapes, docs/BENCHMARKS.md); without it torch's
# bf16 runs at ~10 GFLOP/s and the kernel wins at any size.
_TORCH_BF16_GEMM_FAST = "avx512_bf16" in ops._C.supported_cpu_isas()


class LinearBase(nn.Module):
    """input_size -> output_size overall; this rank's weight is
    [output_size_per_partition, input_size_per_partition] (the whole one
    unless a subclass splits a dimension)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        input_size_per_partition: int | None = None,
        output_size_per_partition: int | None = None,
    ):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = input_size_per_partition or input_size
        self.output_size_per_partition = output_size_per_partition or output_size
        self.tp_rank, self.tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        rows, cols = self.output_size_per_partition, self.input_size_per_partition
        self.weight = new_parameter(rows, cols, dtype=dtype, weight_loader=self.weight_loader)
        self.weight.full_shape = (output_size, input_size)
        self.bias = None
        if bias:
            self.bias = new_parameter(rows, dtype=dtype, weight_loader=self.weight_loader)
            self.bias.full_shape = (output_size,)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        default_weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    """Same weights on every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, dtype: torch.dtype | None = None):
        super().__init__(input_size, output_size, bias, dtype)


class ColumnParallelLinear(LinearBase):
    """Each rank computes output_size / tp of the output features;
    gather_output all-gathers the whole output onto every rank."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        gather_output: bool = False,
    ):
        self.gather_output = gather_output
        local = self.local_output_size(output_size, get_tensor_model_parallel_world_size())
        super().__init__(input_size, output_size, bias, dtype, output_size_per_partition=local)

    def local_output_size(self, output_size: int, tp_size: int) -> int:
        return divide(output_size, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        check_shape(param.full_shape, loaded_weight)
        rows = param.shape[0]  # weight and bias alike: this rank's block of output rows
        default_weight_loader(param, loaded_weight.narrow(0, self.tp_rank * rows, rows))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = dense(x, self.weight, self.bias)
        return tensor_model_parallel_all_gather(out) if self.gather_output else out


class RowParallelLinear(LinearBase):
    """Each rank multiplies its input_size / tp input features (the output of
    a column parallel layer) and the partial outputs are all-reduced; the bias
    is whole on every rank and added once, after the reduction."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, dtype: torch.dtype | None = None):
        local = divide(input_size, get_tensor_model_parallel_world_size())
        super().__init__(input_size, output_size, bias, dtype, input_size_per_partition=local)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        check_shape(param.full_shape, loaded_weight)
        if param is self.weight and self.tp_size > 1:  # (one rank: the whole weight, maybe GGUF-packed)
            cols = param.shape[1]
            loaded_weight = loaded_weight.narrow(1, self.tp_rank * cols, cols)
        default_weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return dense(x, self.weight, self.bias)
        out = tensor_model_parallel_all_reduce(dense(x, self.weight))
        return out if self.bias is None else out.add_(self.bias)


class _FusedColumnLinear(ColumnParallelLinear):
    """Output rows split into named parts, each sharded across ranks on its
    own. parts: shard_id -> (size, start, local_size): the part's rows in the
    checkpoint, and this rank's local_size of them from row `start` on; the
    rank's weight holds its slices of the parts one after the other."""

    def __init__(self, input_size: int, parts: dict, bias: bool, dtype: torch.dtype | None):
        self.parts = parts
        self.local_offsets, offset = {}, 0
        for shard_id, (_, _, local_size) in parts.items():
            self.local_offsets[shard_id], offset = offset, offset + local_size
        super().__init__(input_size, sum(size for size, _, _ in parts.values()), bias, dtype)
        for param in (self.weight, self.bias):
            if param is not None:
                param.shard_ids = tuple(parts)

    def local_output_size(self, output_size: int, tp_size: int) -> int:
        return sum(local_size for _, _, local_size in self.parts.values())

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:  # a checkpoint that is already fused (or dummy weights): part by part
            check_shape(param.full_shape, loaded_weight)
            offset = 0
            for part, (size, _, _) in self.parts.items():
                self.weight_loader(param, loaded_weight.narrow(0, offset, size), part)
                offset += size
            return
        if shard_id not in self.parts:
            raise ValueError(f"unknown shard {shard_id!r}; this layer has {list(self.parts)}")
        size, start, local_size = self.parts[shard_id]
        check_shape((size, *param.full_shape[1:]), loaded_weight)
        default_weight_loader(
            param.narrow(0, self.local_offsets[shard_id], local_size), loaded_weight.narrow(0, start, local_size)
        )


class MergedColumnParallelLinear(_FusedColumnLinear):
    """Several projections of one input, e.g. an MLP's gate and up (shard ids
    0, 1, ... in the order of output_sizes); each rank holds its slice of
    every one, so [gate | up] stays the local layout."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, dtype: torch.dtype | None = None):
        tp_rank, tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        parts = {}
        for i, size in enumerate(output_sizes):
            local_size = divide(size, tp_size)
            parts[i] = (size, tp_rank * local_size, local_size)
        super().__init__(input_size, parts, bias, dtype)


class QKVParallelLinear(_FusedColumnLinear):
    """q, k and v projections in one matmul; output [T, (H + 2 * Hkv) * head_size]
    with q first, then k, then v (shard ids "q", "k", "v"), where H and Hkv are
    this rank's num_heads = total_num_heads / tp and num_kv_heads =
    max(1, total_num_kv_heads / tp). With fewer KV heads than ranks each KV
    head is replicated: rank r holds KV head r * total_num_kv_heads // tp, the
    one its query heads attend with."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ):
        tp_rank, tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.num_heads = divide(total_num_heads, tp_size)
        self.num_kv_heads = num_kv_heads_per_rank(total_num_kv_heads, tp_size)
        self.head_size = head_size
        self.q_size, self.kv_size = self.num_heads * head_size, self.num_kv_heads * head_size
        q, kv = total_num_heads * head_size, total_num_kv_heads * head_size
        kv_start = tp_rank * total_num_kv_heads // tp_size * head_size
        parts = {
            "q": (q, tp_rank * self.q_size, self.q_size),
            "k": (kv, kv_start, self.kv_size),
            "v": (kv, kv_start, self.kv_size),
        }
        super().__init__(hidden_size, parts, bias, dtype)
