"""Other engines on the same workload in the same command (`--compare`), so a
ratio never mixes machines or moments.

llama.cpp: its `llama-batched-bench` on the same .gguf file, with Pagoda's
thread count: --batch-size (or --num-prompts) sequences of --input-len prompt
tokens, each generating --output-len tokens, at once. Build the binary with
tools/peers/build_llama_cpp.sh (the source vendored in the pinned
llama-cpp-python sdist) and pass it with --llama-cpp-bin or
PAGODA_LLAMA_CPP_BIN. It decodes without sampling (its tokens are not
chosen from the logits), which costs it nothing Pagoda's greedy sampling
costs: the comparison favours it slightly.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess

from pagoda.entrypoints.cli_args import positive_int

LLAMA_CPP_ENV = "PAGODA_LLAMA_CPP_BIN"
PEERS = ("llama.cpp",)


def add_compare_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("peers")
    group.add_argument("--compare", action="append", choices=PEERS, default=[],
                       help="also run this engine on the same model file and workload (repeatable)")
    group.add_argument("--llama-cpp-bin", default=os.environ.get(LLAMA_CPP_ENV),
                       help=f"llama.cpp's llama-batched-bench (default: ${LLAMA_CPP_ENV}, else PATH); "
                            "tools/peers/build_llama_cpp.sh builds it")
    group.add_argument("--compare-runs", type=positive_int, default=3, help="runs of each peer; the median is reported")


def llama_cpp_binary(path: str | None) -> str:
    """The llama-batched-bench to run, or a ValueError saying how to get one."""
    found = path or shutil.which("llama-batched-bench")
    if not found or not os.access(found, os.X_OK):
        raise ValueError(f"--compare llama.cpp needs llama.cpp's llama-batched-bench: build it with "
                         f"tools/peers/build_llama_cpp.sh and pass --llama-cpp-bin PATH (or set {LLAMA_CPP_ENV})"
                         + (f"; {path!r} is not an executable file" if path else ""))
    return found


def check_gguf(model_config) -> str:
    """The .gguf file both engines load; ValueError when the model is not one."""
    if model_config.gguf_file is None:
        raise ValueError("--compare llama.cpp runs the same weights file: pass --model FILE.gguf "
                         f"(got {model_config.model})")
    return str(model_config.folder / model_config.gguf_file)


def check_fixed_lengths(requests) -> tuple[int, int]:
    """(prompt_len, output_len) shared by every request: llama-batched-bench
    runs fixed lengths only."""
    shapes = {(r.prompt_len, r.expected_output_len) for r in requests}
    if len(shapes) != 1:
        raise ValueError("--compare llama.cpp needs one prompt and output length for every request "
                         "(--dataset-name random with --random-range-ratio 0)")
    return shapes.pop()


def run_llama_cpp(binary: str, gguf: str, parallel: int, prompt_len: int, output_len: int, threads: int,
                  runs: int) -> dict:
    """Medians over `runs` of llama-batched-bench's figures for `parallel`
    sequences at once: elapsed seconds (prefill + generation), decode tokens/s
    (generation alone, all sequences) and prefill tokens/s."""
    command = [binary, "-m", gguf, "-c", str(parallel * (prompt_len + output_len)), "-b", "2048", "-ub", "512",
               "-npp", str(prompt_len), "-ntg", str(output_len), "-npl", str(parallel), "-t", str(threads),
               "-tb", str(threads), "--output-format", "jsonl"]
    rows = []
    for _ in range(runs):
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            tail = "\n".join((done.stderr or done.stdout).splitlines()[-5:])
            raise RuntimeError(f"llama-batched-bench failed (exit {done.returncode}): {' '.join(command)}\n{tail}")
        rows.append(json.loads(lines[-1]))
    return dict(elapsed_time=statistics.median(r["t"] for r in rows),
                decode_tokens_per_second=statistics.median(r["speed_tg"] for r in rows),
                prefill_tokens_per_second=statistics.median(r["speed_pp"] for r in rows),
                runs=rows, command=" ".join(command))
