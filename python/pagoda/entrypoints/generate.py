"""`pagoda generate "prompt"`: one completion from the shell, streamed to
stdout as it is generated. --chat applies the tokenizer's chat template;
sampling flags left out take the model's generation_config.json defaults."""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict

from pagoda.entrypoints.cli_args import add_engine_args, add_multiprocess_arg, engine_args_from_cli, positive_int

# Flag -> SamplingParams field; only the flags given are passed on.
SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "seed")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text (the user message with --chat)")
    parser.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template to the prompt")
    parser.add_argument("--system", default=None, help="with --chat: a system message first")
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    sampling.add_argument("--top-p", type=float, default=None)
    sampling.add_argument("--top-k", type=int, default=None)
    sampling.add_argument("--min-p", type=float, default=None)
    sampling.add_argument("--max-tokens", type=positive_int, default=128)
    add_engine_args(parser)  # its --seed seeds the engine and this request's sampling
    add_multiprocess_arg(parser)


def main(args: argparse.Namespace) -> str:
    """Prints the completion as it grows; returns its text."""
    from pagoda.entrypoints.llm import LLM
    from pagoda.sampling_params import SamplingParams

    if args.system is not None and not args.chat:
        raise ValueError("--system needs --chat")
    params = SamplingParams(**{name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name) is not None})
    llm = LLM(**asdict(engine_args_from_cli(args)), multiprocess=args.multiprocess)
    if args.chat:
        messages = ([dict(role="system", content=args.system)] if args.system is not None else []) + [
            dict(role="user", content=args.prompt)]
        prompt = llm.chat_prompts(messages)[0]
    else:
        prompt = args.prompt
    engine = llm.llm_engine
    engine.add_request("generate", prompt, params)
    text = ""
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                new = output.outputs[0].text[len(text):]  # cumulative text: print what is new
                text += new
                sys.stdout.write(new)
                sys.stdout.flush()
    finally:
        engine.abort_request("generate")  # Ctrl-C: free the request (a no-op once finished)
    sys.stdout.write("\n")
    return text
