#!/usr/bin/env python3
"""Bandwidth of the torch.ops.pagoda.* element-wise kernels on a GPU.

For each op: time per call (CUDA events, median of many), the bytes it must move
(each input read once, each output written once), the achieved bandwidth as a
fraction of a device-to-device copy measured in the same run, and the same op
written in eager torch (the pure-torch reference in pagoda.ops) for a ratio.

  PYTHONPATH=python python tools/benchmarks/bench_ops.py [--tokens 16384] [--output-json out.json]
"""

import argparse
import json

import torch

from pagoda import ops


def median_ms(fn, iters: int = 50, back_to_back: int = 1) -> float:
    """Median ms per call. back_to_back > 1 times that many calls between two
    events, so a call's host-side launch cost hides behind the previous
    call's GPU work (the GPU's time, as in a busy engine)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(back_to_back):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / back_to_back)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    t, dt, dev = args.tokens, torch.bfloat16, "cuda"
    hidden, inter, heads, kv_heads, head = 4096, 14336, 32, 8, 128  # Llama-3.1-8B shapes
    el = torch.tensor([], dtype=dt).element_size()

    src = torch.randn(256 * 2**20, device=dev)
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src))
    copy_bw = 2 * src.numel() * 4 / copy_ms / 1e9  # TB/s: bytes read + written

    x = torch.randn(t, hidden, device=dev, dtype=dt)
    res = torch.randn_like(x)
    w = torch.randn(hidden, device=dev, dtype=dt)
    gate_up = torch.randn(t, 2 * inter, device=dev, dtype=dt)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head, device=dev, dtype=dt)
    q, k, _ = qkv.split([heads * head, kv_heads * head, kv_heads * head], dim=-1)
    pos = torch.randint(0, 8192, (t,), device=dev)
    cache = ops.rotary_cos_sin_cache(head, 8192).to(dev)
    out = torch.empty_like(x)
    act = torch.empty(t, inter, device=dev, dtype=dt)

    cases = [
        ("rms_norm", 3 * t * hidden * el, lambda: ops.rms_norm(x, w, 1e-6, out=out), lambda: ops.rms_norm_reference(x, w, 1e-6)),
        ("fused_add_rms_norm", 4 * t * hidden * el, lambda: ops.fused_add_rms_norm(x, res, w, 1e-6),
         lambda: ops.fused_add_rms_norm_reference(x, res, w, 1e-6)),
        ("silu_and_mul", 3 * t * inter * el, lambda: ops.silu_and_mul(gate_up, out=act), lambda: ops.silu_and_mul_reference(gate_up)),
        ("rotary_embedding", 2 * t * (heads + kv_heads) * head * el + t * 8, lambda: ops.rotary_embedding(pos, q, k, head, cache, True),
         lambda: ops.rotary_embedding_reference(pos, q, k, head, cache, True)),
    ]
    rows = []
    for name, nbytes, kernel, reference in cases:
        ms, ref_ms = median_ms(kernel), median_ms(reference)
        bw = nbytes / ms / 1e9
        rows.append(dict(op=name, tokens=t, us=ms * 1e3, tb_per_s=bw, fraction_of_copy=bw / copy_bw,
                         eager_torch_us=ref_ms * 1e3, speedup_vs_eager=ref_ms / ms))
    print(f"{torch.cuda.get_device_name()}  copy bandwidth {copy_bw:.2f} TB/s  bf16  tokens={t}")
    print(f"{'op':<20}{'us':>10}{'TB/s':>8}{'of copy':>9}{'eager us':>10}{'speedup':>9}")
    for r in rows:
        print(f"{r['op']:<20}{r['us']:>10.1f}{r['tb_per_s']:>8.2f}{r['fraction_of_copy']:>9.0%}{r['eager_torch_us']:>10.1f}{r['speedup_vs_eager']:>8.1f}x")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), copy_tb_per_s=copy_bw, results=rows), f, indent=1)


if __name__ == "__main__":
    main()
