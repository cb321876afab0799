"""The engine's stats as Prometheus metrics for a server's /metrics: vLLM's
`vllm:*` set under Pagoda's own prefix `pagoda:`, all labelled model_name.

Two sources, so every number is current:
  - record(stats), called by AsyncLLM with each step's IterationStats (and
    each abort's): token counters, TTFT at a request's first token, and at
    its finish the finish reason, latencies and token counts;
  - a collector read at scrape time: running/waiting requests, KV cache
    usage and blocks, prefix-cache queries/hits, preemptions (the engine
    core's SchedulerStats after its latest step, so an idle engine shows 0),
    and this process's resident memory.
Each PrometheusStatLogger has its own CollectorRegistry: several servers in
one process (tests) do not clash.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pagoda.engine.output_processor import REASON_ORDER, IterationStats

# vLLM's buckets (seconds).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class PrometheusStatLogger:
    def __init__(self, engine, model_name: str, registry: CollectorRegistry | None = None):
        """engine: the AsyncLLM whose state the collector reads."""
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry

        def counter(name, doc, extra=()):
            return Counter(name, doc, labels + list(extra), registry=r)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.prompt_tokens = counter("pagoda:prompt_tokens_total", "Prefill tokens processed.").labels(model_name)
        self.generation_tokens = counter("pagoda:generation_tokens_total",
                                         "Generation tokens produced.").labels(model_name)
        self.request_success = counter("pagoda:request_success_total", "Finished requests, by finish reason.",
                                       ["finished_reason"])
        for reason in REASON_ORDER:  # every series exists from the start, at 0
            self.request_success.labels(model_name, reason)
        self.request_failure = counter("pagoda:request_failure_total",
                                       "Requests the server refused or failed, by HTTP status.", ["status"])
        self.time_to_first_token = histogram("pagoda:time_to_first_token_seconds",
                                             "Time to first token (arrival to first token).", TTFT_BUCKETS)
        self.time_per_output_token = histogram(
            "pagoda:time_per_output_token_seconds",
            "Mean time per output token after the first, per finished request.", TPOT_BUCKETS)
        self.e2e_latency = histogram("pagoda:e2e_request_latency_seconds",
                                     "End-to-end request latency (arrival to finish).", LATENCY_BUCKETS)
        self.queue_time = histogram("pagoda:request_queue_time_seconds",
                                    "Time waiting before first scheduled.", LATENCY_BUCKETS)
        self.prefill_time = histogram("pagoda:request_prefill_time_seconds",
                                      "First scheduled to first token.", LATENCY_BUCKETS)
        self.decode_time = histogram("pagoda:request_decode_time_seconds",
                                     "First token to last token.", LATENCY_BUCKETS)
        max_len = engine.model_config.max_model_len
        self.request_prompt_tokens = histogram("pagoda:request_prompt_tokens", "Prompt tokens per finished request.",
                                               build_1_2_5_buckets(max_len))
        self.request_generation_tokens = histogram(
            "pagoda:request_generation_tokens", "Generated tokens per finished request (all n completions).",
            build_1_2_5_buckets(max_len * 16))
        self.registry.register(_EngineStateCollector(engine, model_name))

    def record(self, stats: IterationStats) -> None:
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_generation_tokens)
        for ttft in stats.time_to_first_tokens:
            self.time_to_first_token.observe(ttft)
        for finished in stats.finished:
            self.request_success.labels(self.model_name, finished.finish_reason).inc()
            self.request_prompt_tokens.observe(finished.num_prompt_tokens)
            self.request_generation_tokens.observe(finished.num_generation_tokens)
            t = finished.metrics.timings()
            self.e2e_latency.observe(t["total_s"])
            self.queue_time.observe(t["queue_s"])
            self.prefill_time.observe(t["prefill_s"])
            self.decode_time.observe(t["decode_s"])
            if finished.max_completion_tokens > 1:  # completions decode side by side: per-sequence time per token
                self.time_per_output_token.observe(t["decode_s"] / (finished.max_completion_tokens - 1))

    def record_failure(self, status: int) -> None:
        self.request_failure.labels(self.model_name, str(status)).inc()


class _EngineStateCollector(Collector):
    """Values read at scrape time from the engine core's latest stats."""

    def __init__(self, engine, model_name: str):
        self.engine, self.model_name = engine, model_name

    def collect(self):
        stats = self.engine.scheduler_stats
        labels = [self.model_name]

        def family(kind, name, doc, value):
            metric = kind(name, doc, labels=["model_name"])
            metric.add_metric(labels, value)
            return metric

        yield family(GaugeMetricFamily, "pagoda:num_requests_running", "Sequences in the running batch.",
                     stats.num_running)
        yield family(GaugeMetricFamily, "pagoda:num_requests_waiting", "Sequences waiting to be scheduled.",
                     stats.num_waiting)
        yield family(GaugeMetricFamily, "pagoda:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).",
                     stats.kv_cache_usage)
        # Exact counts beside the fraction: an idle engine must hold 0 blocks
        # (a leak shows as used blocks with nothing running). Blocks kept
        # only by the prefix cache are free: any allocation may reuse them.
        yield family(GaugeMetricFamily, "pagoda:kv_cache_total_blocks", "KV cache blocks in the pool.",
                     stats.num_blocks)
        yield family(GaugeMetricFamily, "pagoda:kv_cache_used_blocks",
                     "KV cache blocks held by requests (prefix-cached blocks nobody holds count as free).",
                     stats.num_used_blocks)
        yield family(CounterMetricFamily, "pagoda:prefix_cache_queries",
                     "Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries)
        yield family(CounterMetricFamily, "pagoda:prefix_cache_hits",
                     "Prompt tokens served from the prefix cache.", stats.prefix_cache_hits)
        yield family(CounterMetricFamily, "pagoda:num_preemptions", "Preemptions (recomputation) so far.",
                     stats.num_preemptions)
        rss = resident_memory_bytes()
        if rss is not None:
            yield family(GaugeMetricFamily, "pagoda:process_resident_memory_bytes",
                         "Resident memory of the server process (growth under load is a leak).", rss)
        core_pid = self.engine.core_pid
        core_rss = None if core_pid is None else resident_memory_bytes(core_pid)
        if core_rss is not None:
            yield family(GaugeMetricFamily, "pagoda:engine_core_resident_memory_bytes",
                         "Resident memory of the engine-core process.", core_rss)


def resident_memory_bytes(pid: int | str = "self") -> int | None:
    """A process's resident set size from /proc (None where there is no
    /proc): what prometheus_client's process collector reports as
    process_resident_memory_bytes, here under the pagoda: prefix every
    metric of this registry has."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None
