#!/usr/bin/env python3
"""Where `LLM(...)`'s cold start goes: the wall time of importing pagoda and of
the engine's construction (torch is imported inside it) for a model shape with dummy weights, and
cProfile's functions by cumulative time over the whole start (the engine's
own log gives the model runner's phases). Run it twice in one command: the
first run compiles Triton kernels into the cache, the second is a warm
machine's start.

  PYTHONPATH=python python tools/benchmarks/bench_startup.py --model-shape Qwen3-0.6B [--tokenizer DIR] [--top 30|0]
      [--multiprocess | --no-multiprocess]  (LLM's default: the core in a process of its own on a GPU)
"""

import argparse
import cProfile
import io
import pstats
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-shape", default="Qwen3-0.6B")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--top", type=int, default=30, help="functions to list; 0: no profile (cProfile slows Python)")
    # Not cli_args' add_multiprocess_arg: that would import pagoda before the clock starts.
    parser.add_argument("--multiprocess", action=argparse.BooleanOptionalAction, default=None)
    args = parser.parse_args()
    started = time.perf_counter()
    profile = cProfile.Profile()
    if args.top:
        profile.enable()
    # As a user's script: no `import torch` of its own (Pagoda imports it
    # inside LLM(...), after starting a core process where it runs one).
    from pagoda import LLM
    from pagoda.benchmarks.model_shapes import model_shape_path

    imported = time.perf_counter()
    llm = LLM(model_shape_path(args.model_shape), load_format="dummy", tokenizer=args.tokenizer,
              skip_tokenizer_init=args.tokenizer is None, multiprocess=args.multiprocess)
    torch = sys.modules["torch"]
    if torch.cuda.is_initialized():  # the model is in this process
        torch.cuda.synchronize()
    ready = time.perf_counter()
    profile.disable()
    print(f"import pagoda {imported - started:.2f} s, LLM(...) {ready - imported:.2f} s, "
          f"total {ready - started:.2f} s (core {'in its own process' if llm.llm_engine.core_pid else 'in process'})")
    if args.top:
        stream = io.StringIO()
        pstats.Stats(profile, stream=stream).sort_stats("cumulative").print_stats(args.top)
        print(stream.getvalue())
    del llm


if __name__ == "__main__":
    main()
