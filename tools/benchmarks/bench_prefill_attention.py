#!/usr/bin/env python3
"""Speed of the prefill/extend attention over the paged KV cache on a GPU:
the flash path the layer takes for fp16/bf16 (flash_prefill.py: torch's
varlen flash kernel on the new tokens' K/V, or on K/V gathered from the pages
when there is a prefix, the gather timed with it) and the Triton kernel,
beside torch SDPA (FlashAttention on contiguous K/V, no paging) on the same
causal work.

For each case: time per call (CUDA events around 10 calls back to back,
median), the attention FLOPs
actually needed (4 x head_size per visible query-key pair per head, causal),
TFLOP/s, and SDPA's time where the case is a plain causal prefill (SDPA's
is_causal cannot express new tokens over a cached prefix).

  PYTHONPATH=python python tools/benchmarks/bench_prefill_attention.py [--output-json out.json]
"""

import argparse
import json
import math

import torch
import torch.nn.attention
from bench_ops import median_ms

from pagoda.forward_context import PrefillMetadata
from pagoda.model_executor.layers import flash_prefill, triton_attention
from pagoda.model_executor.layers.triton_attention import paged_prefill_attention
from pagoda.worker.input_buffers import context_slots

# Calls timed between two events: each kernel's GPU time, without the gaps
# its host-side launch leaves when the GPU waits for it.
BACK_TO_BACK = 10
SDPA_BACKENDS = [torch.nn.attention.SDPBackend.FLASH_ATTENTION, torch.nn.attention.SDPBackend.CUDNN_ATTENTION,
                 torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION]
# (name, q heads, kv heads, head size, context lengths, new tokens)
CASES = [
    ("llama3-8b 4x2048 prefill", 32, 8, 128, [2048] * 4, [2048] * 4),
    ("llama3-8b 16x512 prefill", 32, 8, 128, [512] * 16, [512] * 16),
    ("llama3-8b 512 new over 8k", 32, 8, 128, [8192], [512]),
    ("qwen3-0.6b 8x1024 prefill", 16, 8, 128, [1024] * 8, [1024] * 8),
    ("smollm2 8x1024 prefill", 9, 3, 64, [1024] * 8, [1024] * 8),
]


def paged_batch(num_heads, num_kv_heads, head_size, seq_lens, q_lens, block_size=16, dtype=torch.bfloat16):
    blocks = [-(-n // block_size) for n in seq_lens]
    key_cache = torch.randn(sum(blocks), block_size, num_kv_heads, head_size, device="cuda", dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    ids = torch.randperm(sum(blocks), device="cuda").int()
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device="cuda")
    first = 0
    for s, n in enumerate(blocks):
        tables[s, :n] = ids[first : first + n]
        first += n
    starts = torch.tensor([0] + q_lens, device="cuda").cumsum(0).int()
    return dict(
        query=torch.randn(sum(q_lens), num_heads, head_size, device="cuda", dtype=dtype),
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        query_start_loc=starts,
        scale=1 / math.sqrt(head_size),
        max_query_len=max(q_lens),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    rows = []
    for name, heads, kv_heads, head_size, seq_lens, q_lens in CASES:
        batch = paged_batch(heads, kv_heads, head_size, seq_lens, q_lens)
        out = torch.empty_like(batch["query"])
        ms = median_ms(lambda: paged_prefill_attention(**batch, out=out), back_to_back=BACK_TO_BACK)
        pairs = sum(q * (s - q) + q * (q + 1) // 2 for s, q in zip(seq_lens, q_lens))
        flops = 4 * head_size * heads * pairs
        flash_inputs = flash_args(batch, kv_heads, seq_lens, q_lens)
        flash_ms = median_ms(lambda: flash_prefill.prefill_attention(*flash_inputs), back_to_back=BACK_TO_BACK)
        row = dict(case=name, ms=ms, tflops=flops / ms / 1e9, flash_ms=flash_ms, flash_tflops=flops / flash_ms / 1e9,
                   sdpa_ms=None)
        if seq_lens == q_lens and len(set(q_lens)) == 1:
            shape = (len(q_lens), heads, q_lens[0], head_size)
            q = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
            k, v = torch.randn_like(q), torch.randn_like(q)  # K/V heads already expanded for GQA
            sdpa = torch.nn.functional.scaled_dot_product_attention
            row["sdpa_ms"] = median_ms(lambda: sdpa(q, k, v, is_causal=True), back_to_back=BACK_TO_BACK)
            for backend in SDPA_BACKENDS:  # each of SDPA's kernels, where it takes the case
                with torch.nn.attention.sdpa_kernel(backend):
                    try:
                        row[f"sdpa_{backend.name.lower()}_ms"] = median_ms(lambda: sdpa(q, k, v, is_causal=True),
                                                                             back_to_back=BACK_TO_BACK)
                    except RuntimeError:
                        row[f"sdpa_{backend.name.lower()}_ms"] = None
        rows.append(row)
    print(f"{torch.cuda.get_device_name()}  bf16, block size 16")
    print(f"{'case':<28}{'flash path ms':>14}{'TFLOP/s':>8}{'Triton ms':>10}{'TFLOP/s':>8}"
          f"{'SDPA flash':>11}{'SDPA cuDNN':>11}{'flash path / SDPA flash':>25}")
    for r in rows:
        line = f"{r['case']:<28}{r['flash_ms']:>14.3f}{r['flash_tflops']:>8.0f}{r['ms']:>10.3f}{r['tflops']:>8.0f}"
        flash, cudnn = r.get("sdpa_flash_attention_ms"), r.get("sdpa_cudnn_attention_ms")
        if flash and cudnn:
            line += f"{flash:>11.3f}{cudnn:>11.3f}{flash / r['flash_ms']:>24.2f}x"
        print(line)
    print("MMA instructions in the compiled variants:", mma_kinds())
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), results=rows, mma=mma_kinds()), f, indent=1)


def flash_args(batch, num_kv_heads, seq_lens, q_lens):
    """flash_prefill.prefill_attention's arguments for the batch: the new
    tokens' own K/V when there is no prefix, else the pages gathered."""
    query, key_cache = batch["query"], batch["key_cache"]
    num_tokens, head_size = query.shape[0], query.shape[2]
    key = torch.randn(num_tokens, num_kv_heads, head_size, device="cuda", dtype=query.dtype)
    query_start_loc = batch["query_start_loc"]
    if seq_lens == q_lens:
        prefill = PrefillMetadata(query_start_loc, query_start_loc, max(q_lens), max(seq_lens), None)
    else:
        seq_start_loc = torch.tensor([0, *seq_lens], device="cuda").cumsum(0).int()
        slots = context_slots(batch["block_tables"], seq_start_loc, sum(seq_lens), key_cache.shape[1])
        prefill = PrefillMetadata(query_start_loc, seq_start_loc, max(q_lens), max(seq_lens), slots)
    return query, key, torch.randn_like(key), key_cache, batch["value_cache"], prefill, batch["scale"]


def mma_kinds() -> dict[str, int]:
    """How many compiled variants of the kernel use wgmma (Hopper's warpgroup
    MMA) or only mma.sync, read from their PTX (Triton's kernel cache layout:
    device -> (kernels by key, ...))."""
    kinds = {"wgmma": 0, "mma.sync only": 0, "neither": 0}
    for cache in triton_attention._paged_prefill_kernel.device_caches.values():
        for kernel in cache[0].values():
            ptx = kernel.asm.get("ptx", "")
            kinds["wgmma" if "wgmma" in ptx else "mma.sync only" if "mma.sync" in ptx else "neither"] += 1
    return kinds


if __name__ == "__main__":
    main()
