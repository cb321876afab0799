#!/usr/bin/env python3
"""The multi-process executor's per-step channel cost, without a model: a
decode step of --requests requests (one new token each, a new block every
block_size steps) is pickled once and written to --ranks worker processes,
which unpickle it; rank 0 answers with a ModelRunnerOutput of one sampled id
per request, as a real step does. Reports microseconds per step for the
round trip, and the message sizes of the incremental scheduler output
against one that carries every request's whole block table.

  PYTHONPATH=python python tools/benchmarks/bench_executor.py [--requests 256] [--ranks 2] [--steps 500]
"""

import argparse
import multiprocessing
import pickle
import statistics
import time

from pagoda.core.scheduler import NewRequestData, ScheduledRequest, SchedulerOutput
from pagoda.outputs import ModelRunnerOutput
from pagoda.sampling_params import SamplingParams

BLOCK_SIZE = 16


def step(num_requests: int, position: int, whole_tables: bool) -> SchedulerOutput:
    blocks = position // BLOCK_SIZE + 1
    new_block = position % BLOCK_SIZE == 0
    items = []
    for i in range(num_requests):
        table = list(range(i * 1000, i * 1000 + blocks))
        new = table if whole_tables else (table[-1:] if new_block else [])
        items.append(ScheduledRequest(f"req-{i}", [position % 50000], position, new, True, 512))
    return SchedulerOutput(items)


def echo(pipe, rank: int, num_requests: int) -> None:
    ids = [f"req-{i}" for i in range(num_requests)]
    while True:
        message = pickle.loads(pipe.recv_bytes())
        if message is None:
            return
        if rank == 0:
            pipe.send_bytes(pickle.dumps(ModelRunnerOutput(ids, list(range(num_requests))),
                                         protocol=pickle.HIGHEST_PROTOCOL))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=500)
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    pipes, processes = [], []
    for rank in range(args.ranks):
        ours, theirs = context.Pipe()
        process = context.Process(target=echo, args=(theirs, rank, args.requests), daemon=True)
        process.start()
        pipes.append(ours)
        processes.append(process)
    new = [NewRequestData(f"req-{i}", list(range(512)), SamplingParams(), False) for i in range(args.requests)]
    print(f"a step's first message with {args.requests} new requests of 512 prompt tokens: "
          f"{len(pickle.dumps(SchedulerOutput(new_requests=new))) / 1024:.0f} KiB (sent once per request)")
    for whole in (False, True):
        sizes = [len(pickle.dumps(step(args.requests, 512 + s, whole))) for s in range(64)]
        print(f"decode step message, {'whole block tables' if whole else 'incremental'}: "
              f"{statistics.mean(sizes) / 1024:.1f} KiB")
    times = []
    for s in range(args.steps):
        scheduled = step(args.requests, 512 + s, False)
        started = time.perf_counter()
        data = pickle.dumps(("execute", scheduled), protocol=pickle.HIGHEST_PROTOCOL)
        for pipe in pipes:
            pipe.send_bytes(data)
        pickle.loads(pipes[0].recv_bytes())
        times.append(time.perf_counter() - started)
    for pipe in pipes:
        pipe.send_bytes(pickle.dumps(None))
    times = sorted(times)[len(times) // 10:]  # the first steps warm up
    print(f"round trip per step, {args.requests} requests, {args.ranks} ranks: median "
          f"{statistics.median(times) * 1e6:.0f} us, p90 {times[int(len(times) * 0.9)] * 1e6:.0f} us")
    for process in processes:
        process.join()


if __name__ == "__main__":
    main()
