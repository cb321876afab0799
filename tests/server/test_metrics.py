"""GET /metrics: Prometheus text whose numbers add up to the requests the
server saw (finish reasons, failures, tokens, latencies, gauges, prefix
cache), from a registry of its own per app."""

import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from conftest import MODEL, VOCAB_SIZE, slow_steps, wait_pool_full


def scrape(server) -> dict:
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def value(samples, name, **labels) -> float:
    return samples.get((name, frozenset(dict(model_name=MODEL, **labels).items())), 0.0)


def delta(before, after, name, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def complete(server, **body):
    r = httpx.post(server.url + "/v1/completions", json=dict(dict(model=MODEL, prompt=[5, 6, 7]), **body), timeout=30)
    return r


def test_every_metric_is_pagoda_and_labelled(server):
    samples = scrape(server)
    names = {name for name, _ in samples}
    assert all(name.startswith("pagoda:") for name in names), names
    for name in ("pagoda:num_requests_running", "pagoda:num_requests_waiting", "pagoda:kv_cache_usage_perc",
                 "pagoda:prefix_cache_queries_total", "pagoda:prefix_cache_hits_total", "pagoda:prompt_tokens_total",
                 "pagoda:generation_tokens_total", "pagoda:time_to_first_token_seconds_count",
                 "pagoda:time_per_output_token_seconds_count", "pagoda:e2e_request_latency_seconds_count",
                 "pagoda:request_queue_time_seconds_count"):
        assert name in names, name
    for reason in ("stop", "length", "abort", "timeout"):
        assert (("pagoda:request_success_total", frozenset(dict(model_name=MODEL, finished_reason=reason).items()))
                in samples)


def test_counters_and_histograms_add_up(server):
    wait_pool_full(server.engine)
    before = scrape(server)
    lengths = [complete(server, max_tokens=5, ignore_eos=True).json() for _ in range(2)]
    # Every token id stops it: finish_reason "stop" after one token.
    stopped = complete(server, max_tokens=5, stop_token_ids=list(range(VOCAB_SIZE))).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"
    timed_out = complete(server, max_tokens=100, ignore_eos=True, timeout_seconds=1e-6).json()
    assert timed_out["choices"][0]["finish_reason"] == "timeout"
    assert complete(server, temperature=-1).status_code == 400
    assert complete(server, model="gpt-9").status_code == 404
    after = scrape(server)

    assert delta(before, after, "pagoda:request_success_total", finished_reason="length") == 2
    assert delta(before, after, "pagoda:request_success_total", finished_reason="stop") == 1
    assert delta(before, after, "pagoda:request_success_total", finished_reason="timeout") == 1
    assert delta(before, after, "pagoda:request_failure_total", status="400") == 1
    assert delta(before, after, "pagoda:request_failure_total", status="404") == 1
    answered = lengths + [stopped, timed_out]
    generated = sum(r["usage"]["completion_tokens"] for r in answered)
    assert delta(before, after, "pagoda:generation_tokens_total") == generated
    # Prompts count once their first token exists (the timed-out one may have none).
    with_tokens = [r for r in answered if r["usage"]["completion_tokens"]]
    assert delta(before, after, "pagoda:prompt_tokens_total") == sum(r["usage"]["prompt_tokens"] for r in with_tokens)
    assert delta(before, after, "pagoda:time_to_first_token_seconds_count") == len(with_tokens)
    assert delta(before, after, "pagoda:e2e_request_latency_seconds_count") == 4
    assert delta(before, after, "pagoda:request_queue_time_seconds_count") == 4
    assert delta(before, after, "pagoda:time_per_output_token_seconds_count") == 2  # the two with 5 tokens
    assert delta(before, after, "pagoda:e2e_request_latency_seconds_sum") > 0
    assert delta(before, after, "pagoda:request_generation_tokens_sum") == generated
    # Idle again: gauges read now, not at the last step.
    assert value(after, "pagoda:num_requests_running") == 0 and value(after, "pagoda:num_requests_waiting") == 0
    assert value(after, "pagoda:kv_cache_usage_perc") == 0


def test_gauges_while_busy_and_abort_counted(server, monkeypatch):
    slow_steps(monkeypatch, server.engine)
    before = scrape(server)
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 100, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()  # held: a dropped line iterator closes the stream
        next(line for line in lines if line.startswith("data: "))
        busy = scrape(server)
    assert value(busy, "pagoda:num_requests_running") == 1
    assert 0 < value(busy, "pagoda:kv_cache_usage_perc") <= 1
    wait_pool_full(server.engine)
    after = scrape(server)
    assert delta(before, after, "pagoda:request_success_total", finished_reason="abort") == 1
    assert value(after, "pagoda:num_requests_running") == 0


def test_waiting_gauge(server, monkeypatch):
    """max_num_seqs=4: a fifth request waits."""
    slow_steps(monkeypatch, server.engine)
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 30, "ignore_eos": True}
    threads = [threading.Thread(target=complete, args=(server,), kwargs=body) for _ in range(5)]
    for t in threads:
        t.start()
    deadline, seen = time.monotonic() + 10, None
    while time.monotonic() < deadline:
        seen = scrape(server)
        if value(seen, "pagoda:num_requests_waiting") == 1:
            break
        time.sleep(0.02)
    for t in threads:
        t.join()
    assert value(seen, "pagoda:num_requests_waiting") == 1 and value(seen, "pagoda:num_requests_running") == 4


def test_prefix_cache_counters(server):
    before = scrape(server)
    prompt = [(7 * i) % 250 + 3 for i in range(40)]  # two full 16-token blocks to reuse
    for _ in range(2):
        assert complete(server, prompt=prompt, max_tokens=2).status_code == 200
    after = scrape(server)
    assert delta(before, after, "pagoda:prefix_cache_queries_total") >= 2 * 39
    assert delta(before, after, "pagoda:prefix_cache_hits_total") >= 32


def test_registries_are_per_app(server):
    """Several apps around one engine (and so in one process) do not clash."""
    from pagoda.entrypoints.openai.api_server import build_app

    apps = [build_app(server.engine, MODEL) for _ in range(2)]
    registries = [app.state.pagoda.metrics.registry for app in apps]
    assert registries[0] is not registries[1]
    try:
        assert complete(server, max_tokens=2, ignore_eos=True).status_code == 200
        counts = [r.get_sample_value("pagoda:request_success_total", dict(model_name=MODEL, finished_reason="length"))
                  for r in registries]
        assert counts == [1.0, 1.0]
    finally:
        for app in apps:
            server.engine.stat_loggers.remove(app.state.pagoda.metrics)
