"""Shared fixtures: a tiny random Llama checkpoint saved without a tokenizer
(the benchmarks send token ids: skip_tokenizer_init), the `pagoda` command
run in-process, and the real server around that checkpoint on a free
loopback port."""

import socket
import threading
import time

import httpx
import pytest


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_url(tiny_model):
    """The OpenAI server (build_app + uvicorn in a thread) serving the tiny
    model as "tiny" until the module's tests are done."""
    import uvicorn

    from pagoda.engine.async_llm import AsyncLLM
    from pagoda.entrypoints.openai.api_server import build_app

    engine = AsyncLLM(tiny_model, disable_log_stats=True, skip_tokenizer_init=True, dtype="float32",
                      kv_cache_space=0.05, max_num_seqs=4)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine, "tiny"), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    yield url
    server.should_exit = True
    thread.join(30)
    engine.shutdown()
