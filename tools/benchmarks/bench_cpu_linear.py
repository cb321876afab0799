#!/usr/bin/env python3
"""torch.nn.functional.linear vs pagoda's CPU linear kernel (ops.linear) for the
decode-sized products of SmolLM2 (few rows M).

Each timed call uses the next of several weight copies whose total size is
above the last-level cache, so every call streams its weight from memory as a
decode step does (one pass over all layers' weights). A measurement is the
fastest of --reps calls; --runs repeats every measurement, the variants
alternating (torch, then each CPU kernel build of --isas), and the median of
the runs is reported: time per call, the weight streaming rate (GB/s) and
GFLOP/s of each, and the speedup of each build over the first column.

  PYTHONPATH=python python tools/benchmarks/bench_cpu_linear.py [--ms 1 16 64] [--dtype float32] [--threads 1]
      [--isas avx512 avx512_bf16] [--runs 3]
"""

import argparse
import statistics
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
    parser.add_argument("--runs", type=int, default=1, help="median of this many alternating measurements")
    parser.add_argument("--isas", nargs="+", default=[""], help="CPU kernel builds to compare (default: the best)")
    parser.add_argument("--threads", type=int, default=0, help="torch/OpenMP threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    isas = []
    for isa in args.isas:
        ops._C.select_cpu_isa(isa)
        isas.append(ops._C.cpu_isa())
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, "
          f"median of {args.runs} runs of the best of {args.reps} calls")
    columns = ["torch"] + isas
    print(f"{'M':>3} {'K':>5} {'N':>6} | " + " | ".join(f"{c + ' ms':>16} {'GB/s':>6} {'GF/s':>6}" for c in columns)
          + " | " + " ".join(f"{c + '/' + columns[0]:>12}" for c in columns[1:]))
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    for k, n in SHAPES:
        weight_bytes = n * k * dtype.itemsize
        copies = max(2, int(args.cache_mb * 2**20 / weight_bytes) + 1)
        weights = [torch.randn(n, k, dtype=dtype) for _ in range(copies)]
        for m in args.ms:
            x = torch.randn(m, k, dtype=dtype)
            out = torch.empty(m, n, dtype=dtype)
            runs = {c: [] for c in columns}
            for _ in range(args.runs):
                runs["torch"].append(best_seconds(lambda w: torch.nn.functional.linear(x, w), weights, args.reps, clock))
                for isa in isas:
                    ops._C.select_cpu_isa(isa)
                    runs[isa].append(best_seconds(lambda w: ops.linear(x, w, out=out), weights, args.reps, clock))
            seconds = {c: statistics.median(t) for c, t in runs.items()}
            flops = 2 * m * n * k

            def rates(s):
                return f"{s * 1e3:16.3f} {weight_bytes / s / 1e9:6.1f} {flops / s / 1e9:6.1f}"

            print(f"{m:>3} {k:>5} {n:>6} | " + " | ".join(rates(seconds[c]) for c in columns) + " | "
                  + " ".join(f"{seconds[columns[0]] / seconds[c]:11.2f}x" for c in columns[1:]))
        del weights


if __name__ == "__main__":
    main()
