#!/usr/bin/env python3
"""The CPU paged decode attention of a whole decode step: --layers layers of
--batch sequences decoding one token over --context cached keys each, the
cache's blocks in random order (as a running engine's blocks end up), in
microseconds per layer:

- cold: the layers' K/V evicted from the caches first (a 64 MB write), as in
  a step, where every layer's weights pass through the caches between one
  step's attention of a layer and the next;
- second pass: all layers again right after (their K/V too large for L3
  together at the default shapes, so mostly cold as well);
- hot: one layer repeated, its K/V in L2.

The defaults are SmolLM2-135M's attention at batch 16 after a 128-token
prompt: 9 query heads, 3 kv heads of 64, a bf16 cache under fp32 queries (as
`--quantization int8` runs it). Medians of --iters passes.

  PYTHONPATH=python python tools/benchmarks/bench_cpu_attention.py [--batch 16] [--context 160] [--threads 2]
"""

import argparse
import statistics
import time

import torch

from pagoda import ops


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=160, help="cached keys per sequence")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--num-heads", type=int, default=9)
    parser.add_argument("--num-kv-heads", type=int, default=3)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--threads", type=int, default=0, help="torch/OpenMP threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kv_dtype = getattr(torch, args.kv_dtype)
    g = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-args.context // args.block_size)
    num_blocks = args.batch * blocks_per_seq
    shape = (num_blocks, args.block_size, args.num_kv_heads, args.head_size)
    layers = []
    for _ in range(args.layers):
        layers.append(dict(
            query=torch.randn(args.batch, args.num_heads, args.head_size, generator=g),
            key_cache=torch.randn(shape, generator=g).to(kv_dtype),
            value_cache=torch.randn(shape, generator=g).to(kv_dtype),
            block_tables=torch.randperm(num_blocks, generator=g).int().view(args.batch, blocks_per_seq),
            seq_lens=torch.full((args.batch,), args.context, dtype=torch.int32),
            query_start_loc=torch.arange(args.batch + 1, dtype=torch.int32),
            scale=args.head_size ** -0.5))
    outs = [torch.empty(args.batch, args.num_heads, args.head_size) for _ in layers]
    flush = torch.empty(64 << 20, dtype=torch.uint8)

    def per_layer_us() -> float:
        start = time.perf_counter()
        for p, o in zip(layers, outs):
            ops.paged_attention(**p, out=o)
        return (time.perf_counter() - start) / len(layers) * 1e6

    cold, second = [], []
    for _ in range(args.iters):
        flush.add_(1)
        cold.append(per_layer_us())
        second.append(per_layer_us())
    hot = []
    for _ in range(5 * args.iters):
        start = time.perf_counter()
        ops.paged_attention(**layers[0], out=outs[0])
        hot.append((time.perf_counter() - start) * 1e6)
    kv_mb = 2 * layers[0]["key_cache"].nbytes / 2**20
    print(f"{args.layers} layers, batch {args.batch} x {args.context} keys, {args.num_heads}/{args.num_kv_heads} heads "
          f"of {args.head_size}, {args.kv_dtype} cache ({kv_mb:.1f} MB of K/V a layer), "
          f"{torch.get_num_threads()} threads, us a layer (medians of {args.iters}):")
    print(f"  cold {statistics.median(cold):.1f}, second pass {statistics.median(second):.1f}, "
          f"hot {statistics.median(hot):.1f}")


if __name__ == "__main__":
    main()
