#!/usr/bin/env python3
"""The FP8 linear layer (--quantization fp8) against bf16 on a GPU, at
Llama-3.1-8B's and Qwen3-0.6B's linear shapes and batch sizes from decode to
prefill.

For each (layer, rows): median time per call of the bf16 GEMM (F.linear),
of the FP8 layer as the model runs it (per-token activation quantization +
fp8_triton.scaled_gemm: cuBLASLt's torch._scaled_mm with row-wise scales, or
the Triton kernel for few rows), of torch._scaled_mm alone on the same
quantized rows (as the layer calls it, fp8_triton.cublas_scaled_mm), and of
the quantization alone; TFLOP/s of each GEMM. Calls are timed as CUDA-graph
replays (CUDA events around a graph of one call per weight copy), as decode
steps run, so the host's launch time is left out. Weights rotate among
enough copies to exceed the L2 cache, so decode sizes read them from HBM as
a model does.

  PYTHONPATH=python python tools/benchmarks/bench_fp8_linear.py [--rows 64:1025:8] [--output-json out.json]

--rows takes a comma list and start:stop:step ranges (cuBLASLt's time
against rows is a sawtooth on the multiples of 128; docs/BENCHMARKS.md).
"""

import argparse
import json

import torch
import torch.nn.functional as F
from bench_ops import median_ms

from pagoda.model_executor.layers.fp8 import fp8_linear, quantize_rows, quantize_tokens
from pagoda.model_executor.layers.fp8_triton import cublas_scaled_mm

# (model, name, N, K)
LAYERS = [("Llama-3.1-8B", "qkv_proj", 6144, 4096), ("Llama-3.1-8B", "o_proj", 4096, 4096),
          ("Llama-3.1-8B", "gate_up_proj", 28672, 4096), ("Llama-3.1-8B", "down_proj", 4096, 14336),
          ("Qwen3-0.6B", "qkv_proj", 4096, 1024), ("Qwen3-0.6B", "o_proj", 1024, 2048),
          ("Qwen3-0.6B", "gate_up_proj", 6144, 1024), ("Qwen3-0.6B", "down_proj", 1024, 3072)]
ROWS = [1, 16, 32, 64, 128, 192, 256, 1024, 4096]
ROTATE_BYTES = 512 * 2**20


def graph_ms(calls) -> float:
    """Median time of one of `calls` (each run once per replay of a graph of all of them)."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return median_ms(graph.replay) / len(calls)


def row_counts(spec: str) -> list[int]:
    """"1,16,64:257:64" -> [1, 16, 64, 128, 192, 256]."""
    rows = []
    for part in spec.split(","):
        bounds = [int(v) for v in part.split(":")]
        rows += list(range(*bounds)) if len(bounds) > 1 else bounds
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=row_counts, default=ROWS, help="batch sizes (default: %(default)s)")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    results = []
    print(f"{'model':<14}{'layer':<13}{'rows':>6}{'bf16 ms':>10}{'fp8 ms':>10}{'cublas ms':>10}{'quant ms':>10}"
          f"{'bf16 TF/s':>11}{'fp8 TF/s':>10}{'speedup':>9}")
    for model, name, n, k in LAYERS:
        copies = max(1, -(-ROTATE_BYTES // (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        fp8 = [quantize_rows(w) for w in weights]
        fp8 = [(q, s.view(1, -1).contiguous()) for q, s in fp8]
        for rows in args.rows:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            bf16_ms = graph_ms([lambda w=w: F.linear(x, w) for w in weights])
            fp8_ms = graph_ms([lambda w=w: fp8_linear(x, *w) for w in fp8])
            q, scale = quantize_tokens(x)
            cublas_ms = graph_ms([lambda w=w: cublas_scaled_mm(q, scale, *w, x.dtype) for w in fp8])
            quant_ms = graph_ms([lambda: quantize_tokens(x)] * copies)
            flops = 2 * rows * n * k
            row = dict(model=model, layer=name, n=n, k=k, rows=rows, bf16_ms=bf16_ms, fp8_ms=fp8_ms,
                       scaled_mm_ms=cublas_ms, quantize_ms=quant_ms,
                       bf16_tflops=flops / bf16_ms / 1e9, fp8_tflops=flops / fp8_ms / 1e9)
            results.append(row)
            print(f"{model:<14}{name:<13}{rows:>6}{bf16_ms:>10.4f}{fp8_ms:>10.4f}{cublas_ms:>10.4f}{quant_ms:>10.4f}"
                  f"{row['bf16_tflops']:>11.1f}{row['fp8_tflops']:>10.1f}{bf16_ms / fp8_ms:>8.2f}x")
        del weights, fp8
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), results=results), f, indent=1)


if __name__ == "__main__":
    main()
