"""`pagoda bench latency` (vLLM's benchmarks/latency.py): the time one batch
of --batch-size random prompts of --input-len tokens takes to generate
--output-len tokens each (EOS ignored), over --num-iters runs after
--num-iters-warmup; reports the average and the 10..99th percentiles."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict

from tqdm import tqdm

from pagoda.benchmarks.datasets import DatasetSpec, RandomDataset, special_token_ids, verify_fits
from pagoda.benchmarks.peers import add_compare_args, fresh_prefills, prepare_peers, print_peer, run_peer
from pagoda.entrypoints.cli_args import (add_engine_args, add_multiprocess_arg, engine_args_from_cli, non_negative_int,
                                         positive_int)

PERCENTAGES = [10, 25, 50, 75, 90, 99]


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser, model_shapes=True)
    add_multiprocess_arg(parser)
    parser.add_argument("--input-len", type=positive_int, default=32)
    parser.add_argument("--output-len", type=positive_int, default=128)
    parser.add_argument("--batch-size", type=positive_int, default=8)
    parser.add_argument("--n", type=positive_int, default=1, help="samples per prompt")
    parser.add_argument("--num-iters-warmup", type=non_negative_int, default=10)
    parser.add_argument("--num-iters", type=positive_int, default=30)
    parser.add_argument("--output-json", default=None, help="write the latencies here")
    parser.add_argument("--disable-tqdm", action="store_true")
    add_compare_args(parser)


def latency_stats(latencies: list[float]) -> dict:
    """vLLM's JSON: avg_latency, latencies, percentiles {10: .., ..., 99: ..}."""
    import numpy as np

    values = np.array(latencies)
    return dict(avg_latency=float(values.mean()), latencies=values.tolist(),
                percentiles=dict(zip(PERCENTAGES, np.percentile(values, PERCENTAGES).tolist())))


def main(args: argparse.Namespace) -> dict:
    import torch

    from pagoda.entrypoints.llm import LLM
    from pagoda.sampling_params import SamplingParams

    engine_args = engine_args_from_cli(args)
    llm = LLM(**asdict(engine_args), multiprocess=args.multiprocess)
    model_config = llm.llm_engine.model_config
    spec = DatasetSpec(args.batch_size, (args.input_len, args.input_len), (args.output_len, args.output_len))
    requests = RandomDataset(model_config.hf_config.vocab_size, args.seed,
                             special_token_ids(model_config.hf_config)).sample(spec)
    verify_fits(requests, model_config.max_model_len)
    if args.compare and args.n != 1:  # checked before the timed runs
        raise ValueError("--compare runs one sample per prompt: drop --n")
    temperature = 1.0
    peers = prepare_peers(args, engine_args, model_config, requests, temperature, torch.get_num_threads())
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = SamplingParams(n=args.n, temperature=temperature, top_p=1.0, ignore_eos=True, max_tokens=args.output_len)

    def run_to_completion() -> float:
        if args.compare:  # else every run after the first finds its prompts in the prefix cache
            fresh_prefills(llm)
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - started

    for _ in tqdm(range(args.num_iters_warmup), desc="Warmup iterations", disable=args.disable_tqdm):
        run_to_completion()
    latencies = [run_to_completion()
                 for _ in tqdm(range(args.num_iters), desc="Profiling iterations", disable=args.disable_tqdm)]
    results = latency_stats(latencies)
    print(f"Avg latency: {results['avg_latency']} seconds")
    for percentage, value in results["percentiles"].items():
        print(f"{percentage}% percentile latency: {value} seconds")
    for name, start in peers.items():
        peer = results[name] = run_peer(start, [r.prompt_token_ids for r in requests],
                                        [r.expected_output_len for r in requests], args.compare_runs)
        print(f"{name} latency: {peer['elapsed_time']} seconds")
        print_peer(name, peer)
        print(f"pagoda / {name} latency: {results['avg_latency'] / peer['elapsed_time']:.2f}x")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(dict(results, args=vars(args), engine_args=asdict(engine_args)), f, indent=1, default=str)
    return results
