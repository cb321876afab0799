"""The engine's command-line flags and EngineArgs agree: every flag's default
is its field's default (stated once, in EngineArgs), for `pagoda serve` and
the `pagoda generate`/`bench` parsers alike, and flags reach the fields."""

import argparse
from dataclasses import MISSING, fields

import pytest

from pagoda.benchmarks.model_shapes import model_shape_path
from pagoda.engine.arg_utils import EngineArgs
from pagoda.entrypoints.cli_args import add_engine_args, engine_args_from_cli


def bench_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_args(parser, model_shapes=True)
    return parser


def serve_parser() -> argparse.ArgumentParser:
    from pagoda.entrypoints.openai.api_server import make_parser

    return make_parser()


def engine_flags() -> list:
    """The EngineArgs fields that add_engine_args makes flags of (not --model:
    resolved to the default model later)."""
    args = bench_parser().parse_args([])
    return [f for f in fields(EngineArgs) if f.default is not MISSING and hasattr(args, f.name)]


@pytest.mark.parametrize("make", [bench_parser, serve_parser], ids=["bench", "serve"])
def test_flag_defaults_are_the_fields_defaults(make):
    # (A command's own flags may differ on purpose: `pagoda serve` logs stats, LLM does not.)
    args = make().parse_args([])
    checked = engine_flags()
    assert len(checked) >= 15
    for field in checked:
        assert getattr(args, field.name) == field.default, field.name


def test_flags_reach_the_fields():
    args = bench_parser().parse_args(["--model", "m", "-tp", "2", "--no-enable-prefix-caching", "--max-num-seqs", "3",
                                      "--async-scheduling", "--scheduling-policy", "priority"])
    engine_args = engine_args_from_cli(args)
    assert (engine_args.model, engine_args.tensor_parallel_size, engine_args.enable_prefix_caching,
            engine_args.max_num_seqs, engine_args.async_scheduling, engine_args.scheduling_policy) == (
        "m", 2, False, 3, True, "priority")
    assert engine_args.block_size == EngineArgs.block_size


def test_max_cudagraph_capture_size_flag_and_its_check():
    args = bench_parser().parse_args(["--max-cudagraph-capture-size", "64"])
    assert engine_args_from_cli(args).max_cudagraph_capture_size == 64
    with pytest.raises(SystemExit):
        bench_parser().parse_args(["--max-cudagraph-capture-size", "0"])
    shape = model_shape_path("Qwen3-0.6B")
    for bad in (0, -1, True, "512"):
        with pytest.raises(ValueError, match="max_cudagraph_capture_size must be a positive int"):
            EngineArgs(shape, load_format="dummy", device="cpu", max_cudagraph_capture_size=bad).create_model_config()
