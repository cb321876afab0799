"""What bounds the server's load: --max-queued-requests (503 with
Retry-After beyond it), --scheduling-policy priority (a more important
request overtakes waiting ones) and --stream-send-timeout (a client that
stops reading its stream has its request aborted)."""

import socket
import threading
import time

import httpx
import pytest

from conftest import ENGINE_ARGS, MODEL, RunningServer, assert_error, post, slow_steps, wait_pool_full


def wait_until(condition, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def stream_first_chunk(server, body):
    """Starts a streaming request in a thread; returns once its first chunk came."""
    started = threading.Event()

    def run():
        with httpx.stream("POST", server.url + "/v1/completions", json=dict(body, stream=True), timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    started.set()

    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(60)
    return thread


def in_thread(server, body, results, name):
    def run():
        r = post(server, "/v1/completions", body)
        results.append((name, r.status_code))

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.fixture
def one_at_a_time(model_folder, request):
    """A server running one sequence at a time, with slow steps, built from
    the command line's flags (`pagoda serve ...`), its engine core in this
    process (where the test slows its steps)."""
    from pagoda.engine.async_llm import AsyncLLM
    from pagoda.entrypoints.cli_args import engine_args_from_cli
    from pagoda.entrypoints.openai.api_server import make_parser

    flags, app_kwargs = request.param
    args = make_parser().parse_args(["--model", model_folder, "--dtype", "float32", "--kv-cache-space", "0.05",
                                     "--max-num-seqs", "1", *flags])
    running = RunningServer(AsyncLLM.from_engine_args(engine_args_from_cli(args), multiprocess=False), MODEL,
                            **app_kwargs)
    monkeypatch = pytest.MonkeyPatch()
    slow_steps(monkeypatch, running.engine, 0.02)
    yield running
    monkeypatch.undo()
    running.stop()


LONG = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 60, "ignore_eos": True}
SHORT = {"model": MODEL, "prompt": [8, 9], "max_tokens": 3, "ignore_eos": True}


@pytest.mark.parametrize("one_at_a_time", [([], dict(max_queued_requests=2))], indirect=True)
def test_queue_bound_is_503_with_retry_after(one_at_a_time):
    server = one_at_a_time
    state = server.app.state.pagoda
    running = stream_first_chunk(server, LONG)
    results = []
    # One request of two prompts: two engine requests wait.
    waiting = in_thread(server, dict(SHORT, prompt=[[8, 9], [10]]), results, "two prompts")
    wait_until(lambda: state.num_queued_requests == 2, "two queued requests")
    r = post(server, "/v1/completions", SHORT)
    assert_error(r, 503, code="queue_full", says="--max-queued-requests 2")
    assert r.headers["retry-after"] == "1"
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert_error(r, 503, code="queue_full")
    running.join(60)
    waiting.join(60)
    assert results == [("two prompts", 200)]
    assert post(server, "/v1/completions", SHORT).status_code == 200  # room again


@pytest.mark.parametrize("one_at_a_time", [(["--scheduling-policy", "priority"], {})], indirect=True)
def test_priority_overtakes_waiting_requests(one_at_a_time):
    server = one_at_a_time
    state = server.app.state.pagoda
    running = stream_first_chunk(server, LONG)
    finished, threads = [], []
    for name, priority in (("first", 0), ("second", 0), ("urgent", -1)):  # lower value: more important
        threads.append(in_thread(server, dict(SHORT, priority=priority), finished, name))
        wait_until(lambda: state.num_queued_requests == len(threads), f"{name} queued")
    for t in [running, *threads]:
        t.join(60)
    assert finished == [("urgent", 200), ("first", 200), ("second", 200)]


def test_stalled_stream_reader_is_aborted(model_folder, monkeypatch):
    """A client that sends a streaming request and never reads: once the
    socket buffers are full (a few MB on loopback), the send waits; past
    --stream-send-timeout the request is aborted (its blocks freed) and the
    connection closed, while the server goes on serving others."""
    import json

    from pagoda.engine.async_llm import AsyncLLM

    running = RunningServer(AsyncLLM(model_folder, disable_log_stats=True, **dict(ENGINE_ARGS, max_num_seqs=64)),
                            MODEL, stream_send_timeout=0.5)
    try:
        slow_steps(monkeypatch, running.engine, 0.02)
        registry = running.app.state.pagoda.metrics.registry

        def aborted():
            return registry.get_sample_value("pagoda:request_success_total",
                                             {"model_name": MODEL, "finished_reason": "abort"}) or 0

        # About 8 MB of events: 64 choices x 110 tokens, each chunk with 20 top logprobs.
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 110,
                           "n": 64, "logprobs": True, "top_logprobs": 20, "ignore_eos": True,
                           "stream": True}).encode()
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
            sock.connect(("127.0.0.1", running.port))
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            wait_until(lambda: aborted() == 1, "the stalled request's abort")
            wait_pool_full(running.engine)
            assert post(running, "/v1/completions", {"model": MODEL, "prompt": [5], "max_tokens": 2}).status_code == 200
            # What was sent ends without [DONE]: the connection was closed mid-stream.
            sock.settimeout(10)
            received = b""
            while data := sock.recv(1 << 16):
                received += data
        assert received.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in received
    finally:
        running.stop()
