#!/usr/bin/env python3
"""torch.nn.functional.linear vs pagoda's CPU linear kernel (ops.linear) for the
decode-sized products of SmolLM2 (few rows M, fp32 weights).

Each timed call uses the next of several weight copies whose total size is
above the last-level cache, so every call streams its weight from memory as a
decode step does (one pass over all layers' weights). Reports the median time
per call (the best of --reps), the weight streaming rate (GB/s) and GFLOP/s of both, and the speedup.

  PYTHONPATH=python python tools/benchmarks/bench_cpu_linear.py [--ms 1 16 64] [--dtype float32] [--threads 1]
"""

import argparse
import time

import torch

from pagoda import ops

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]  # (K, N)


def best_seconds(fn, weights, reps: int, clock=time.perf_counter) -> float:
    for w in weights[:2]:
        fn(w)
    times = []
    for i in range(reps):
        w = weights[i % len(weights)]
        start = clock()
        fn(w)
        times.append(clock() - start)
    # The fastest call: on a shared machine the slower ones mostly measure the
    # other processes (an OpenMP barrier waits out a whole time slice). With
    # one thread the clock is the thread's CPU time, which preemption by
    # other processes does not inflate.
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--cache-mb", type=float, default=64.0, help="weight copies total at least this much")
    parser.add_argument("--reps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=0, help="torch/OpenMP threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, pagoda ISA {ops._C.cpu_isa()}, {args.dtype}")
    print(f"{'M':>3} {'K':>5} {'N':>6} | {'torch ms':>9} {'GB/s':>6} {'GF/s':>6} | "
          f"{'pagoda ms':>9} {'GB/s':>6} {'GF/s':>6} | {'speedup':>7}")
    for k, n in SHAPES:
        weight_bytes = n * k * dtype.itemsize
        copies = max(2, int(args.cache_mb * 2**20 / weight_bytes) + 1)
        weights = [torch.randn(n, k, dtype=dtype) for _ in range(copies)]
        for m in args.ms:
            x = torch.randn(m, k, dtype=dtype)
            out = torch.empty(m, n, dtype=dtype)
            clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
            torch_s = best_seconds(lambda w: torch.nn.functional.linear(x, w), weights, args.reps, clock)
            pagoda_s = best_seconds(lambda w: ops.linear(x, w, out=out), weights, args.reps, clock)
            flops = 2 * m * n * k

            def rates(s):
                return f"{s * 1e3:9.3f} {weight_bytes / s / 1e9:6.1f} {flops / s / 1e9:6.1f}"

            print(f"{m:>3} {k:>5} {n:>6} | {rates(torch_s)} | {rates(pagoda_s)} | {torch_s / pagoda_s:6.2f}x")
        del weights


if __name__ == "__main__":
    main()
