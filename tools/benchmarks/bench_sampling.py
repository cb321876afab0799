#!/usr/bin/env python3
"""Speed of GPU sampling (ops.sample, one kernel, no vocabulary sort) beside
the sampler's torch path run on the same CUDA logits (a full sort for
top_k/top_p, the race's Philox noise in torch ops: ops.gumbel_argmax_reference;
before 2026-12-03 the torch path drew its noise with exponential_).

  PYTHONPATH=python python tools/benchmarks/bench_sampling.py [--vocab 151936] [--output-json out.json]
"""

import argparse
import json

import torch
from bench_ops import median_ms

from pagoda import ops
from pagoda.model_executor.layers.sampler import apply_min_p, apply_top_k_top_p

KNOBS = {
    "temperature": dict(),
    "top_k=50 top_p=0.9": dict(top_k=50, top_p=0.9),
    "top_p=0.95 min_p=0.05": dict(top_p=0.95, min_p=0.05),
}


def torch_path(logits, temperature, seeds, offsets, top_k, top_p, min_p):
    scaled = logits / temperature[:, None]
    if min_p is not None:
        apply_min_p(scaled, min_p)
    if top_k is not None or top_p is not None:
        apply_top_k_top_p(scaled, top_k, top_p)
    return ops.gumbel_argmax_reference(scaled, seeds, offsets)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=151936)  # Qwen3
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    rows = []
    for batch in (1, 64, 256):
        logits = torch.randn(batch, args.vocab, device="cuda") * 3
        temperature = torch.full((batch,), 0.8, device="cuda")
        seeds = torch.arange(batch, device="cuda")
        offsets = torch.zeros(batch, dtype=torch.int64, device="cuda")
        for name, knobs in KNOBS.items():
            per_row = {
                k: torch.full((batch,), v, device="cuda", dtype=torch.int64 if k == "top_k" else torch.float32)
                for k, v in knobs.items()
            }
            filters = dict(top_k=per_row.get("top_k"), top_p=per_row.get("top_p"), min_p=per_row.get("min_p"))
            kernel_ms = median_ms(lambda: ops.sample(logits, temperature, seeds, offsets, **filters))
            torch_ms = median_ms(lambda: torch_path(logits, temperature, seeds, offsets, **filters))
            rows.append(dict(batch=batch, knobs=name, kernel_us=kernel_ms * 1e3, torch_us=torch_ms * 1e3))
    print(f"{torch.cuda.get_device_name()}  vocab {args.vocab}, fp32 logits")
    print(f"{'batch':>6}  {'knobs':<24}{'kernel us':>10}{'torch us':>10}{'speedup':>9}")
    for r in rows:
        print(f"{r['batch']:>6}  {r['knobs']:<24}{r['kernel_us']:>10.1f}{r['torch_us']:>10.1f}"
              f"{r['torch_us'] / r['kernel_us']:>8.1f}x")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), vocab=args.vocab, results=rows), f, indent=1)


if __name__ == "__main__":
    main()
