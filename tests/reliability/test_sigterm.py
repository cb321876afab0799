"""SIGTERM under load: the server process (SmolLM2, 8 sequences at a time)
with 30 streaming clients, signalled while tokens flow and requests still
queue. It stops taking connections, lets in-flight requests finish for
--timeout-graceful-shutdown seconds, aborts the rest and exits 0; every
client got a complete answer (a finish_reason -- "abort" for the aborted
--, usage and [DONE]): none is lost without one."""

import asyncio
import signal
from collections import Counter

import httpx
from conftest import ServerProcess, body, client, requires_smollm2, start_streams

from pagoda.benchmarks.load import scrape

CLIENTS, MAX_TOKENS, DRAIN_S = 30, 24, 5


async def sigterm_mid_crowd(server):
    """(every client's output, whether a new connection was refused after
    the signal)."""
    async with client() as crowd:
        streams = start_streams(crowd, server.url, [body(i, MAX_TOKENS) for i in range(CLIENTS)])
        while True:  # mid-way: some requests generate, others wait for a sequence
            metrics = await scrape(crowd, server.url)
            if metrics["pagoda:generation_tokens_total"] and metrics["pagoda:num_requests_waiting"]:
                break
            assert not any(s.done() for s in streams), "a request ended before the signal"
            await asyncio.sleep(0.05)
        server.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.5)
        try:
            async with httpx.AsyncClient() as newcomer:
                await newcomer.get(server.url + "/health")
            refused = False
        except httpx.TransportError:
            refused = True
        return await asyncio.gather(*streams), refused


@requires_smollm2
def test_sigterm_under_load_answers_every_client_and_exits_0():
    server = ServerProcess("--max-num-seqs", "8", "--timeout-graceful-shutdown", str(DRAIN_S))
    try:
        outputs, refused = asyncio.run(sigterm_mid_crowd(server))
        exit_code = server.proc.wait(60)
        log = server.output()
    finally:
        server.stop()
    assert refused, "a new connection was accepted after SIGTERM"
    assert exit_code == 0, log
    assert [o.error for o in outputs if not o.success] == [], log  # every stream ended well-formed
    reasons = Counter(o.finish_reason for o in outputs)
    assert set(reasons) <= {"length", "abort"}, reasons
    assert all(o.output_tokens == MAX_TOKENS for o in outputs if o.finish_reason == "length")
    assert "Traceback" not in log, log
