"""`pagoda bench load` against the real server on a loopback port: a short
crowd (40 clients, some leaving mid-stream, some with deadlines) is answered
in full and leaves the KV pool full; blocks held with no request fail the
run. Also /metrics' KV-block and memory gauges, how a stream's end is
classified, what fails a run, and that only loopback URLs are driven."""

import asyncio
import json
import threading
from collections import Counter

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagoda.benchmarks.datasets import SampleRequest
from pagoda.benchmarks.load import Record, outcome, require_loopback, summarize
from pagoda.benchmarks.serve import (RequestFuncOutput, async_request_openai_completions, client_session,
                                     completion_payload)


def load(pagoda_cli, server, tiny_model, tmp_path, *argv):
    out = tmp_path / "load.json"
    code, stdout, stderr = pagoda_cli("bench", "load", "--base-url", server.url, "--tokenizer", tiny_model,
                                      "--output-json", out, *argv)
    return code, json.loads(out.read_text()) if out.exists() else None, stdout + stderr


def test_a_crowd_is_answered_and_leaks_nothing(pagoda_cli, server, tiny_model, tmp_path):
    # 40 clients on 4 sequences: most requests queue, and disconnects hit queued
    # and running ones. Deadlines (server and client side) from 10 ms, less
    # than 32 tokens take even unqueued, so some fire however fast the machine
    # (from 200 ms, a fast CI run once saw none fire server-side).
    code, report, output = load(pagoda_cli, server, tiny_model, tmp_path, "--clients", 40, "--duration", 15,
                                "--input-len", 24, "--output-len", 32, "--timeout-range", "0.01,1",
                                "--settle-timeout", 10)
    assert code == 0, output
    assert report["passed"] and report["problems"] == [] and "PASSED" in output
    assert report["failed"] == report["lost"] == report["server_errors"] == 0, report["first_errors"]
    assert report["requests"] == report["ok"] + report["disconnects"] + report["client_timeouts"]
    assert report["disconnects"] > 0 and report["client_timeouts"] > 0 and report["finish_reasons"].get("timeout")
    assert set(report["planned"]) == {"normal", "disconnect", "deadline", "client timeout"}
    assert report["kv_blocks_leaked"] == 0 and report["requests_left_in_engine"] == 0
    assert report["peak_kv_blocks_used"] > 0 and report["peak_requests_waiting"] > 0  # the gauges moved
    kv, runner = server.engine.engine.kv_cache_manager, server.engine.engine.runner
    assert kv.num_free_blocks == runner.num_blocks == report["kv_cache_total_blocks"]
    assert report["rss_before_bytes"] > 0 and report["rss_after_bytes"] > 0
    assert 0 < report["p50_ttft_ms"] <= report["p99_ttft_ms"] and report["p50_ttft_ms"] <= report["p50_e2el_ms"]


def test_blocks_held_without_a_request_fail_the_run(pagoda_cli, server, tiny_model, tmp_path):
    pool = server.engine.engine.kv_cache_manager.pool
    held = pool.allocate(2)  # what a request that never frees its blocks leaves behind
    try:
        code, report, output = load(pagoda_cli, server, tiny_model, tmp_path, "--clients", 2, "--duration", 1,
                                    "--input-len", 8, "--output-len", 4, "--settle-timeout", 1)
    finally:
        pool.free(held)
    assert code == 1, output
    assert report["kv_blocks_leaked"] == 2 and not report["passed"] and report["failed"] == 0
    assert "FAILED: 2 KV blocks leaked" in output


