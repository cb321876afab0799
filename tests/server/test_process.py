"""The server as its own process (`python -m pagoda.entrypoints.openai.api_server`):
SIGTERM lets in-flight requests finish -- running and queued -- then exits 0;
an engine that dies makes it exit 1; a bad flag exits with one line, no
traceback."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conftest import MODEL, free_port

import pagoda


def environment() -> dict:
    # The child imports the same pagoda as this test.
    here = os.path.dirname(os.path.dirname(os.path.abspath(pagoda.__file__)))
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [here, os.environ.get("PYTHONPATH")] if p))


SERVER = ("-m", "pagoda.entrypoints.openai.api_server")


def start(model_folder, *flags, server=SERVER):
    """server: how python runs it (default: the module)."""
    port = free_port()
    command = [sys.executable, *server, "--model", model_folder,
               "--served-model-name", MODEL, "--port", str(port), "--dtype", "float32", "--kv-cache-space", "0.05",
               "--disable-log-stats", *flags]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.communicate()
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.1)


CLIENTS, MAX_TOKENS = 8, 120


def stream(url, results, index, accepted):
    """One streamed completion; releases `accepted` once the server has
    answered with its headers (the request is in flight)."""
    body = {"model": MODEL, "prompt": [5, 6, 7 + index], "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        accepted.release()
        results[index] = [line for line in r.iter_lines() if line.startswith("data: ")]


def start_clients(url, results, count):
    """`count` streaming clients, returned once the server has accepted every
    one (on a loaded machine a fixed wait is not enough: a client that has not
    connected when the signal comes is refused, not drained)."""
    accepted = threading.Semaphore(0)
    threads = [threading.Thread(target=stream, args=(url, results, i, accepted)) for i in range(count)]
    for t in threads:
        t.start()
    for _ in threads:
        assert accepted.acquire(timeout=60), "the server did not accept every client"
    return threads


def event_json(event: str) -> dict:
    assert event.startswith("data: "), event
    return json.loads(event.removeprefix("data: "))


def test_sigterm_drains_in_flight_requests_and_exits_0(model_folder):
    # One sequence at a time: while the first streams, the others wait in the queue. The drain's
    # bound is far above the work left (seconds; more on a loaded machine): nothing is cut short.
    proc, url = start(model_folder, "--max-num-seqs", "1", "--timeout-graceful-shutdown", "120")
    try:
        results = {}
        clients = start_clients(url, results, CLIENTS)
        assert len(results) < CLIENTS - 1, "the requests ended before the signal: nothing left to drain"
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(0.5)
        with pytest.raises(httpx.TransportError):  # no new connections while draining
            httpx.get(url + "/health", timeout=5)
        for c in clients:
            c.join(60)
        assert proc.wait(60) == 0
        stderr = proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
    assert time.monotonic() - signalled < 120
    for i in range(CLIENTS):  # every request ran to its end
        events = results[i]
        assert events[-1] == "data: [DONE]", events[-3:]
        assert event_json(events[-3])["choices"][0]["finish_reason"] == "length"
        assert event_json(events[-2])["usage"]["completion_tokens"] == MAX_TOKENS
    assert "Traceback" not in stderr
    assert sum("POST /v1/completions 200" in line for line in stderr.splitlines()) == CLIENTS, stderr  # one each


def test_drain_is_bounded(model_folder):
    """--timeout-graceful-shutdown: what is still in flight then is aborted
    -- each stream still ends well-formed, with finish_reason "abort" -- and
    the process exits 0."""
    proc, url = start(model_folder, "--max-num-seqs", "1", "--timeout-graceful-shutdown", "0.5")
    clients = 2 * CLIENTS  # seconds of work, one sequence at a time
    try:
        results = {}
        threads = start_clients(url, results, clients)
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        for t in threads:
            t.join(60)
        assert proc.wait(60) == 0
        exited = time.monotonic() - signalled
        stderr = proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
    assert exited < 20, exited  # far less than the work left
    reasons = []
    for events in results.values():
        assert events[-1] == "data: [DONE]"
        reasons.append(event_json(events[-3])["choices"][0]["finish_reason"])
    assert len(reasons) == clients and "abort" in reasons, reasons
    assert "Traceback" not in stderr and "incomplete" not in stderr, stderr


# The real server (engine core in a thread, where the test can reach it)
# whose model runner fails on its first step, as a device fault would: no
# request can be blamed, so the engine dies.
FAILING_DEVICE = """
import sys
from pagoda.engine.async_llm import AsyncLLM
from pagoda.entrypoints.openai import api_server

build = AsyncLLM.from_engine_args


def with_failing_device(args, **kwargs):
    engine = build(args, **kwargs)

    def execute(*_, **__):
        raise RuntimeError("simulated device fault")

    engine.engine.runner.execute = execute
    return engine


