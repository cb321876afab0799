#!/usr/bin/env python3
"""One SmolLM2 decode step's linear layers (30 layers' qkv, o, gate_up and down,
and the tied 49152-row LM head) with the real GGUF weights: kept packed and
multiplied by pagoda's int8 kernel (ops.gguf_linear) against dequantized to
fp32 and multiplied by the layers' dense() path. Prints the best and the
median of 7 steps per row count.

  PYTHONPATH=python python tools/benchmarks/bench_cpu_gguf.py   (OMP_NUM_THREADS to pin threads)
"""

import time

import gguf
import torch

from pagoda import ops
from pagoda.entrypoints.default_model import default_model
from pagoda.model_executor.layers.linear import dense


def main() -> None:
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
    print(f"packed {sum(w.numel() for w, _, _ in layers) / 1e6:.1f} MB, "
          f"fp32 {sum(w.numel() * 4 for w in dequantized) / 1e6:.1f} MB, {torch.get_num_threads()} threads")
    for rows in (1, 16):
        xs = [torch.randn(rows, k) for _, _, k in layers]
        paths = {
            "packed int8": lambda: [ops.gguf_linear(x, w, kind) for x, (w, kind, _) in zip(xs, layers)],
            "fp32 dense": lambda: [dense(x, w) for x, w in zip(xs, dequantized)],
        }
        for name, step in paths.items():
            step()
            times = []
            for _ in range(7):
                started = time.perf_counter()
                step()
                times.append(time.perf_counter() - started)
            times.sort()
            print(f"rows {rows:2d} {name:11s}: best {times[0] * 1e3:6.1f} ms, median {times[3] * 1e3:6.1f} ms")


if __name__ == "__main__":
    main()
