"""`pagoda bench serve` (vLLM's benchmarks/serve.py): streams a random
workload to a running OpenAI-compatible server and reports vLLM's metrics.

Requests go to --endpoint (/v1/completions) as token-id prompts with
stream=True and stream_options.include_usage, sent at --request-rate (inf:
all at once; otherwise gaps drawn from a gamma distribution, Poisson arrivals
at --burstiness 1) and at most --max-concurrency in flight. Token counts are
the server's usage numbers. vLLM's definitions, per successful request:
  TTFT  time from sending the request to the first streamed chunk
  TPOT  (E2EL - TTFT) / (output tokens - 1), for requests of > 1 token
  ITL   every gap between consecutive chunks (one entry per gap)
  E2EL  time from sending the request to its last chunk
and over the run: request throughput = completed / duration, output token
throughput = output tokens / duration, total token throughput = (input +
output tokens) / duration, duration from the first request sent to the last
response done."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime

from pagoda.benchmarks.datasets import (SampleRequest, add_dataset_args, get_dataset_spec, sample_requests,
                                       special_token_ids)
from pagoda.entrypoints.cli_args import positive_float, positive_int

METRICS = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
           "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}


@dataclass
class RequestFuncOutput:
    """One request's result (vLLM's name and fields; times in seconds), plus
    how it ended: its HTTP status (None: no response), the finish_reason of
    its last choice chunk, whether the client left on purpose
    (disconnected), and for a failure, error_kind: "http" (a status other
    than 200), "transport" (no response, or the connection broke), "event"
    (an error event in the stream) or "malformed" (the stream broke the
    protocol: bad JSON, or no finish_reason, usage or [DONE])."""

    success: bool = False
    generated_text: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""
    error_kind: str = ""
    status: int | None = None
    finish_reason: str | None = None
    disconnected: bool = False

    def fail(self, kind: str, error: str) -> RequestFuncOutput:
        self.error_kind, self.error = kind, error
        return self


async def async_request_openai_completions(session, url: str, payload: dict, headers: dict,
                                           disconnect_after: int | None = None) -> RequestFuncOutput:
    """Sends one streaming completion on an aiohttp session (client_session)
    and times its chunks. A failure is reported (error, error_kind), never
    raised. disconnect_after: close the connection after that many chunks
    with choices, as a client that goes away mid-stream would
    (output.disconnected says whether it did)."""
    import aiohttp

    output = RequestFuncOutput()
    started = most_recent = time.perf_counter()
    chunks, usage, done = 0, None, False
    try:
        async with session.post(url, json=payload, headers=headers) as response:
            output.status = response.status
            if response.status != 200:
                text = (await response.read()).decode(errors="replace")[:500]
                return output.fail("http", f"HTTP {response.status}: {text}")
            async for line in response.content:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue  # blank separators, SSE comments
                data = line[len(b"data:"):].strip()
                if data == b"[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return output.fail("event", f"error event: {chunk['error']}")
                if chunk.get("choices"):
                    # A chunk may carry no text (a token held back, e.g. part
                    # of a character); it still marks a token's arrival.
                    timestamp = time.perf_counter()
                    if not chunks:
                        output.ttft = timestamp - started
                    else:
                        output.itl.append(timestamp - most_recent)
                    most_recent = timestamp
                    chunks += 1
                    choice = chunk["choices"][0]
                    output.generated_text += choice.get("text") or ""
                    output.finish_reason = choice.get("finish_reason") or output.finish_reason
                    if chunks == disconnect_after and output.finish_reason is None:
                        output.disconnected = True
                        response.close()
                        return output
                elif chunk.get("usage"):
                    usage = chunk["usage"]
                    output.prompt_len = usage.get("prompt_tokens") or 0
                    output.output_tokens = usage.get("completion_tokens") or 0
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return output.fail("transport", f"{type(exc).__name__}: {exc}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return output.fail("malformed", f"a chunk is not JSON: {exc}")
    if not chunks:
        return output.fail("malformed", "never received a chunk with choices to time the first token")
    if output.finish_reason is None:
        return output.fail("malformed", "no chunk carried a finish_reason")
    if usage is None:
        return output.fail("malformed", "the stream carried no usage: the server must support "
                                        "stream_options.include_usage")
    if not done:
        return output.fail("malformed", "the stream ended without data: [DONE]")
    output.success = True
    output.latency = most_recent - started
    return output


def completion_payload(model: str, request: SampleRequest, temperature: float, ignore_eos: bool, **extra) -> dict:
    """The streamed /v1/completions body of a workload request: its text
    when it has one, else its ids (extra: more request fields)."""
    prompt = request.prompt_token_ids if request.prompt is None else request.prompt
    return dict(model=model, prompt=prompt, max_tokens=request.expected_output_len,
                temperature=temperature, stream=True, stream_options=dict(include_usage=True),
                ignore_eos=ignore_eos, **extra)


def client_session(timeout_s: float):
    """The benchmarks' HTTP client: aiohttp, as vLLM's benchmark uses (a
    client must not be what limits a server: httpx parses about a third as
    many chunks per second). timeout_s bounds each wait (connect, or the
    gap between two chunks), not a whole stream: a stalled server fails the
    request, a long one runs."""
    import aiohttp

    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s),
                                 connector=aiohttp.TCPConnector(limit=0), read_bufsize=1 << 20)


async def check_first_request(session, url: str, payload: dict, headers: dict) -> None:
    """vLLM's initial test run: one request, not timed, to fail fast on a
    wrong URL, model name or length."""
    test = await async_request_openai_completions(session, url, payload, headers)
    if not test.success:
        raise ValueError(f"the initial test request to {url} failed; check the benchmark's flags: {test.error}")


async def get_request(requests: list, request_rate: float, burstiness: float, rng: random.Random):
    """vLLM's arrival process: gaps from a gamma distribution of mean
    1/request_rate (shape = burstiness: 1 is Poisson, lower is burstier)."""
    theta = 1.0 / (request_rate * burstiness)
    for request in requests:
        yield request
        if request_rate != float("inf"):
            await asyncio.sleep(rng.gammavariate(burstiness, theta))


def calculate_metrics(outputs: list[RequestFuncOutput], duration: float, percentiles: list[float]) -> dict:
    """vLLM's calculate_metrics: throughputs over the run and mean, median,
    std and percentiles (ms) of TTFT, TPOT, ITL, E2EL over successful requests."""
    import numpy as np

    done = [o for o in outputs if o.success]
    values = {
        "ttft": [o.ttft for o in done],
        "tpot": [(o.latency - o.ttft) / (o.output_tokens - 1) for o in done if o.output_tokens > 1],
        "itl": [gap for o in done for gap in o.itl],
        "e2el": [o.latency for o in done],
    }
    total_input = sum(o.prompt_len for o in done)
    total_output = sum(o.output_tokens for o in done)
    metrics = dict(
        duration=duration, completed=len(done), failed=len(outputs) - len(done), total_input_tokens=total_input,
        total_output_tokens=total_output, request_throughput=len(done) / duration,
        output_throughput=total_output / duration, total_token_throughput=(total_input + total_output) / duration,
    )
    for name, xs in values.items():
        ms = np.array(xs or [0.0]) * 1000  # vLLM reports 0 for a metric with no samples
        metrics[f"mean_{name}_ms"] = float(ms.mean())
        metrics[f"median_{name}_ms"] = float(np.median(ms))
        metrics[f"std_{name}_ms"] = float(ms.std())
        for p in percentiles:
            metrics[f"p{_p_word(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return metrics


def _p_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def print_metrics(metrics: dict, selected: list[str], percentiles: list[float], max_concurrency: int | None) -> None:
    """vLLM's result table."""
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    print("{:<40} {:<10}".format("Successful requests:", metrics["completed"]))
    if metrics["failed"]:
        print("{:<40} {:<10}".format("Failed requests:", metrics["failed"]))
    if max_concurrency is not None:
        print("{:<40} {:<10}".format("Maximum request concurrency:", max_concurrency))
    print("{:<40} {:<10.2f}".format("Benchmark duration (s):", metrics["duration"]))
    print("{:<40} {:<10}".format("Total input tokens:", metrics["total_input_tokens"]))
    print("{:<40} {:<10}".format("Total generated tokens:", metrics["total_output_tokens"]))
    print("{:<40} {:<10.2f}".format("Request throughput (req/s):", metrics["request_throughput"]))
    print("{:<40} {:<10.2f}".format("Output token throughput (tok/s):", metrics["output_throughput"]))
    print("{:<40} {:<10.2f}".format("Total Token throughput (tok/s):", metrics["total_token_throughput"]))
    for name in selected:
        short, header = METRICS[name]
        print("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        print("{:<40} {:<10.2f}".format(f"Mean {short} (ms):", metrics[f"mean_{name}_ms"]))
        print("{:<40} {:<10.2f}".format(f"Median {short} (ms):", metrics[f"median_{name}_ms"]))
        for p in percentiles:
            print("{:<40} {:<10.2f}".format(f"P{_p_word(p)} {short} (ms):", metrics[f"p{_p_word(p)}_{name}_ms"]))
    print("=" * 50)


async def benchmark(base_url: str, endpoint: str, model: str, requests: list, request_rate: float,
                    burstiness: float, max_concurrency: int | None, ignore_eos: bool, temperature: float,
                    seed: int, api_key: str | None = None, use_tqdm: bool = True,
                    timeout_s: float = 600.0) -> tuple[list[RequestFuncOutput], float]:
    """Runs the workload; returns every request's output and the duration."""
    from tqdm import tqdm

    url = base_url.rstrip("/") + endpoint
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def payload(request) -> dict:
        return completion_payload(model, request, temperature, ignore_eos)

    async with client_session(timeout_s) as session:
        await check_first_request(session, url, payload(requests[0]), headers)

        semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = tqdm(total=len(requests), desc="requests", dynamic_ncols=True, disable=not use_tqdm)

        async def send(request) -> RequestFuncOutput:
            if semaphore is None:
                output = await async_request_openai_completions(session, url, payload(request), headers)
            else:
                async with semaphore:
                    output = await async_request_openai_completions(session, url, payload(request), headers)
            bar.update(1)
            return output

        started = time.perf_counter()
        tasks = []
        async for request in get_request(requests, request_rate, burstiness, random.Random(seed)):
            tasks.append(asyncio.create_task(send(request)))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
        bar.close()
    return list(outputs), duration


def _served_model(client_url: str, api_key: str | None) -> dict:
    """The first model card of GET /v1/models (id, root, max_model_len)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(client_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
        response.raise_for_status()
        card = response.json()["data"][0]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"could not list the models of {client_url} (GET /v1/models): {exc}") from None
    return card


def _vocabulary(candidates: list[str | None]) -> tuple[int, set[int], str]:
    """(vocab size, special ids, path) from the first candidate that is a
    local model (HF folder or .gguf): random prompts need the vocabulary."""
    from pagoda.config import ModelConfig

    for path in candidates:
        if path and os.path.exists(path):
            config = ModelConfig(path, device="cpu").hf_config  # the config only: no GPU use here
            return config.vocab_size, special_token_ids(config), path
    raise ValueError("random prompts need the model's vocabulary: pass --tokenizer with the served model's "
                     "folder or .gguf file")


@dataclass(frozen=True)
class Server:
    """A running server as a benchmark drives it: its URL, the model name
    requests use, that model's vocabulary (for random prompts) and context
    length (None when the server does not say)."""

    url: str
    model: str
    vocab_size: int
    special_ids: frozenset[int]
    vocab_source: str
    api_key: str | None
    max_model_len: int | None

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def server_url(args: argparse.Namespace) -> str:
    """The URL add_server_args' flags name."""
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


def find_server(args: argparse.Namespace, url: str) -> Server:
    """The server at url, its model (--model or its first) and vocabulary."""
    card = _served_model(url, args.api_key)
    vocab, special, vocab_source = _vocabulary([args.tokenizer, args.model, card.get("root")])
    return Server(url, args.model or card["id"], vocab, frozenset(special), vocab_source, args.api_key,
                  card.get("max_model_len"))


def add_server_args(parser: argparse.ArgumentParser):
    """Flags that find a running server and its model; returns their group."""
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000 (default: from --host/--port)")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=positive_int, default=8000)
    server.add_argument("--model", default=None, help="served model name (default: the server's first)")
    server.add_argument("--tokenizer", default=None,
                        help="the served model's folder or .gguf, for its vocabulary (default: --model, or the "
                             "server's model path when it exists here)")
    server.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="also OPENAI_API_KEY")
    server.add_argument("--request-timeout", type=positive_float, default=600.0,
                        help="seconds to wait for a connection or for the next chunk")
    return server


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_server_args(parser).add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions"])
    add_dataset_args(parser)
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=positive_float, default=float("inf"),
                      help="requests per second (inf: all at once; otherwise Poisson arrivals)")
    load.add_argument("--burstiness", type=positive_float, default=1.0,
                      help="gamma shape of the arrival gaps: 1 = Poisson, < 1 burstier, > 1 more uniform")
    load.add_argument("--max-concurrency", type=positive_int, default=None, help="most requests in flight")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--ignore-eos", action="store_true", help="generate exactly each request's output length")
    load.add_argument("--temperature", type=float, default=0.0)
    report = parser.add_argument_group("report")
    report.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                        help=f"comma-separated, from {','.join(METRICS)}")
    report.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    report.add_argument("--save-result", action="store_true", help="write the results as JSON")
    report.add_argument("--result-dir", default=None)
    report.add_argument("--result-filename", "--result-file", dest="result_filename", default=None)
    report.add_argument("--disable-tqdm", action="store_true")


