"""`pagoda bench throughput` (vLLM's benchmarks/throughput.py): offline
throughput of LLM.generate with every request submitted at once, EOS ignored
so each request generates exactly its expected output length. With
--hf-baseline, transformers' generate runs the same requests on the same
device and dtype in the same command, and the ratio is printed. With
--structured-output json every request's output follows STRUCTURED_SCHEMA
(the engine needs a tokenizer: --tokenizer with --model-shape): the cost of
the grammar's bitmask per step beside the same run without it."""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from dataclasses import asdict
from typing import Callable

from pagoda.benchmarks.datasets import (DatasetSpec, RandomDataset, SampleRequest, add_dataset_args,
                                        get_dataset_spec, sample_requests, special_token_ids, verify_fits)
from pagoda.benchmarks.peers import PEERS, add_compare_args, fresh_prefills, prepare_peers, print_peer
from pagoda.entrypoints.cli_args import add_engine_args, add_multiprocess_arg, engine_args_from_cli, positive_int

# An array of records without end: a request stays inside it (strings, digits,
# keys: the matcher's usual work) until max_tokens, so the token counts match
# the free run's, more or less (a run may close the array and stop early).
STRUCTURED_SCHEMA = {"type": "object", "properties": {"records": {"type": "array", "items": {
    "type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string"},
                                     "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}},
    "required": ["id", "name", "tags"]}}}, "required": ["records"]}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser, model_shapes=True)
    add_multiprocess_arg(parser)
    add_dataset_args(parser)
    parser.add_argument("--greedy", action="store_true", help="temperature 0 (default: sampling at temperature 1)")
    parser.add_argument("--hf-baseline", action="store_true",
                        help="also run transformers' generate on the same requests")
    parser.add_argument("--hf-batch-size", type=positive_int, default=16)
    parser.add_argument("--structured-output", choices=["json"], default=None,
                        help="every request's output follows a JSON schema (xgrammar; needs a tokenizer)")
    parser.add_argument("--output-json", default=None, help="write the results here")
    parser.add_argument("--disable-tqdm", action="store_true")
    add_compare_args(parser)


def summarize(elapsed: float, num_requests: int, prompt_tokens: int, output_tokens: int) -> dict:
    """vLLM's throughput figures (its JSON keys), plus output tokens/s."""
    return dict(
        elapsed_time=elapsed, num_requests=num_requests, total_num_tokens=prompt_tokens + output_tokens,
        total_prompt_tokens=prompt_tokens, total_output_tokens=output_tokens,
        requests_per_second=num_requests / elapsed, tokens_per_second=(prompt_tokens + output_tokens) / elapsed,
        output_tokens_per_second=output_tokens / elapsed,
    )


def run_pagoda(llm, requests, warmup, temperature: float, use_tqdm: bool = True, structured: bool = False,
               runs: int = 1, after_run: Callable[[list[list[int]]], None] | None = None
               ) -> tuple[dict, list[list[int]]]:
    """Times LLM.generate on `requests`, `runs` times (the median run's
    figures), after a run of `warmup` (requests of other tokens; with
    `structured`, their grammar compiles there). Each timed run starts from
    an empty prefix cache, so none finds its prompts computed; after each,
    after_run gets the prompts' ids as the engine took them (the peers'
    turn). Returns the figures and those ids."""
    from pagoda.sampling_params import SamplingParams, StructuredOutputsParams

    constraint = StructuredOutputsParams(json=STRUCTURED_SCHEMA) if structured else None
    # Explicit top_k/top_p: a model's generation_config must not make Pagoda
    # sample differently from the baseline.
    params = [SamplingParams(temperature=temperature, top_p=1.0, top_k=0, ignore_eos=True,
                             max_tokens=r.expected_output_len, structured_outputs=constraint) for r in requests]
    # Text prompts are tokenized by the engine, inside the timed run (as vLLM's benchmark does).
    prompts = [{"prompt_token_ids": r.prompt_token_ids} if r.prompt is None else r.prompt for r in requests]
    llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in warmup],
                 [SamplingParams(max_tokens=r.expected_output_len, ignore_eos=True, structured_outputs=constraint)
                  for r in warmup], use_tqdm=False)
    times = []
    for _ in range(runs):
        fresh_prefills(llm)
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
        times.append(time.perf_counter() - started)
        if after_run is not None:
            after_run([o.prompt_token_ids for o in outputs])
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    prompts = [o.prompt_token_ids for o in outputs]
    figures = summarize(statistics.median(times), len(requests), sum(map(len, prompts)), output_tokens)
    return dict(figures, runs=[dict(elapsed_time=t) for t in times]), prompts


