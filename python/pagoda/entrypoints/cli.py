"""The `pagoda` command: `tools/bazel run //:pagoda -- SUBCOMMAND ...`.

  serve              the OpenAI-compatible server (vLLM's flags; same as
                     `tools/bazel run //server -- ...`)
  generate           one completion of a prompt, streamed to stdout
  bench throughput   offline throughput of LLM.generate on a random workload,
                     optionally beside transformers' generate (--hf-baseline)
  bench latency      the latency of one batch, over iterations
  bench serve        a workload streamed to a running server: TTFT, TPOT,
                     ITL, E2EL and throughputs
  bench load         a crowd of streaming clients (some leaving mid-stream,
                     some with deadlines) against a server on this machine:
                     nothing lost, no 5xx, no KV blocks leaked

This file only parses and dispatches; each command lives in its module.
"""

from __future__ import annotations

import argparse
import os
import sys


def make_parser() -> argparse.ArgumentParser:
    from pagoda.benchmarks import latency, load, serve, throughput
    from pagoda.entrypoints import generate

    parser = argparse.ArgumentParser(prog="pagoda", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Listed for --help only: main() hands `serve` to the server's own parser.
    commands.add_parser("serve", help="the OpenAI-compatible server (`pagoda serve --help`)", add_help=False)
    command = commands.add_parser("generate", help="one completion of a prompt")
    generate.add_cli_args(command)
    command.set_defaults(dispatch=generate.main)
    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True,
                                                                           metavar="BENCHMARK")
    for name, module, help_text in [
        ("throughput", throughput, "offline throughput of LLM.generate (and transformers with --hf-baseline)"),
        ("latency", latency, "latency of one batch, over iterations"),
        ("serve", serve, "online serving metrics against a running server"),
        ("load", load, "a crowd of clients against a server on this machine: failures, leaks, latency"),
    ]:
        command = bench.add_parser(name, help=help_text, description=module.__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_cli_args(command)
        command.set_defaults(dispatch=module.main)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # the server parses its own flags
        from pagoda.entrypoints.openai.api_server import main as serve

        return serve(argv[1:])
    parser = make_parser()
    args = parser.parse_args(argv)
    os.chdir(os.environ.get("BUILD_WORKING_DIRECTORY", os.getcwd()))  # paths as the user typed them
    try:
        args.dispatch(args)
    except ValueError as exc:  # bad input found past argparse (engine values, flag combinations)
        name = " ".join(filter(None, ["pagoda", args.command, getattr(args, "bench", None)]))
        parser.exit(2, f"{name}: error: {exc}\n")


if __name__ == "__main__":
    main(sys.argv[1:])
