#!/usr/bin/env python3
"""A device timeline of the engine's steps: the offline workload of `pagoda
bench throughput` (same engine and dataset flags) stepped by hand, with
torch.profiler (CPU and CUDA activity) around --steps steps after the first
--skip, at each --skip given. Per window it prints the wall time per step,
the share of it the GPU was busy (the union of its kernels and copies), the
same share from the window's first GPU event to its last (the window's edges,
the first step's host preparation and the last one's output handling, overlap
with the neighbouring steps in a run, not in a window), the
GPU's time by kernel, and the host's time by op (CUDA runtime calls
included: a long cudaLaunchKernel or a synchronize says who waits for whom).
Whether a step is bound by the GPU or by the host reads off directly.

  PYTHONPATH=python python tools/benchmarks/profile_steps.py --model-shape Qwen3-0.6B --tokenizer DIR \\
      --dataset-name nano-vllm --max-model-len 4096 [--skip 100 600] [--steps 30] [--trace-dir DIR]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from pagoda.benchmarks.datasets import add_dataset_args, get_dataset_spec, sample_requests, special_token_ids
from pagoda.entrypoints.cli_args import add_engine_args, engine_args_from_cli
from pagoda.outputs import RequestOutputKind
from pagoda.sampling_params import SamplingParams


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals (microseconds in, seconds out)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total / 1e6


def report(prof, steps: int, wall: float, rows: list[int], top: int) -> None:
    gpu = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    intervals = [(e.time_range.start, e.time_range.end) for e in gpu]
    busy = busy_seconds(intervals)
    span = (max(end for _, end in intervals) - min(start for start, _ in intervals)) / 1e6 if gpu else 0.0
    print(f"  {steps} steps, {sum(rows) / steps:.0f} rows per step on average: {wall / steps * 1e3:.2f} ms per step, "
          f"GPU busy {busy / steps * 1e3:.2f} ms of it ({busy / wall:.0%}; "
          f"{busy / span if span else 0:.0%} from its first kernel to its last)")
    averages = prof.key_averages()
    print("  GPU time per step by kernel:")
    by_gpu = sorted((a for a in averages if a.self_device_time_total > 0), key=lambda a: -a.self_device_time_total)
    for a in by_gpu[:top]:
        print(f"    {a.self_device_time_total / steps / 1e3:8.3f} ms  {a.count / steps:6.1f}x  {a.key[:100]}")
    print("  host time per step by op (self):")
    for a in sorted(averages, key=lambda a: -a.self_cpu_time_total)[:top]:
        print(f"    {a.self_cpu_time_total / steps / 1e3:8.3f} ms  {a.count / steps:6.1f}x  {a.key[:100]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser, model_shapes=True)
    add_dataset_args(parser)
    parser.add_argument("--skip", type=int, nargs="+", default=[100], help="steps run before each window")
    parser.add_argument("--steps", type=int, default=30, help="steps profiled per window")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--trace-dir", default=None, help="also write each window's Chrome trace here")
    args = parser.parse_args()
    engine = engine_args_from_cli(args).create_engine()
    config = engine.model_config
    requests = sample_requests(args, get_dataset_spec(args), config.hf_config.vocab_size,
                               special_token_ids(config.hf_config))
    for i, r in enumerate(requests):
        params = SamplingParams(temperature=args.temperature, top_p=1.0, top_k=0, ignore_eos=True,
                                max_tokens=r.expected_output_len)
        engine.add_request(str(i), {"prompt_token_ids": r.prompt_token_ids}, params,
                           output_kind=RequestOutputKind.FINAL_ONLY)
    cuda = config.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda
    step = 0
    for window in sorted(args.skip):
        while step < window and engine.has_unfinished_requests():
            engine.step()
            step += 1
        if not engine.has_unfinished_requests():
            print(f"window at step {window}: the run ended at step {step}")
            break
        rows = []
        with profile(activities=activities) as prof:
            started = time.perf_counter()
            for _ in range(args.steps):
                if not engine.has_unfinished_requests():
                    break
                engine.step()
                rows.append(engine.scheduler.num_running)
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - started
        step += len(rows)
        print(f"window after step {window}:")
        report(prof, len(rows), wall, rows, args.top)
        if args.trace_dir:
            prof.export_chrome_trace(f"{args.trace_dir}/steps_{window}.json")
    while engine.has_unfinished_requests():
        engine.step()


if __name__ == "__main__":
    main()