def main(args: argparse.Namespace) -> dict:
    import torch

    from pagoda.entrypoints.llm import LLM

    spec = get_dataset_spec(args)
    engine_args = engine_args_from_cli(args)
    llm = LLM(**asdict(engine_args), multiprocess=args.multiprocess)
    model_config = llm.llm_engine.model_config
    vocab, special = model_config.hf_config.vocab_size, special_token_ids(model_config.hf_config)
    requests = sample_requests(args, spec, vocab, special)
    verify_fits(requests, model_config.max_model_len)
    temperature = 0.0 if args.greedy else 1.0
    peers = prepare_peers(args, engine_args, model_config, requests, temperature, torch.get_num_threads())
    # Short (fits wherever the first request fits), of other random tokens.
    prompt_len, output_len = min(16, requests[0].prompt_len), min(4, requests[0].expected_output_len)
    warmup = RandomDataset(vocab, args.seed + 1, special).sample(
        DatasetSpec(2, (prompt_len, prompt_len), (output_len, output_len)))
    # Against peers, Pagoda runs as often as each of them (its median too),
    # alternating: each peer runs after each of Pagoda's runs, on the same
    # token ids (text prompts: as the engine encoded them), started after the first.
    sessions = {}

    def peers_turn(prompts: list[list[int]]) -> None:
        for name, start in peers.items():
            if name not in sessions:
                sessions[name] = start(prompts, [r.expected_output_len for r in requests])
            sessions[name].run()

    try:
        figures, prompts = run_pagoda(llm, requests, warmup, temperature, use_tqdm=not args.disable_tqdm,
                                      structured=args.structured_output is not None,
                                      runs=args.compare_runs if peers else 1, after_run=peers_turn if peers else None)
        results = dict(pagoda=figures)
        for name, session in sessions.items():
            peer = session.figures()
            results[name] = dict(summarize(peer["elapsed_time"], len(requests), peer["total_prompt_tokens"],
                                           peer["total_output_tokens"]), **peer)
    finally:
        for session in sessions.values():
            session.stop()
    # The baseline gets the same tokens (text prompts: as the engine encoded them).
    requests = [SampleRequest(ids, r.expected_output_len) for ids, r in zip(prompts, requests)]
    device = llm.llm_engine.model_config.device
    del llm  # free its weights and KV cache before the baseline loads
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if args.hf_baseline:
        from pagoda.benchmarks.hf_baseline import load_hf_model, run_hf

        model = load_hf_model(model_config, device)
        elapsed, output_tokens = run_hf(model, requests, args.hf_batch_size, temperature, args.seed,
                                        use_tqdm=not args.disable_tqdm)
        results["hf"] = summarize(elapsed, len(requests), sum(r.prompt_len for r in requests), output_tokens)
        results["pagoda_over_hf"] = (results["pagoda"]["output_tokens_per_second"]
                                     / results["hf"]["output_tokens_per_second"])

    print(f"\nmodel {engine_args.model}  dtype {str(model_config.torch_dtype).removeprefix('torch.')}  "
          f"device {device}  {spec.describe()}")
    for name in ("pagoda", "hf", *PEERS):
        if name in results:
            r = results[name]
            runs = f", median of {len(r['runs'])}" if len(r.get("runs", ())) > 1 else ""
            print(f"{name:<9} Throughput: {r['requests_per_second']:.2f} requests/s, {r['tokens_per_second']:.2f} "
                  f"total tokens/s, {r['output_tokens_per_second']:.2f} output tokens/s "
                  f"({r['total_output_tokens']} tokens in {r['elapsed_time']:.1f} s{runs})")
    if "pagoda_over_hf" in results:
        print(f"pagoda / hf output throughput: {results['pagoda_over_hf']:.2f}x")
    for name in peers:
        peer = results[name]
        print_peer(name, peer)
        print(f"pagoda / {name} output throughput: "
              f"{figures['output_tokens_per_second'] / peer['output_tokens_per_second']:.2f}x")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(dict(args=vars(args), engine_args=asdict(engine_args), dtype=str(model_config.torch_dtype),
                           device=str(device), dataset=asdict(spec), **results), f, indent=1, default=str)
    return results
