"""vLLM's side of `pagoda bench throughput|latency --compare vllm`.

Run as a script by the python of vLLM's own venv (tools/peers/install_vllm_cpu.sh),
so it imports nothing of Pagoda. It reads the workload (prompt token ids,
output lengths, temperature) from a JSON file, builds vLLM's offline LLM once,
runs the workload once to warm up and answers with what vLLM runs (its
version and dtype). Then for each line `run` on stdin it times the prefill
alone (every request generating one token), then the whole workload, and
answers with the seconds and token counts; it exits at the end of stdin.
An answer is one line of JSON on stdout after ANSWER (vLLM prints there too).
"""

import argparse
import json
import sys
import time

ANSWER = "PAGODA-PEER "  # marks the answers among vLLM's own prints


def answer(message: dict) -> None:
    print(ANSWER + json.dumps(message), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("workload", help="JSON: prompt_token_ids (lists), output_lens, temperature")
    parser.add_argument("--model", required=True, help="a Hugging Face folder (safetensors)")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--skip-tokenizer-init", action="store_true")
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--kv-cache-bytes", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    args = parser.parse_args()
    with open(args.workload) as f:
        workload = json.load(f)

    import vllm

    # Prefix caching off: each timed run prefills its prompts afresh, as the other engines' runs do.
    llm = vllm.LLM(model=args.model, tokenizer=args.tokenizer, skip_tokenizer_init=args.skip_tokenizer_init,
                   dtype=args.dtype, max_model_len=args.max_model_len, kv_cache_memory_bytes=args.kv_cache_bytes,
                   seed=args.seed, enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": ids} for ids in workload["prompt_token_ids"]]

    def timed(output_lens: list[int]) -> tuple[float, int]:
        # Explicit top_k/top_p: the model's generation config must not make vLLM sample differently.
        params = [vllm.SamplingParams(temperature=workload["temperature"], top_p=1.0, top_k=0, ignore_eos=True,
                                      max_tokens=n, detokenize=not args.skip_tokenizer_init) for n in output_lens]
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        return elapsed, sum(len(c.token_ids) for o in outputs for c in o.outputs)

    timed(workload["output_lens"])
    answer(dict(vllm_version=vllm.__version__, dtype=str(llm.llm_engine.model_config.dtype).removeprefix("torch.")))
    for line in sys.stdin:
        if line.strip() != "run":
            raise SystemExit(f"vllm_peer.py: unknown command {line.strip()!r} (it takes `run`)")
        prefill_time, _ = timed([1] * len(prompts))
        elapsed, output_tokens = timed(workload["output_lens"])
        answer(dict(prefill_time=prefill_time, elapsed_time=elapsed, output_tokens=output_tokens))


if __name__ == "__main__":  # vLLM starts its engine in spawned processes, which import this file again
    main()