def test_a_server_that_goes_away_ends_the_run(pagoda_cli, tiny_model, tmp_path):
    from running_server import RunningServer

    from pagoda.engine.async_llm import AsyncLLM

    engine = AsyncLLM(tiny_model, disable_log_stats=True, skip_tokenizer_init=True, dtype="float32",
                      kv_cache_space=0.05, max_num_seqs=4)
    doomed = RunningServer(engine, "tiny")
    leave = threading.Timer(2.0, setattr, (doomed.server, "should_exit", True))  # uvicorn stops listening
    leave.start()
    try:
        code, report, output = load(pagoda_cli, doomed, tiny_model, tmp_path, "--clients", 4, "--duration", 60,
                                    "--input-len", 8, "--output-len", 8)
    finally:
        leave.join()
        doomed.stop()
    assert code == 1, output
    # The clients stopped at the first request nobody answered, not after --duration.
    assert report["lost"] >= 1 and report["failures"].keys() == {"transport error"}
    assert report["elapsed_s"] < 30
    assert report["problems"][0].startswith("GET /metrics failed after the run") and report["kv_blocks_leaked"] is None


def gauges(server) -> dict:
    text = httpx.get(server.url + "/metrics").text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def test_kv_block_and_memory_gauges(server):
    kv, runner = server.engine.engine.kv_cache_manager, server.engine.engine.runner
    idle = gauges(server)
    assert idle["pagoda:kv_cache_total_blocks"] == runner.num_blocks and idle["pagoda:kv_cache_used_blocks"] == 0
    with open("/proc/self/status") as f:  # the server runs in this process
        vm_rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    assert idle["pagoda:process_resident_memory_bytes"] == pytest.approx(vm_rss, rel=0.2)

    # A finished request's full blocks stay in the prefix cache, unreferenced: free.
    body = dict(model="tiny", prompt=list(range(10, 50)), max_tokens=4, ignore_eos=True)
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=30).status_code == 200
    assert kv.pool.cached_block_hash_to_block
    assert gauges(server)["pagoda:kv_cache_used_blocks"] == 0

    held = kv.pool.allocate(3)
    try:
        busy = gauges(server)
    finally:
        kv.pool.free(held)
    assert busy["pagoda:kv_cache_used_blocks"] == 3
    assert busy["pagoda:kv_cache_usage_perc"] == pytest.approx(3 / runner.num_blocks)


def chunk(**choice) -> str:
    return "data: " + json.dumps(dict(choices=[dict(dict(index=0, text="a", finish_reason=None), **choice)])) + "\n\n"


USAGE = 'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}\n\n'
DONE = "data: [DONE]\n\n"


@pytest.mark.parametrize("status, body, disconnect_after, expected", [
    (200, chunk() + chunk(finish_reason="length") + USAGE + DONE, None, "ok"),
    (200, chunk(finish_reason="timeout", text="") + USAGE + DONE, None, "ok"),  # a deadline before any token
    (200, chunk() + chunk() + chunk(finish_reason="length") + USAGE + DONE, 1, "disconnected"),
    (200, chunk(finish_reason="stop") + USAGE + DONE, 1, "ok"),  # it ended before the client could leave
    (200, chunk() + chunk(finish_reason="length") + USAGE, None, "malformed stream"),  # no [DONE]
    (200, chunk() + USAGE + DONE, None, "malformed stream"),  # no finish_reason
    (200, chunk() + chunk(finish_reason="length") + DONE, None, "malformed stream"),  # no usage
    (200, "data: {not json\n\n", None, "malformed stream"),
    (200, chunk() + 'data: {"error": {"message": "boom"}}\n\n' + DONE, None, "error event"),
    (503, '{"error": {"message": "busy"}}', None, "HTTP 503"),
    (None, "", None, "transport error"),
])
def test_how_a_stream_ends(status, body, disconnect_after, expected):
    """Canned responses from a real HTTP server on loopback (none at all: a
    port nobody listens on)."""
    from aiohttp import web

    from running_server import free_port

    async def respond(request):
        await request.read()
        return web.Response(status=status, body=body.encode(), content_type="text/event-stream")

    async def send():
        runner = None
        port = free_port()
        if status is not None:
            app = web.Application()
            app.router.add_post("/v1/completions", respond)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with client_session(10.0) as session:
                payload = completion_payload("m", SampleRequest([1, 2, 3], 2), 0.0, False)
                return await async_request_openai_completions(session, f"http://127.0.0.1:{port}/v1/completions",
                                                              payload, {}, disconnect_after)
        finally:
            if runner is not None:
                await runner.cleanup()

    output = asyncio.run(send())
    assert outcome(output, timed_out=False) == expected, output.error