AsyncLLM.from_engine_args = with_failing_device
api_server.main(sys.argv[1:])
"""


def test_dead_engine_exits_1(model_folder):
    """The request in flight gets 503, then the server shuts down and exits
    1, so a supervisor restarts it."""
    proc, url = start(model_folder, "--in-process-engine", server=("-c", FAILING_DEVICE))
    try:
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [5], "max_tokens": 2}, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error", r.text
        assert proc.wait(60) == 1
        stderr = proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
    assert "the engine died" in stderr and "simulated device fault" in stderr, stderr
    assert "shut down cleanly" not in stderr


def children(pid: int) -> list[int]:
    """The processes `pid` spawned for Pagoda (not multiprocessing's resource tracker)."""
    found = [int(c) for task in os.listdir(f"/proc/{pid}/task")
             for c in open(f"/proc/{pid}/task/{task}/children").read().split()]
    return [c for c in found if b"spawn_main" in open(f"/proc/{c}/cmdline", "rb").read()]


def kill_mid_stream(url: str, pid: int) -> None:
    """SIGKILLs `pid` once a long streamed completion has sent its first
    chunk; the stream must then end with an error event and [DONE]."""
    body = {"model": MODEL, "prompt": [5, 6], "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        os.kill(pid, signal.SIGKILL)
        rest = list(lines)
    events = [line for line in rest if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and '"error"' in events[-2], events[-3:]


def test_a_killed_engine_core_process_makes_the_server_exit_1(model_folder):
    """The engine core runs in its own process: killed mid-stream, the
    stream ends with an error event and the server drains and exits 1."""
    proc, url = start(model_folder)
    try:
        (core,) = children(proc.pid)
        kill_mid_stream(url, core)
        assert proc.wait(60) == 1
        stderr = proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
    assert "the engine died" in stderr and "exited" in stderr, stderr
    assert "shut down cleanly" not in stderr


def test_a_killed_tensor_parallel_worker_makes_the_server_exit_1(model_folder):
    """-tp 2: the engine core's two worker processes; one killed mid-stream
    fails the engine at once (the stream ends with an error event, the log
    names the rank), the server exits 1 and no worker is left behind."""
    proc, url = start(model_folder, "--tensor-parallel-size", "2")
    try:
        (core,) = children(proc.pid)
        workers = children(core)
        assert len(workers) == 2, workers
        kill_mid_stream(url, workers[1])
        assert proc.wait(60) == 1
        stderr = proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
    assert "worker rank 1" in stderr, stderr
    for pid in [core, *workers]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_sigterm_stops_the_engine_core_process_too(model_folder):
    proc, url = start(model_folder)
    try:
        (core,) = children(proc.pid)
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [5], "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        proc.kill()
        proc.wait()
    with pytest.raises(ProcessLookupError):
        os.kill(core, 0)


def test_several_api_servers_front_one_engine_core(model_folder):
    """--api-server-count 2: both processes answer on one port, before one
    engine core; SIGTERM drains them all and exits 0."""
    proc, url = start(model_folder, "--api-server-count", "2")
    try:
        launched = children(proc.pid)
        assert len(launched) == 3  # the core and two API servers
        for i in range(24):  # each a new connection: the kernel spreads them over both
            r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [5, i + 1], "max_tokens": 3,
                                                          "ignore_eos": True}, timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        stderr = proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
    answered = [line for line in stderr.splitlines() if "POST /v1/completions 200" in line]
    assert len(answered) == 24, stderr
    for i in range(2):  # the request log names the process that answered
        assert any(f"(pagoda-api-server-{i})" in line for line in answered), answered
    for pid in launched:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("flags, says", [
    (["--tensor-parallel-size", "3"], "num_attention_heads (4) is not divisible by tensor_parallel_size (3)"),
    (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization"),
])
def test_bad_engine_flag_is_one_line(model_folder, flags, says):
    result = subprocess.run([sys.executable, "-m", "pagoda.entrypoints.openai.api_server", "--model", model_folder,
                             *flags], capture_output=True, text=True, env=environment(), timeout=120)
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("pagoda serve: error: ") and says in lines[-1], result.stderr
    assert "Traceback" not in result.stderr


def test_parser_flags():
    from pagoda.entrypoints.openai.api_server import make_parser

    parse = make_parser().parse_args
    assert parse(["--allowed-origins", '["http://a", "http://b"]']).allowed_origins == ["http://a", "http://b"]
    assert parse(["--allowed-origins", "http://a, http://b"]).allowed_origins == ["http://a", "http://b"]
    args = parse(["--device", "cpu", "--load-format", "dummy", "--enforce-eager", "--gpu-memory-utilization", "0.5",
                  "--tensor-parallel-size", "1", "--disable-uvicorn-access-log"])
    assert (args.device, args.load_format, args.enforce_eager, args.gpu_memory_utilization,
            args.tensor_parallel_size, args.disable_uvicorn_access_log) == ("cpu", "dummy", True, 0.5, 1, True)
    assert (args.scheduling_policy, args.max_queued_requests, args.stream_send_timeout) == ("fcfs", None, 30.0)
    args = parse(["--scheduling-policy", "priority", "--max-queued-requests", "0", "--stream-send-timeout", "2.5"])
    assert (args.scheduling_policy, args.max_queued_requests, args.stream_send_timeout) == ("priority", 0, 2.5)
    for bad in (["--scheduling-policy", "sjf"], ["--max-queued-requests", "-1"], ["--stream-send-timeout", "0"]):
        with pytest.raises(SystemExit):
            parse(bad)
    with pytest.raises(SystemExit):
        parse(["--allowed-origins", '["http://a", 5]'])
    with pytest.raises(SystemExit):
        parse(["--load-format", "pickle"])


def test_tool_and_reasoning_flags(capsys):
    from pagoda.entrypoints.openai.api_server import main, make_parser

    args = make_parser().parse_args(["--tool-call-parser", "llama3_json", "--enable-auto-tool-choice",
                                     "--reasoning-parser", "qwen3"])
    assert (args.tool_call_parser, args.enable_auto_tool_choice, args.reasoning_parser) == ("llama3_json", True, "qwen3")
    args = make_parser().parse_args([])
    assert (args.tool_call_parser, args.enable_auto_tool_choice, args.reasoning_parser) == (None, False, None)
    for bad in (["--tool-call-parser", "mistral"], ["--reasoning-parser", "deepseek_r1"]):
        with pytest.raises(SystemExit):
            make_parser().parse_args(bad)
    with pytest.raises(SystemExit):  # before any engine starts
        main(["--enable-auto-tool-choice"])
    assert "--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json)" in capsys.readouterr().err
