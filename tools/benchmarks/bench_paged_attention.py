#!/usr/bin/env python3
"""Paged decode attention on a GPU against the memory-bandwidth limit.

Measures, in one run: the device-to-device copy bandwidth (bytes read +
written), then torch.ops.pagoda.paged_attention decoding one token per
sequence at (batch 64, context 1024), (batch 16, context 4096) and (batch 1,
context 65536) with Llama-3.1-8B and Qwen3-0.6B attention shapes, bf16,
block size 16, the cache blocks scattered at random. Bytes moved = K and V
read once + q read + out written; the achieved bytes/s is reported as a
fraction of the copy bandwidth, beside torch SDPA (dense K/V of the same
shapes, q_len 1, is_causal=False, enable_gqa) and flex attention (when it
compiles here), and the same cache in float8 e4m3 (--kv-cache-dtype fp8:
half the K/V bytes, its speed-up over bf16). Each timed call reads a different copy of the K/V data, so
nothing is served from L2.

  python3 tools/build_ext.py && \\
  PYTHONPATH=python python3 tools/benchmarks/bench_paged_attention.py [--output-json out.json]
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F

from pagoda import ops

# (name, query heads, kv heads, head size): config.json values.
MODELS = [("Llama-3.1-8B", 32, 8, 128), ("Qwen3-0.6B", 16, 8, 128)]
CASES = [(64, 1024), (16, 4096), (1, 65536)]  # (batch, context)
BLOCK_SIZE = 16
DTYPE = torch.bfloat16
# Copies of the K/V data cycled through, so that consecutive calls never find
# the previous call's data in L2 (50 MB on the H200).
COPIES = 3


def time_per_call_ms(fns, calls: int = 10, repeats: int = 15) -> float:
    """Median over `repeats` of the mean time of `calls` back-to-back calls,
    cycling through `fns` (CUDA events)."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(calls):
            fns[i % len(fns)]()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def copy_bandwidth() -> float:
    """Bytes/s of a large device-to-device copy (read + write)."""
    src = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda").random_()
    dsts = [torch.empty_like(src) for _ in range(2)]
    ms = time_per_call_ms([lambda d=d: d.copy_(src) for d in dsts])
    return 2 * src.numel() / (ms * 1e-3)


def make_case(batch, context, num_heads, num_kv_heads, head_size, generator):
    """Dense K/V [batch, kv_heads, context, head_size] and the same data in a
    paged cache whose blocks are scattered."""
    k = torch.randn(batch, context, num_kv_heads, head_size, dtype=DTYPE, device="cuda", generator=generator)
    v = torch.randn_like(k)
    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq
    ids = torch.randperm(num_blocks, device="cuda", generator=generator)
    paged = []
    for dense in (k, v):
        cache = torch.empty(num_blocks, BLOCK_SIZE, num_kv_heads, head_size, dtype=DTYPE, device="cuda")
        cache[ids] = dense.view(num_blocks, BLOCK_SIZE, num_kv_heads, head_size)
        paged.append(cache)
    return dict(
        query=torch.randn(batch, num_heads, head_size, dtype=DTYPE, device="cuda", generator=generator),
        key_cache=paged[0],
        value_cache=paged[1],
        block_tables=ids.int().view(batch, blocks_per_seq),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device="cuda"),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
        scale=1 / math.sqrt(head_size),
    ), (k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous())


def flex_decode():
    """flex_attention compiled once, or None where it is missing."""
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:
        return None
    return torch.compile(flex_attention, dynamic=False)


