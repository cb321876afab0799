"""int8 weights and activations on the CPU (--quantization int8).

W8A8 in int8 for the CPU's integer dot products (AVX512_VNNI's vpdpbusd,
else AVX2's maddubs): each linear layer's weight (and the LM head's) is
requantized once at load, from the checkpoint's floats or a GGUF file's
blocks, to ops.Q8_0_GROUPED: Q8_0 blocks of 32 whose fp16 scale is shared by
a group of up to 8 blocks (256 values, as many as divide the row; llama.cpp
uses 256-value input blocks for its K-quants too). Each step's activations
are rounded to int8 per row and group by the kernel, d = max|x| / 127. A
group's products are summed in one integer accumulator, so the float work
per block (a conversion, a multiply, an FMA) is a sixth to an eighth of
gguf_int8's; and Q8_0's bytes multiply without gguf_int8's unpacking of
nibbles. Measured on Zen 4 (docs/BENCHMARKS.md): the products 1.03-1.2x
gguf_int8's on SmolLM2's shapes, a batch-16 run 11% faster than with plain
Q8_0 and inputs per 32. A weight takes 1.06 bytes (Q4_1: 0.625), which a
memory-bound batch-1 decode pays for.

Error: a weight is off by at most half its group's scale (max|w| / 254 over
up to 256 values, fp16-rounded); from a Q4_1 file that adds about a
sixteenth of the file's own rounding (max|w| / 30 per 32 values). The
activations' rounding (max|x| / 254 over a group rather than over 32 values)
is the larger part: tests/engine/test_smollm2.py bounds the greedy drift
against the fp32 reference.

A layer whose in_features is not a multiple of 32 keeps its weight in fp32.
The embedding lookup reads the table as it is (int8 too where the LM head
shares it).
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda import ops

FP16_MAX = torch.finfo(torch.float16).max


def quantize_q8_0_grouped(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (floats, K a multiple of 32) as Q8_0_GROUPED blocks, uint8
    [N, K / 32 * 34] in the file layout (ops.gguf_to_panels makes the panels):
    per group of ops.q8_0_group_blocks(K) blocks, d = max|w| / 127 rounded to
    fp16 and q = round(w / d) clamped to [-127, 127], d written into each
    block of the group. Raises ValueError for weights beyond fp16's scales."""
    rows, cols = weight.shape
    if cols % ops.GGUF_BLOCK:
        raise ValueError(f"in_features must be a multiple of {ops.GGUF_BLOCK} for int8 weights, got {cols}")
    group = ops.q8_0_group_blocks(cols)
    values = weight.float().reshape(rows, -1, ops.GGUF_BLOCK * group)
    amax = values.abs().amax(-1, keepdim=True)
    if not bool(torch.isfinite(amax).all()) or float(amax.max()) / 127 > FP16_MAX:
        raise ValueError(f"a weight of {float(amax.max()):g} is not finite or beyond int8 weights' fp16 scales "
                         f"({FP16_MAX * 127:g} at most)")
    scale = (amax / 127).half()
    q = torch.round(values / scale.float()).nan_to_num_(0).clamp_(-127, 127).to(torch.int8)  # 0 / 0: a zero group
    blocks = torch.empty(rows, cols // ops.GGUF_BLOCK, 34, dtype=torch.uint8)
    blocks[..., :2] = scale.view(torch.uint8).reshape(rows, -1, 1, 2).expand(-1, -1, group, -1).reshape(rows, -1, 2)
    blocks[..., 2:] = q.view(torch.uint8).reshape(rows, -1, ops.GGUF_BLOCK)
    return blocks.reshape(rows, -1)


def _float_weight(param: torch.Tensor) -> torch.Tensor:
    """A weight's values in fp32 [N, K]: GGUF blocks (the loader's packed
    weights) decoded by the CPU's kernel, a dense one as it is."""
    weight_type = getattr(param, "gguf_type", None)
    if weight_type is None:
        return param.data
    rows = torch.arange(param.shape[0])
    return ops.gguf_embedding(rows, param.data, weight_type, ops.gguf_in_features(param, weight_type))


def quantize_int8_weights(model: nn.Module) -> tuple[int, int]:
    """Requantizes the weight of every linear layer (LinearBase) and the LM
    head in place, one at a time (peak memory: the model plus one weight's
    fp32 temporaries), to Q8_0_GROUPED panels marked to multiply int8 inputs
    (gguf_type, gguf_quantize_input: dense() dispatches on them; a tied
    embedding looks its rows up in the panels). Returns (weights quantized,
    weights kept in fp32: in_features not a multiple of 32)."""
    from pagoda.model_executor.layers.linear import LinearBase
    from pagoda.model_executor.layers.vocab_embedding import ParallelLMHead

    quantized = kept = 0
    done = set()
    for module in model.modules():
        if not isinstance(module, (LinearBase, ParallelLMHead)) or id(module.weight) in done:
            continue
        param = module.weight
        done.add(id(param))
        values = _float_weight(param)
        if values.shape[1] % ops.GGUF_BLOCK:
            kept += 1
            continue
        param.data = ops.gguf_to_panels(quantize_q8_0_grouped(values), ops.Q8_0_GROUPED)
        param.gguf_type, param.gguf_quantize_input = ops.Q8_0_GROUPED, True
        quantized += 1
    return quantized, kept
