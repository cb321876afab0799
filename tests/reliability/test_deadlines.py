"""Deadlines under load: the server process (SmolLM2, 8 sequences at a
time) with 48 streams at once, half carrying a short timeout_seconds. Each
of those ends with finish_reason "timeout" a few steps after its deadline
(or finished before it), the others run to their full length, and the KV
pool is full again afterwards."""

import asyncio

import pytest
from conftest import ServerProcess, body, client, requires_smollm2, start_streams

from pagoda.benchmarks.load import settle

STREAMS, MAX_TOKENS = 48, 24
# Too long to finish within any deadline below: these end by their deadline.
DEADLINE_MAX_TOKENS, DEADLINES = 200, (0.5, 1.0, 1.5)
# A deadline is checked between engine steps, and the client's clock also
# counts HTTP and queueing: the end may come this much after it.
SLACK_S = 5.0


@pytest.fixture(scope="module")
def server():
    running = ServerProcess("--max-num-seqs", "8")
    yield running
    running.stop()


async def crowd(url):
    bodies = [body(i, DEADLINE_MAX_TOKENS, timeout_seconds=DEADLINES[i % len(DEADLINES)]) if i % 2 else
              body(i, MAX_TOKENS) for i in range(STREAMS)]
    async with client() as http:
        outputs = await asyncio.gather(*start_streams(http, url, bodies))
        idle, _ = await settle(http, url, timeout=30)
    return bodies, outputs, idle


@requires_smollm2
def test_deadlines_under_load(server):
    bodies, outputs, idle = asyncio.run(crowd(server.url))
    assert [o.error for o in outputs if not o.success] == [], server.output()
    timed_out = 0
    for request, output in zip(bodies, outputs):
        deadline = request.get("timeout_seconds")
        if deadline is None:
            assert (output.finish_reason, output.output_tokens) == ("length", MAX_TOKENS)
        elif output.finish_reason == "timeout":
            timed_out += 1
            assert deadline <= output.latency <= deadline + SLACK_S, (deadline, output.latency)
            assert output.output_tokens < DEADLINE_MAX_TOKENS
        else:
            assert output.finish_reason == "length" and output.latency < deadline, (deadline, output)
    assert timed_out > 0
    assert idle["pagoda:kv_cache_used_blocks"] == 0, idle
    assert idle["pagoda:num_requests_running"] == idle["pagoda:num_requests_waiting"] == 0, idle