def bench_case(model, batch, context, copy_bps, flex):
    name, num_heads, num_kv_heads, head_size = model
    generator = torch.Generator(device="cuda").manual_seed(0)
    copies = [make_case(batch, context, num_heads, num_kv_heads, head_size, generator) for _ in range(COPIES)]
    kv_bytes = 2 * batch * context * num_kv_heads * head_size * DTYPE.itemsize
    nbytes = kv_bytes + 2 * batch * num_heads * head_size * DTYPE.itemsize
    row = dict(model=name, heads=num_heads, kv_heads=num_kv_heads, head_size=head_size, batch=batch,
               context=context, dtype="bfloat16", block_size=BLOCK_SIZE, bytes=nbytes)

    outs = [torch.empty_like(paged["query"]) for paged, _ in copies]
    ms = time_per_call_ms([lambda p=p, o=o: ops.paged_attention(**p, out=o) for (p, _), o in zip(copies, outs)])
    row.update(pagoda_us=ms * 1e3, pagoda_tb_per_s=nbytes / ms / 1e9, pagoda_of_copy=nbytes / (ms * 1e-3) / copy_bps)

    # The same cache in float8 e4m3 (--kv-cache-dtype fp8): half the K/V bytes.
    fp8 = [dict(p, key_cache=p["key_cache"].to(torch.float8_e4m3fn), value_cache=p["value_cache"].to(torch.float8_e4m3fn))
           for p, _ in copies]
    fp8_bytes = kv_bytes // 2 + 2 * batch * num_heads * head_size * DTYPE.itemsize
    ms_fp8 = time_per_call_ms([lambda p=p, o=o: ops.paged_attention(**p, out=o) for p, o in zip(fp8, outs)])
    row.update(fp8_us=ms_fp8 * 1e3, fp8_of_copy=fp8_bytes / (ms_fp8 * 1e-3) / copy_bps, fp8_speedup=ms / ms_fp8)
    del fp8

    # The same data, dense: q [batch, heads, 1, head_size].
    dense = [(p["query"].unsqueeze(2), k, v) for p, (k, v) in copies]
    scale = copies[0][0]["scale"]
    sdpa = [lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
            for q, k, v in dense]
    want = sdpa[0]().squeeze(2)
    row["max_abs_diff_vs_sdpa"] = (outs[0].float() - want.float()).abs().max().item()
    ms = time_per_call_ms(sdpa)
    row.update(sdpa_us=ms * 1e3, sdpa_of_copy=nbytes / (ms * 1e-3) / copy_bps)

    if flex is not None:
        try:
            calls = [lambda q=q, k=k, v=v: flex(q, k, v, scale=scale, enable_gqa=True) for q, k, v in dense]
            ms = time_per_call_ms(calls)
            row.update(flex_us=ms * 1e3, flex_of_copy=nbytes / (ms * 1e-3) / copy_bps)
        except Exception as error:  # noqa: BLE001 -- report why, keep the other numbers
            row["flex_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    del copies, dense, outs
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-json", default=None, help="write the results here")
    parser.add_argument("--no-flex", action="store_true", help="skip flex attention (its compile takes a while)")
    args = parser.parse_args()

    copy_bps = copy_bandwidth()
    flex = None if args.no_flex else flex_decode()
    rows = [bench_case(model, batch, context, copy_bps, flex) for model in MODELS for batch, context in CASES]

    device = torch.cuda.get_device_name()
    print(f"{device}, torch {torch.__version__}: copy {copy_bps / 1e12:.2f} TB/s (read + write); "
          f"paged decode attention, bf16, block {BLOCK_SIZE}; bytes = K + V + q + out")
    print(f"{'model':<14}{'batch':>6}{'ctx':>7}{'MB':>7}{'pagoda us':>11}{'TB/s':>7}{'of copy':>9}"
          f"{'fp8 us':>9}{'of copy':>9}{'x bf16':>8}{'sdpa us':>10}{'of copy':>9}{'flex us':>10}{'of copy':>9}"
          f"{'max diff':>10}")
    for r in rows:
        flex_us = f"{r['flex_us']:>10.1f}{r['flex_of_copy']:>9.0%}" if "flex_us" in r else f"{'-':>10}{'-':>9}"
        print(f"{r['model']:<14}{r['batch']:>6}{r['context']:>7}{r['bytes'] / 1e6:>7.0f}{r['pagoda_us']:>11.1f}"
              f"{r['pagoda_tb_per_s']:>7.2f}{r['pagoda_of_copy']:>9.0%}{r['fp8_us']:>9.1f}{r['fp8_of_copy']:>9.0%}"
              f"{r['fp8_speedup']:>7.2f}x{r['sdpa_us']:>10.1f}{r['sdpa_of_copy']:>9.0%}"
              f"{flex_us}{r['max_abs_diff_vs_sdpa']:>10.2e}")
    errors = {r.get("flex_error") for r in rows} - {None}
    for error in errors:
        print(f"flex attention failed: {error}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(dict(device=device, torch=torch.__version__, copy_tb_per_s=copy_bps / 1e12, results=rows), f,
                      indent=1)


if __name__ == "__main__":
    main()