def _parse_list(text: str, flag: str, convert, allowed=None) -> list:
    items = [item.strip() for item in text.split(",") if item.strip()]
    try:
        values = [convert(item) for item in items]
    except ValueError:
        values = None
    if not values or (allowed is not None and any(v not in allowed for v in values)):
        raise ValueError(f"{flag} must be a comma-separated list{f' from {sorted(allowed)}' if allowed else ''}, "
                         f"got {text!r}")
    return values


def main(args: argparse.Namespace) -> dict:
    selected = _parse_list(args.percentile_metrics, "--percentile-metrics", str, set(METRICS))
    percentiles = _parse_list(args.metric_percentiles, "--metric-percentiles", float)
    if any(not 0 < p <= 100 for p in percentiles):
        raise ValueError(f"--metric-percentiles must be in (0, 100], got {args.metric_percentiles!r}")
    spec = get_dataset_spec(args)
    server = find_server(args, server_url(args))
    base_url, model = server.url, server.model
    requests = sample_requests(args, spec, server.vocab_size, server.special_ids)
    ignore_eos = args.ignore_eos or spec.ignore_eos
    print(f"bench serve: {base_url}{args.endpoint} model {model}; {spec.describe()}; request rate "
          f"{args.request_rate}, max concurrency {args.max_concurrency}, ignore_eos {ignore_eos}")
    outputs, duration = asyncio.run(benchmark(
        base_url, args.endpoint, model, requests, args.request_rate, args.burstiness, args.max_concurrency,
        ignore_eos, args.temperature, args.seed, args.api_key, use_tqdm=not args.disable_tqdm,
        timeout_s=args.request_timeout))
    metrics = calculate_metrics(outputs, duration, percentiles)
    print_metrics(metrics, selected, percentiles, args.max_concurrency)
    errors = [o.error for o in outputs if not o.success]
    if errors:
        print(f"first error of {len(errors)}: {errors[0]}")
    result = dict(
        date=datetime.now().strftime("%Y%m%d-%H%M%S"), backend="openai", endpoint=args.endpoint, model_id=model,
        tokenizer_id=server.vocab_source, dataset=asdict(spec), num_prompts=len(requests),
        request_rate=args.request_rate if args.request_rate != float("inf") else "inf", burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, ignore_eos=ignore_eos, **metrics,
        input_lens=[o.prompt_len for o in outputs], output_lens=[o.output_tokens for o in outputs],
        ttfts=[o.ttft for o in outputs], itls=[o.itl for o in outputs], e2els=[o.latency for o in outputs],
        errors=[o.error for o in outputs],
    )
    if args.save_result or args.result_filename:
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        name = args.result_filename or (f"openai-{result['request_rate']}qps{concurrency}-"
                                        f"{os.path.basename(model)}-{result['date']}.json")
        path = os.path.join(args.result_dir, name) if args.result_dir else name
        if args.result_dir:
            os.makedirs(args.result_dir, exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"results written to {path}")
    return result
