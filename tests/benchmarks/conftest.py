"""Shared fixtures: a tiny random Llama checkpoint saved without a tokenizer
(the benchmarks send token ids: skip_tokenizer_init), the `pagoda` command
run in-process, and the real server around that checkpoint on a free
loopback port."""

import os
import sys

import pytest

# The server harness, also when pytest runs without Bazel (Bazel's
# //tests/server:running_server dependency puts it on the path too).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "server"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from checkpoints import build_hf_model, save_checkpoint

    return save_checkpoint(build_hf_model("llama"), str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture
def pagoda_cli(capsys):
    """pagoda_cli(*argv) -> (exit code, stdout, stderr) of `pagoda ARGV`."""
    from pagoda.entrypoints.cli import main

    def run(*argv):
        try:
            main([str(a) for a in argv])
            code = 0
        except SystemExit as exc:
            code = exc.code
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


@pytest.fixture(scope="module")
def server(tiny_model):
    """The OpenAI server (a RunningServer) serving the tiny model as "tiny"
    until the module's tests are done."""
    from running_server import RunningServer

    from pagoda.engine.async_llm import AsyncLLM

    engine = AsyncLLM(tiny_model, disable_log_stats=True, skip_tokenizer_init=True, dtype="float32",
                      kv_cache_space=0.05, max_num_seqs=4)
    running = RunningServer(engine, "tiny")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def server_url(server):
    return server.url
