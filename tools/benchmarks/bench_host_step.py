#!/usr/bin/env python3
"""The host's work per decode step without a model: the real Scheduler and
KVCacheManager over --requests running requests of --prompt-len prompt
tokens, the worker's BlockTable and InputBuffers (on the CPU: the host side
of a GPU step is the same numpy work), and the sampling metadata. Prints
milliseconds per step of each part, the median over --repeats runs of
--steps steps.

  PYTHONPATH=python python tools/benchmarks/bench_host_step.py [--requests 256] [--steps 200] [--repeats 3]
"""

import argparse
import statistics
import time

import numpy as np
import torch

from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request import Request
from pagoda.core.scheduler import Scheduler
from pagoda.model_executor.layers.sampler import SamplingMetadata
from pagoda.sampling_params import SamplingParams
from pagoda.worker.block_table import BlockTable
from pagoda.worker.input_buffers import InputBuffers

BLOCK_SIZE = 16
PARTS = ("schedule", "block table", "prepare", "sampling metadata", "update_from_output")


def run(num_requests: int, prompt_len: int, steps: int, temperature: float) -> dict[str, float]:
    max_blocks = -(-(prompt_len + steps + 1) // BLOCK_SIZE)
    kv = KVCacheManager(num_requests * max_blocks, BLOCK_SIZE)
    max_tokens = max(8192, num_requests * prompt_len)
    scheduler = Scheduler(kv, max_num_seqs=num_requests, max_num_batched_tokens=max_tokens)
    rng = np.random.default_rng(0)
    for i in range(num_requests):
        params = SamplingParams(temperature=temperature, max_tokens=steps + 10, ignore_eos=True)
        scheduler.add_request(Request(f"r{i}", rng.integers(0, 50_000, prompt_len).tolist(), params))
    buffers = InputBuffers(max_tokens, num_requests, max_blocks, BLOCK_SIZE, torch.device("cpu"))
    table, rows = BlockTable(max_blocks, num_requests), {}
    totals = dict.fromkeys(PARTS, 0.0)
    for step in range(steps + 1):  # step 0 is the prefill of every prompt: not counted
        t0 = time.perf_counter()
        output = scheduler.schedule()
        t1 = time.perf_counter()
        for new in output.new_requests:
            rows[new.request_id] = table.add_row()
        for item in output.scheduled:
            if item.new_block_ids or item.reset_blocks:
                table.append(rows[item.request_id], item.new_block_ids, item.reset_blocks)
        step_rows = np.fromiter((rows[item.request_id] for item in output.scheduled), np.int64, len(output.scheduled))
        t2 = time.perf_counter()
        buffers.prepare(output, table.gather(step_rows))
        t3 = time.perf_counter()
        requests = [scheduler.requests[item.request_id] for item in output.scheduled]
        SamplingMetadata.from_requests([r.sampling_params for r in requests], [r.output_token_ids for r in requests])
        t4 = time.perf_counter()
        scheduler.update_from_output(output, {item.request_id: 1 for item in output.scheduled})
        t5 = time.perf_counter()
        if step:
            for part, seconds in zip(PARTS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                totals[part] += seconds
    return {part: seconds / steps * 1e3 for part, seconds in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args()
    runs = [run(args.requests, args.prompt_len, args.steps, args.temperature) for _ in range(args.repeats)]
    print(f"{args.requests} decoding requests, {args.prompt_len}-token prompts, block size {BLOCK_SIZE}: "
          f"ms per step, median of {args.repeats} runs of {args.steps} steps")
    for part in PARTS:
        print(f"  {part:20s} {statistics.median(r[part] for r in runs):7.3f}")
    print(f"  {'total':20s} {statistics.median(sum(r.values()) for r in runs):7.3f}")


if __name__ == "__main__":
    main()
