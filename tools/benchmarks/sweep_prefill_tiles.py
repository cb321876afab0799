#!/usr/bin/env python3
"""Tile sizes of the Triton prefill attention (triton_attention._tile_config)
swept on a GPU: each candidate's time on the 16-bit cases of
bench_prefill_attention.py, beside the configuration in use and SDPA's flash
kernel, to choose _tile_config's values from measurements.

  PYTHONPATH=python python tools/benchmarks/sweep_prefill_tiles.py [--output-json sweep.json]
"""

import argparse
import itertools
import json

import torch
from bench_ops import median_ms
from bench_prefill_attention import CASES, paged_batch

from pagoda.model_executor.layers import triton_attention

CANDIDATES = [
    dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
    for m, n, w, s in itertools.product([64, 128], [32, 64, 128], [4, 8], [2, 3, 4])
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    in_use = triton_attention._tile_config
    batches = [(case, paged_batch(*case[1:])) for case in CASES if case[3] <= 128]
    results = {}
    for config in [None] + CANDIDATES:
        triton_attention._tile_config = in_use if config is None else (lambda *_, c=config: dict(c))
        name = "in use" if config is None else " ".join(f"{k}={v}" for k, v in config.items())
        times = []
        for case, batch in batches:
            out = torch.empty_like(batch["query"])
            try:
                times.append(median_ms(lambda: triton_attention.paged_prefill_attention(**batch, out=out), iters=20))
            except Exception as e:  # a tile that does not fit shared memory or registers
                times.append(float("nan"))
                name += f" ({type(e).__name__})"
        results[name] = times
        print(f"{name:<48}" + "".join(f"{t:>9.3f}" for t in times), flush=True)
    triton_attention._tile_config = in_use
    sdpa = []
    for case, batch in batches:
        _, heads, _, head_size, seq_lens, q_lens = case
        if seq_lens != q_lens:
            sdpa.append(float("nan"))
            continue
        q = torch.randn(len(q_lens), heads, q_lens[0], head_size, device="cuda", dtype=torch.bfloat16)
        k, v = torch.randn_like(q), torch.randn_like(q)
        sdpa.append(median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)))
    print(f"{'SDPA (flash)':<48}" + "".join(f"{t:>9.3f}" for t in sdpa))
    print("cases:", [case[0] for case, _ in batches])
    finite = {k: v for k, v in results.items() if all(t == t for t in v)}
    best = min(finite, key=lambda k: sum(t / r for t, r in zip(finite[k], results["in use"])))
    print("best (smallest sum of time ratios to the one in use):", best, finite[best])
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(dict(cases=[case[0] for case, _ in batches], results=results, sdpa=sdpa), f, indent=1)


if __name__ == "__main__":
    main()