def record(name, finish_reason=None, ttft=0.0, latency=0.0):
    output = RequestFuncOutput(success=name == "ok", finish_reason=finish_reason, ttft=ttft, latency=latency,
                               output_tokens=2, error=f"{name} happened")
    return Record("normal", name, output)


IDLE = {"pagoda:kv_cache_used_blocks": 0, "pagoda:num_requests_running": 0, "pagoda:num_requests_waiting": 0,
        "pagoda:kv_cache_total_blocks": 32, "pagoda:process_resident_memory_bytes": 2048}


def test_what_fails_a_run():
    answered = [record("ok", "stop", 0.1, 0.5), record("ok", "length", 0.3, 0.7), record("ok", "timeout", 9, 9),
                record("disconnected"), record("client timeout"), record("HTTP 400")]
    smaller = dict(IDLE, **{"pagoda:process_resident_memory_bytes": 1024})
    report = summarize(answered, 10.0, smaller, IDLE, 0.5, Counter())
    # A 400, disconnects and client timeouts are reported, not a failed run.
    assert report["passed"] and report["failed"] == 1 and report["failures"] == {"HTTP 400": 1}
    assert (report["ok"], report["disconnects"], report["client_timeouts"]) == (3, 1, 1)
    assert report["finish_reasons"] == {"stop": 1, "length": 1, "timeout": 1}
    assert report["rss_growth_bytes"] == 1024
    # Latencies are those of requests that ended normally (stop, length).
    assert report["p50_ttft_ms"] == pytest.approx(200) and report["p50_e2el_ms"] == pytest.approx(600)

    failing = answered + [record("HTTP 503"), record("error event"), record("transport error"),
                          record("malformed stream")]
    report = summarize(failing, 10.0, IDLE, IDLE, 0.5, Counter())
    assert (report["lost"], report["server_errors"], report["failed"]) == (2, 2, 5)
    assert report["problems"] == ["2 requests got no complete answer",
                                  "2 requests failed on the server's side (5xx or error event)"]
    assert "transport error happened" in report["first_errors"]

    stuck = dict(IDLE, **{"pagoda:kv_cache_used_blocks": 3, "pagoda:num_requests_running": 1})
    assert summarize(answered, 10.0, IDLE, stuck, 30.0, Counter())["problems"] == [
        "3 KV blocks leaked (held with no request left)", "1 requests still in the engine 30.0 s after every "
        "client was gone"]
    report = summarize(answered, 10.0, IDLE, {"unreachable": "ConnectError: refused"}, 0.0, Counter())
    assert report["problems"] == ["GET /metrics failed after the run: ConnectError: refused"]
    assert report["kv_blocks_leaked"] is None and report["rss_growth_bytes"] is None


def test_only_a_server_on_this_machine(pagoda_cli):
    for url in ("http://127.0.0.1:8000", "http://127.0.0.9:1", "http://[::1]:8000", "http://localhost:8000"):
        require_loopback(url)
    for url in ("http://10.0.0.1:8000", "http://example.com:8000", "http://0.0.0.0:8000"):
        code, _, stderr = pagoda_cli("bench", "load", "--base-url", url)
        assert code == 2 and "not a loopback address" in stderr, stderr
    code, _, stderr = pagoda_cli("bench", "load", "--disconnect-fraction", "0.6", "--timeout-fraction", "0.5")
    assert code == 2 and "add up to more than 1" in stderr
    code, _, stderr = pagoda_cli("bench", "load", "--timeout-range", "5,1")
    assert code == 2 and "--timeout-range" in stderr
