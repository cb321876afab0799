#!/usr/bin/env python3
"""Where a CPU decode step of the real SmolLM2-135M-Instruct goes (issue 17,
item 3): the engine generates --output-len tokens for --batch-size prompts of
--input-len random tokens, then the same again under torch.profiler; prints
the decode step time (median over the steps of the timed run, from the
engine's step calls) and the profiler's table of ops (self CPU time).

  PYTHONPATH=python python tools/benchmarks/bench_cpu_step.py [--batch-size 1] [--dtype float32]
      [--quantization gguf_int8] [--kv-cache-dtype bfloat16] [--no-enable-prefix-caching]
"""

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--no-enable-prefix-caching", dest="prefix_caching", action="store_false",
                        help="prefill every run in full (the runs repeat the same prompts)")
    args = parser.parse_args()

    from pagoda.entrypoints.default_model import default_model
    from pagoda.entrypoints.llm import LLM
    from pagoda.sampling_params import SamplingParams

    llm = LLM(model=default_model(), dtype=args.dtype, enable_prefix_caching=args.prefix_caching,
              quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    engine = llm.llm_engine
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(100, 49000, (args.input_len,), generator=g).tolist()}
               for _ in range(args.batch_size)]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.output_len)

    def run() -> list[float]:
        """Times of every engine step (the first one is the prefill)."""
        for i, p in enumerate(prompts):
            engine.add_request(f"r{time.monotonic_ns()}-{i}", p, params)
        times = []
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        return times

    run()  # warm-up
    times = run()
    decode = times[1:]
    print(f"threads {torch.get_num_threads()}, batch {args.batch_size}: prefill {times[0] * 1e3:.1f} ms, "
          f"decode step median {statistics.median(decode) * 1e3:.2f} ms (min {min(decode) * 1e3:.2f}), "
          f"{args.batch_size / statistics.median(decode):.1f} tok/s decode")
    if args.no_profile:
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        times = run()
    steps = len(times)
    print(f"profiled run: {steps} steps, {sum(times) * 1e3:.1f} ms")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
