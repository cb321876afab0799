"""`pagoda bench load`: a crowd of streaming clients against a running
server on this machine, for a bounded time, then the server's state once
idle. It answers "does the server survive this, and lose nothing?".

--clients (200) clients each stream one /v1/completions request after
another until --duration seconds have passed (or a request got no response
at all: the server is gone), then finish the request in hand. Prompts are
token ids from the dataset flags; with the random dataset, unless given,
--random-range-ratio is 0.9 (mixed lengths) and --num-prompts 1000
(requests drawn in turn). Each request, drawn at random, either runs
normally, leaves mid-stream at a random chunk (--disconnect-fraction),
carries a server deadline timeout_seconds (--timeout-fraction), or gives up
on its own after a client-side timeout (--client-timeout-fraction); both
deadlines are drawn from --timeout-range.

After the run it waits (at most --settle-timeout) for the server to go
idle and reads its /metrics: KV blocks still held by requests (leaked: must
be 0), the growth of the server's resident memory since the warm-up
request, and peaks sampled during the run. It reports requests ok (by
finish reason), disconnects, client timeouts and failures by kind (HTTP
status, transport error, error event, malformed stream), and p50/p99 TTFT
and end-to-end latency of the requests that ended normally.

It exits 1 when a request got no complete answer (a transport error or a
malformed stream), a 5xx or an error event was seen, blocks leaked, or the
server did not go idle; 0 otherwise. Only loopback URLs are accepted."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import itertools
import json
import random
import sys
import time
import urllib.parse
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import datetime

from pagoda.benchmarks.datasets import (SampleRequest, add_dataset_args, get_dataset_spec, sample_requests,
                                       verify_fits)
from pagoda.benchmarks.serve import (RequestFuncOutput, Server, add_server_args, async_request_openai_completions,
                                     calculate_metrics, check_first_request, client_session, completion_payload,
                                     find_server, server_url)
from pagoda.entrypoints.cli_args import positive_float, positive_int

# Unless the flags say otherwise: lengths in [0.1x, 1.9x] the dataset's, and
# enough distinct prompts that repeats (prefix-cache hits) stay rare.
MIXED_RANGE_RATIO, NUM_PROMPTS = 0.9, 1000
SAMPLE_EVERY_S = 1.0  # /metrics scrapes during the run, for the peaks
PLANS = ("normal", "disconnect", "deadline", "client timeout")
# Outcomes that are no failure: an answer, or the client leaving on purpose.
ANSWERED, LEFT = "ok", ("disconnected", "client timeout")
LOST = ("transport error", "malformed stream")  # no complete answer


@dataclass(frozen=True)
class Plan:
    """One request: the workload's request and what the client does with it
    (kind: one of PLANS, with its chunk count or deadline)."""

    request: SampleRequest
    kind: str = "normal"
    disconnect_after: int | None = None
    timeout_seconds: float | None = None
    client_timeout: float | None = None


@dataclass
class Record:
    kind: str
    outcome: str  # "ok", LEFT, or a failure: "HTTP <status>", "error event", LOST
    output: RequestFuncOutput


def draw_plan(rng: random.Random, request: SampleRequest, args: argparse.Namespace) -> Plan:
    low, high = args.timeout_range
    draw = rng.random()
    for kind, fraction in zip(PLANS[1:], (args.disconnect_fraction, args.timeout_fraction,
                                          args.client_timeout_fraction)):
        if draw < fraction:
            break
        draw -= fraction
    else:
        return Plan(request)
    if kind == "disconnect":
        return Plan(request, kind, disconnect_after=rng.randint(1, max(1, request.expected_output_len - 1)))
    deadline = round(rng.uniform(low, high), 3)
    if kind == "deadline":
        return Plan(request, kind, timeout_seconds=deadline)
    return Plan(request, kind, client_timeout=deadline)


def outcome(output: RequestFuncOutput, timed_out: bool) -> str:
    if timed_out:
        return "client timeout"
    if output.success:
        return "ok"
    if output.disconnected:
        return "disconnected"
    return {"http": f"HTTP {output.status}", "event": "error event", "transport": "transport error",
            "malformed": "malformed stream"}[output.error_kind]


def is_server_error(outcome_name: str) -> bool:
    """A 5xx, or an error event (the server failed a stream it had accepted)."""
    return outcome_name == "error event" or outcome_name.startswith("HTTP 5")


def require_loopback(url: str) -> None:
    """This tool sends a crowd of requests: only to a server on this machine."""
    host = urllib.parse.urlsplit(url).hostname
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host or "").is_loopback
    except ValueError:  # a host name: it could resolve anywhere
        loopback = False
    if not loopback:
        raise ValueError(f"bench load drives only a server on this machine: {url} is not a loopback address "
                         f"(use 127.0.0.1, [::1] or localhost)")


async def scrape(session, url: str, headers: dict | None = None) -> dict[str, float]:
    """The /metrics of the server at url as {name: value} (one model: no
    labels needed)."""
    from prometheus_client.parser import text_string_to_metric_families

    async with session.get(url + "/metrics", headers=headers) as response:
        response.raise_for_status()
        text = await response.text()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    missing = [name for name in ("pagoda:kv_cache_used_blocks", "pagoda:num_requests_running",
                                 "pagoda:num_requests_waiting") if name not in values]
    if missing:
        raise ValueError(f"{url}/metrics has no {', '.join(missing)}: bench load needs a Pagoda server "
                         f"recent enough to report its KV blocks")
    return values


def busy(metrics: dict[str, float]) -> bool:
    return bool(metrics["pagoda:num_requests_running"] or metrics["pagoda:num_requests_waiting"]
                or metrics["pagoda:kv_cache_used_blocks"])


async def settle(session, url: str, timeout: float, headers: dict | None = None) -> tuple[dict[str, float], float]:
    """(/metrics once the server holds no request and no block, or at the
    timeout; seconds waited): aborts and frees happen in the engine thread
    after the clients are gone."""
    started = time.monotonic()
    while True:
        metrics = await scrape(session, url, headers)
        waited = time.monotonic() - started
        if not busy(metrics) or waited >= timeout:
            return metrics, waited
        await asyncio.sleep(0.1)


async def run_load(server: Server, requests: list[SampleRequest], args: argparse.Namespace) -> dict:
    """Drives the load; returns the report (see summarize)."""
    import aiohttp

    url = server.url + "/v1/completions"
    pool = itertools.cycle(requests)
    records: list[Record] = []
    peaks: Counter = Counter()

    def payload(plan: Plan) -> dict:
        extra = {} if plan.timeout_seconds is None else dict(timeout_seconds=plan.timeout_seconds)
        return completion_payload(server.model, plan.request, args.temperature, args.ignore_eos, **extra)

    async with client_session(args.request_timeout) as client:
        await check_first_request(client, url, payload(Plan(requests[0])), server.headers)  # also warms up
        before, _ = await settle(client, server.url, args.settle_timeout, server.headers)
        stop_at = time.monotonic() + args.duration
        gone = asyncio.Event()  # a request got no response at all: more would only repeat that

        async def run_client(index: int) -> None:
            rng = random.Random(f"{args.seed}:{index}")
            while time.monotonic() < stop_at and not gone.is_set():
                plan = draw_plan(rng, next(pool), args)
                send = async_request_openai_completions(client, url, payload(plan), server.headers,
                                                        plan.disconnect_after)
                timed_out = False
                if plan.client_timeout is None:
                    output = await send
                else:
                    try:
                        output = await asyncio.wait_for(send, plan.client_timeout)
                    except TimeoutError:
                        output, timed_out = RequestFuncOutput(), True
                records.append(Record(plan.kind, outcome(output, timed_out), output))
                if output.error_kind == "transport" and output.status is None:
                    gone.set()

        async def sample() -> None:
            while True:
                await asyncio.sleep(SAMPLE_EVERY_S)
                try:
                    metrics = await scrape(client, server.url, server.headers)
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    continue  # the clients' own errors say what went wrong
                for name in ("pagoda:kv_cache_used_blocks", "pagoda:num_requests_running",
                             "pagoda:num_requests_waiting", "pagoda:process_resident_memory_bytes"):
                    peaks[name] = max(peaks[name], metrics.get(name, 0.0))

        started = time.perf_counter()
        sampler = asyncio.create_task(sample())
        try:
            await asyncio.gather(*(run_client(i) for i in range(args.clients)))
        finally:
            sampler.cancel()
        elapsed = time.perf_counter() - started
        try:
            after, waited = await settle(client, server.url, args.settle_timeout, server.headers)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:  # the server died: still report what the clients saw
            after, waited = dict(unreachable=f"{type(exc).__name__}: {exc}"), 0.0
    return summarize(records, elapsed, before, after, waited, peaks)


def summarize(records: list[Record], elapsed: float, before: dict, after: dict, settle_s: float,
              peaks: Counter) -> dict:
    """The report: counts by plan and outcome, what failed the run
    (problems), the server's state once idle (after: its /metrics, or
    {"unreachable": why}) and the latencies of requests that ended normally
    (stop or length), in ms."""
    outcomes = Counter(r.outcome for r in records)
    ok = [r.output for r in records if r.outcome == ANSWERED]
    failed = {name: n for name, n in outcomes.items() if name != ANSWERED and name not in LEFT}
    lost = sum(outcomes[name] for name in LOST)
    server_errors = sum(n for name, n in failed.items() if is_server_error(name))
    unreachable = after.get("unreachable")
    leaked = None if unreachable else int(after["pagoda:kv_cache_used_blocks"])
    still_busy = None if unreachable else int(after["pagoda:num_requests_running"]
                                               + after["pagoda:num_requests_waiting"])
    problems = [text for count, text in [
        (unreachable, f"GET /metrics failed after the run: {unreachable}"),
        (lost, f"{lost} requests got no complete answer"),
        (server_errors, f"{server_errors} requests failed on the server's side (5xx or error event)"),
        (leaked, f"{leaked} KV blocks leaked (held with no request left)"),
        (still_busy, f"{still_busy} requests still in the engine {settle_s:.1f} s after every client was gone"),
    ] if count]
    normal = [o for o in ok if o.finish_reason in ("stop", "length")]
    metrics = calculate_metrics(normal, elapsed, [50, 99])
    rss_before, rss_after = (m.get("pagoda:process_resident_memory_bytes") for m in (before, after))
    return dict(
        requests=len(records), ok=len(ok), failed=sum(failed.values()), lost=lost, server_errors=server_errors,
        disconnects=outcomes["disconnected"], client_timeouts=outcomes["client timeout"],
        planned=dict(Counter(r.kind for r in records)),
        finish_reasons=dict(Counter(o.finish_reason for o in ok)), failures=failed,
        first_errors=list(dict.fromkeys(r.output.error for r in records if r.outcome in failed))[:5],
        elapsed_s=elapsed, kv_cache_total_blocks=int(after.get("pagoda:kv_cache_total_blocks", 0)),
        kv_blocks_leaked=leaked, requests_left_in_engine=still_busy, settle_s=settle_s,
        peak_kv_blocks_used=int(peaks["pagoda:kv_cache_used_blocks"]),
        peak_requests_running=int(peaks["pagoda:num_requests_running"]),
        peak_requests_waiting=int(peaks["pagoda:num_requests_waiting"]),
        rss_before_bytes=rss_before, rss_after_bytes=rss_after,
        rss_growth_bytes=None if rss_before is None or rss_after is None else rss_after - rss_before,
        output_throughput=metrics["output_throughput"],
        **{f"{p}_{name}_ms": metrics[f"{p}_{name}_ms"] for name in ("ttft", "e2el") for p in ("p50", "p99")},
        problems=problems, passed=not problems,
    )


def print_report(report: dict) -> None:
    def line(label, value):
        print("{:<44} {}".format(label, value))

    mib = 2**20
    print("{s:{c}^{n}}".format(s=" Load Result ", n=60, c="="))
    line("Requests:", f"{report['requests']} in {report['elapsed_s']:.1f} s ({report['planned']})")
    line("Ok:", f"{report['ok']} {report['finish_reasons']}")
    line("Disconnects done / client timeouts:", f"{report['disconnects']} / {report['client_timeouts']}")
    line("Failed:", f"{report['failed']} {report['failures']}")
    line("Lost (no complete answer):", report["lost"])
    line("Server errors (5xx, error events):", report["server_errors"])
    if report["kv_blocks_leaked"] is not None:
        line("KV blocks leaked once idle:", f"{report['kv_blocks_leaked']} of {report['kv_cache_total_blocks']} "
                                            f"(waited {report['settle_s']:.1f} s for idle)")
    line("Peak KV blocks used / running / waiting:", f"{report['peak_kv_blocks_used']} / "
                                                     f"{report['peak_requests_running']} / "
                                                     f"{report['peak_requests_waiting']}")
    if report["rss_growth_bytes"] is not None:
        line("Server RSS before -> after (growth, MiB):", f"{report['rss_before_bytes'] / mib:.1f} -> "
                                                         f"{report['rss_after_bytes'] / mib:.1f} "
                                                         f"({report['rss_growth_bytes'] / mib:+.1f})")
    line("TTFT p50 / p99 (ms):", f"{report['p50_ttft_ms']:.1f} / {report['p99_ttft_ms']:.1f}")
    line("End-to-end p50 / p99 (ms):", f"{report['p50_e2el_ms']:.1f} / {report['p99_e2el_ms']:.1f}")
    line("Output token throughput (tok/s):", f"{report['output_throughput']:.1f}")
    for error in report["first_errors"]:
        print(f"  error: {error}")
    print("=" * 60)
    print("PASSED" if report["passed"] else "FAILED: " + "; ".join(report["problems"]))


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}")
    return value


def seconds_range(text: str) -> tuple[float, float]:
    try:
        low, high = (positive_float(part) for part in text.split(","))
    except (ValueError, argparse.ArgumentTypeError):
        low = high = None
    if low is None or low > high:
        raise argparse.ArgumentTypeError(f"must be LOW,HIGH seconds with 0 < LOW <= HIGH, got {text!r}")
    return low, high


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_server_args(parser)
    add_dataset_args(parser)
    load = parser.add_argument_group("load")
    load.add_argument("--clients", type=positive_int, default=200, help="concurrent streaming clients")
    load.add_argument("--duration", type=positive_float, default=60.0,
                      help="seconds during which clients start new requests")
    load.add_argument("--disconnect-fraction", type=fraction, default=0.3,
                      help="requests whose client disconnects at a random chunk")
    load.add_argument("--timeout-fraction", type=fraction, default=0.1,
                      help="requests with a server deadline (timeout_seconds)")
    load.add_argument("--client-timeout-fraction", type=fraction, default=0.05,
                      help="requests whose client gives up after a deadline of its own")
    load.add_argument("--timeout-range", type=seconds_range, default=(1.0, 10.0),
                      help="LOW,HIGH: both deadlines are drawn uniformly from this range of seconds (1,10)")
    load.add_argument("--settle-timeout", type=positive_float, default=30.0,
                      help="seconds to wait for the server to go idle before reading its KV blocks")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--ignore-eos", action="store_true", help="generate exactly each request's output length")
    load.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--output-json", default=None, help="write the report here")


def main(args: argparse.Namespace) -> dict:
    if args.disconnect_fraction + args.timeout_fraction + args.client_timeout_fraction > 1:
        raise ValueError("--disconnect-fraction, --timeout-fraction and --client-timeout-fraction add up to more "
                         "than 1")
    if args.dataset_name == "random":
        args.random_range_ratio = MIXED_RANGE_RATIO if args.random_range_ratio is None else args.random_range_ratio
        args.num_prompts = args.num_prompts or NUM_PROMPTS
    spec = get_dataset_spec(args)
    url = server_url(args)
    require_loopback(url)
    server = find_server(args, url)
    requests = sample_requests(args, spec, server.vocab_size, server.special_ids)
    if server.max_model_len is not None:  # a 400 for a request that cannot fit would hide real failures
        verify_fits(requests, server.max_model_len)
    print(f"bench load: {url} model {server.model}; {args.clients} clients for {args.duration:g} s; "
          f"{spec.describe()}; disconnect {args.disconnect_fraction:g}, server deadline {args.timeout_fraction:g}, "
          f"client deadline {args.client_timeout_fraction:g} ({args.timeout_range[0]:g}-{args.timeout_range[1]:g} s)")
    report = asyncio.run(run_load(server, requests, args))
    print_report(report)
    if args.output_json:
        result = dict(date=datetime.now().strftime("%Y%m%d-%H%M%S"), base_url=url, model_id=server.model,
                      dataset=asdict(spec), clients=args.clients, duration_s=args.duration,
                      disconnect_fraction=args.disconnect_fraction, timeout_fraction=args.timeout_fraction,
                      client_timeout_fraction=args.client_timeout_fraction, timeout_range=args.timeout_range,
                      seed=args.seed, **report)
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"report written to {args.output_json}")
    if not report["passed"]:
        sys.exit(1)
    return report
