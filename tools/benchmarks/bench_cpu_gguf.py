#!/usr/bin/env python3
"""One SmolLM2 decode step's linear layers (30 layers' qkv, o, gate_up and down,
and the tied 49152-row LM head) with the real GGUF weights, per path:
  packed fp32      ops.gguf_linear: blocks dequantized in registers, fp32 FMAs
  packed int8      ops.gguf_linear(quantize_input=True): llama.cpp's int8 blocks
  dequant + torch  each weight dequantized by the kernel (ops.gguf_embedding of
                   every row) then F.linear: the hand-over to torch for many rows
  fp32 dense       the weights dequantized once at load, the layers' dense()
Prints the best and the median of --reps steps per row count, paths
interleaved step by step so that load on the machine hits them alike.

  PYTHONPATH=python python tools/benchmarks/bench_cpu_gguf.py [--rows 1 16 128] [--paths ...]
  (OMP_NUM_THREADS to pin threads, PAGODA_CPU_ISA to pick the kernel build)
"""

import argparse
import time

import gguf
import torch
import torch.nn.functional as F

from pagoda import ops
from pagoda.entrypoints.default_model import default_model
from pagoda.model_executor.layers.linear import dense


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 128])
    parser.add_argument("--paths", nargs="+", default=["packed fp32", "packed int8", "dequant + torch", "fp32 dense"])
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    tensors = {t.name: t for t in gguf.GGUFReader(default_model()).tensors}

    def blocks(name: str) -> torch.Tensor:
        return torch.tensor(tensors[name].data)

    layers = []  # (packed weight, GGML type, in_features)
    for i in range(sum(name.endswith("attn_q.weight") for name in tensors)):
        qkv = torch.cat([blocks(f"blk.{i}.attn_{p}.weight") for p in "qkv"])
        gate_up = torch.cat([blocks(f"blk.{i}.ffn_gate.weight"), blocks(f"blk.{i}.ffn_up.weight")])
        hidden = tensors[f"blk.{i}.attn_q.weight"].shape[0]
        down_in = tensors[f"blk.{i}.ffn_down.weight"].shape[0]
        kind = int(tensors[f"blk.{i}.attn_q.weight"].tensor_type)
        layers += [(qkv, kind, hidden), (blocks(f"blk.{i}.attn_output.weight"), kind, hidden),
                   (gate_up, kind, hidden), (blocks(f"blk.{i}.ffn_down.weight"), kind, down_in)]
    layers.append((blocks("token_embd.weight"), int(tensors["token_embd.weight"].tensor_type), hidden))
    dequantized = [ops.gguf_dequantize_reference(w, kind) for w, kind, _ in layers]
    # The int8 path reads its weights in the panel layout the loader repacks them into.
    panels = [ops.gguf_to_panels(w.clone(), kind) if kind in ops.GGUF_INT8_TYPES else w for w, kind, _ in layers]
    print(f"packed {sum(w.numel() for w, _, _ in layers) / 1e6:.1f} MB, "
          f"fp32 {sum(w.numel() * 4 for w in dequantized) / 1e6:.1f} MB, {torch.get_num_threads()} threads, "
          f"kernels {ops._C.cpu_isa()}")
    for rows in args.rows:
        xs = [torch.randn(rows, k) for _, _, k in layers]
        paths = {
            "packed fp32": lambda: [ops.gguf_linear(x, w, kind) for x, (w, kind, _) in zip(xs, layers)],
            "packed int8": lambda: [ops.gguf_linear(x, p, kind, quantize_input=True)
                                    for x, p, (_, kind, _) in zip(xs, panels, layers)],
            "dequant + torch": lambda: [F.linear(x, ops.gguf_embedding(torch.arange(w.shape[0]), w, kind, k))
                                        for x, (w, kind, k) in zip(xs, layers)],
            "fp32 dense": lambda: [dense(x, w) for x, w in zip(xs, dequantized)],
        }
        paths = {name: paths[name] for name in args.paths}
        times = {name: [] for name in paths}
        for step in paths.values():
            step()
        for _ in range(args.reps):
            for name, step in paths.items():
                started = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - started)
        for name, t in times.items():
            t.sort()
            print(f"rows {rows:3d} {name:15s}: best {t[0] * 1e3:7.1f} ms, median {t[len(t) // 2] * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
