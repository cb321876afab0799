#!/usr/bin/env python3
"""The API server's host cost per engine step, without a model or a GPU:
--requests streaming requests (delta outputs, as the server asks) get one
token each per step from synthetic EngineCoreOutputs, through what the
front end does with a step's message: msgpack decode and the
OutputProcessor (detokenization, stop strings, delta outputs). Reports
microseconds per step and per token: a ceiling that this part of one API
server process puts on output tokens per second (HTTP and SSE come on top;
docs/BENCHMARKS.md).

  PYTHONPATH=python python tools/benchmarks/bench_front_end.py [--requests 256] [--steps 128] [--tokenizer PATH]
"""

import argparse
import random
import statistics
import time

from pagoda.engine.core_messages import (DECODERS, ENCODER, EngineCoreOutput, EngineCoreOutputs, RequestType,
                                         SchedulerStats)
from pagoda.engine.output_processor import OutputProcessor
from pagoda.engine.processor import Processor
from pagoda.outputs import RequestOutputKind
from pagoda.sampling_params import SamplingParams


def load(tokenizer_path: str | None):
    from transformers import AutoTokenizer

    from pagoda.config import ModelConfig
    from pagoda.entrypoints.default_model import default_model

    model = default_model()
    config = ModelConfig(model=model, device="cpu")
    if tokenizer_path is None:
        return config, AutoTokenizer.from_pretrained(config.folder, gguf_file=config.gguf_file)
    return config, AutoTokenizer.from_pretrained(tokenizer_path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--tokenizer", default=None, help="a Hugging Face tokenizer folder (default: SmolLM2's)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    config, tokenizer = load(args.tokenizer)
    vocab = min(config.hf_config.vocab_size, len(tokenizer))
    rng = random.Random(0)
    processor = Processor(config, tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps, ignore_eos=True)
    # Ordinary text tokens (no special ones), so detokenization does real work.
    specials = set(tokenizer.all_special_ids)
    tokens = [t for t in range(vocab) if t not in specials]
    decode_outputs = DECODERS[RequestType.OUTPUTS]
    per_step = []
    for _ in range(args.repeats):
        output_processor = OutputProcessor(tokenizer)
        for i in range(args.requests):
            state, _ = processor.process(f"r{i}", [rng.choice(tokens) for _ in range(64)], params,
                                         output_kind=RequestOutputKind.DELTA)
            output_processor.add_request(state)
        messages = []
        for step in range(args.steps):
            last = step == args.steps - 1
            outputs = [EngineCoreOutput(f"r{i}", [rng.choice(tokens)], "length" if last else None)
                       for i in range(args.requests)]
            messages.append(ENCODER.encode(EngineCoreOutputs(outputs, SchedulerStats())))
        started = time.perf_counter()
        for message in messages:
            result = output_processor.process_outputs(decode_outputs.decode(message).outputs)
            assert len(result.request_outputs) == args.requests
        per_step.append((time.perf_counter() - started) / args.steps)
    step_s = statistics.median(per_step)
    print(f"{args.requests} requests x {args.steps} steps: {step_s * 1e6:.0f} us per step, "
          f"{step_s / args.requests * 1e6:.2f} us per token -> at most {args.requests / step_s:,.0f} tokens/s "
          f"per API server process")


if __name__ == "__main__":
    main()
