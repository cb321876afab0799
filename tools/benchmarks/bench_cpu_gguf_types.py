#!/usr/bin/env python3
"""gguf_linear per GGUF type on one random weight matrix (default
[11008, 4096], Llama-2-7B's gate_proj: larger than the L3 cache in every type),
against the same shape dequantized to fp32 and multiplied by torch (F.linear).
Prints the best and the median of --reps calls per row count, and the weight
bytes read per second at the best (packed bytes for the GGUF types, 4 bytes a
weight for fp32); types interleaved call by call so that load on the machine
hits them alike. --paths int8 adds each type's int8 path (the weight
repacked into panels, inputs rounded to int8 per 32), interleaved likewise.

  PYTHONPATH=python python tools/benchmarks/bench_cpu_gguf_types.py [--rows 1 16] [--types Q4_1 Q4_K Q6_K fp32] [--paths fp32 int8]
  (OMP_NUM_THREADS to pin threads, PAGODA_CPU_ISA to pick the kernel build)
"""

import argparse
import time

import torch
import torch.nn.functional as F

from pagoda import ops

GGML_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", type=int, nargs=2, default=[11008, 4096], metavar=("N", "K"))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--types", nargs="+", default=["Q4_1", "Q4_K", "Q6_K", "fp32"],
                        choices=[*GGML_TYPES, "fp32"])
    parser.add_argument("--paths", nargs="+", default=["fp32"], choices=["fp32", "int8"])
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    n, k = args.shape
    torch.manual_seed(0)
    weights = {name: ops.gguf_random_blocks(n, k, GGML_TYPES[name]) for name in args.types if name != "fp32"}
    dense = torch.randn(n, k) if "fp32" in args.types else None
    print(f"weight [{n}, {k}], {torch.get_num_threads()} threads, kernels {ops._C.cpu_isa()}")
    for rows in args.rows:
        x = torch.randn(rows, k)
        calls = {}
        for name, w in weights.items():
            t = GGML_TYPES[name]
            if "fp32" in args.paths:
                calls[name] = (lambda w=w, t=t: ops.gguf_linear(x, w, t), w.numel())
            if "int8" in args.paths:
                panels = ops.gguf_to_panels(w.clone(), t)
                calls[f"{name} int8"] = (lambda p=panels, t=t: ops.gguf_linear(x, p, t, quantize_input=True), w.numel())
        if dense is not None:
            calls["fp32"] = (lambda: F.linear(x, dense), dense.numel() * 4)
        times = {name: [] for name in calls}
        for call, _ in calls.values():
            call()
        for _ in range(args.reps):
            for name, (call, _) in calls.items():
                started = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - started)
        for name, t in times.items():
            t.sort()
            nbytes = calls[name][1]
            print(f"rows {rows:3d} {name:9s} ({nbytes / 1e6:6.1f} MB): best {t[0] * 1e3:7.2f} ms, "
                  f"median {t[len(t) // 2] * 1e3:7.2f} ms, {nbytes / t[0] / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
