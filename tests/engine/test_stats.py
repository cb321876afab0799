"""The periodic stats line (pagoda.metrics.StatLogger): its fields, numbers
that add up to the work done, silence while idle, and the AsyncLLM default."""

import asyncio
import logging
import re
import time

import pytest

from pagoda import LLM, SamplingParams
from pagoda.core.scheduler import ScheduledRequest, SchedulerOutput
from pagoda.engine.async_llm import AsyncLLM
from pagoda.engine.core_messages import SchedulerStats
from pagoda.metrics import StatLogger

LINE = re.compile(
    r"Avg prompt throughput: (?P<prompt>[\d.]+) tokens/s, Avg generation throughput: (?P<gen>[\d.]+) tokens/s, "
    r"Running: (?P<running>\d+) reqs, Waiting: (?P<waiting>\d+) reqs, KV cache usage: (?P<kv>[\d.]+)%"
    r"(, Prefix cache hit rate: (?P<hit>[\d.]+)%)?$"
)
PROMPTS = [[5, 9, 200, 17], [1], list(range(30, 47)), [250, 3], [7] * 30]


class ListHandler(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def stats_lines():
    """The stats logger's messages, caught on its own logger (whatever the
    'pagoda' hierarchy's propagation, each line is seen once)."""
    logger, handler = logging.getLogger("pagoda.metrics"), ListHandler()
    logger.addHandler(handler)
    yield lambda: list(handler.messages)
    logger.removeHandler(handler)


@pytest.fixture(scope="module")
def folder(make_checkpoint):
    return make_checkpoint("llama")[1]


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def core_stats(queries=0, hits=0, prefix_caching=True):
    """The core's state after a step, as it sends it."""
    return SchedulerStats(num_running=2, num_waiting=1, kv_cache_usage=0.25, prefix_cache_queries=queries,
                          prefix_cache_hits=hits, prefix_caching=prefix_caching)


def chunk(start, num, num_prompt_tokens):
    return ScheduledRequest("r", list(range(num)), start, [], start + num >= num_prompt_tokens, num_prompt_tokens)


def test_line_fields_and_interval_arithmetic(stats_lines):
    clock = FakeClock()
    stats = StatLogger(interval=10.0, clock=clock)
    # A 30-token prompt in chunks of 20 and 10 (the last samples), then decodes;
    # the core's cumulative prefix counters reach 200 queries, 100 hits.
    clock.now = 4.0
    stats.record(SchedulerOutput([chunk(0, 20, 30)]), 0, core_stats(100, 10))
    clock.now = 8.0
    stats.record(SchedulerOutput([chunk(20, 10, 30)]), 1, core_stats(150, 60))
    assert stats_lines() == []  # not yet 10 s
    clock.now = 10.0
    stats.record(SchedulerOutput([chunk(30, 1, 30), chunk(5, 1, 5)]), 2, core_stats(200, 100))
    [line] = stats_lines()
    m = LINE.match(line)
    assert m, line
    assert float(m["prompt"]) == 3.0 and float(m["gen"]) == 0.3  # 30 prompt, 3 generated tokens in 10 s
    assert (m["running"], m["waiting"], m["kv"], m["hit"]) == ("2", "1", "25.0", "50.0")
    # Idle for a minute, then 5 s of work: the average covers the work only.
    clock.now = 70.0
    stats.record(SchedulerOutput([chunk(30, 1, 30)]), 1, core_stats(200, 100))
    clock.now = 80.0
    stats.record(SchedulerOutput([chunk(31, 1, 30)]), 1, core_stats(200, 100))
    assert len(stats_lines()) == 2
    assert stats.last_stats.generation_throughput == pytest.approx(0.2)
    assert stats.last_stats.prefix_cache_hit_rate == 0.0  # no lookups this interval


def test_no_hit_rate_without_prefix_caching(stats_lines):
    stats = StatLogger(interval=1.0, clock=FakeClock())
    assert stats.log().prefix_cache_hit_rate is None  # before any step
    stats.record(SchedulerOutput([chunk(0, 3, 3)]), 1, core_stats(prefix_caching=False))
    line = stats.log().format()
    assert LINE.match(line) and "Prefix cache" not in line


def test_offline_engine_counts_every_token(folder, stats_lines):
    llm = LLM(folder, dtype="float32", kv_cache_space=0.05, max_num_batched_tokens=16)
    core = llm.llm_engine.core
    assert core.stat_logger is None  # off by default, as vLLM's disable_log_stats=True
    clock = FakeClock()
    stats = core.stat_logger = StatLogger(interval=1e9, clock=clock)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm.generate(PROMPTS, params, use_tqdm=False)
    assert stats_lines() == []
    clock.now = 2.0
    result = stats.log()
    assert result.prompt_throughput * 2.0 == sum(map(len, PROMPTS))  # chunked (16-token budget), all counted once
    assert result.generation_throughput * 2.0 == 6 * len(PROMPTS)
    assert (result.num_running, result.num_waiting, result.kv_cache_usage) == (0, 0, 0.0)
    assert LINE.match(stats_lines()[-1])


def test_flag_turns_it_on_for_llm(folder):
    llm = LLM(folder, dtype="float32", kv_cache_space=0.05, disable_log_stats=False)
    stat_logger = llm.llm_engine.core.stat_logger
    assert isinstance(stat_logger, StatLogger) and stat_logger.interval == 10.0


def test_async_llm_logs_by_default_while_busy(folder, stats_lines, monkeypatch):
    llm = AsyncLLM(folder, dtype="float32", kv_cache_space=0.05, stats_interval=0.1)
    execute = llm.engine.runner.execute

    def slow(*args, **kwargs):
        time.sleep(0.01)
        return execute(*args, **kwargs)

    monkeypatch.setattr(llm.engine.runner, "execute", slow)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    async def main():
        async def one(i, prompt):
            return [o async for o in llm.generate(prompt, params, f"r{i}")]

        await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS[:3])))

    try:
        asyncio.run(main())
        time.sleep(0.3)
        quiet = len(stats_lines())
        time.sleep(0.3)
        assert len(stats_lines()) == quiet  # idle: no lines
    finally:
        llm.shutdown()
    lines = stats_lines()
    assert len(lines) >= 2, lines
    matches = [LINE.match(line) for line in lines]
    assert all(matches), lines
    assert any(float(m["gen"]) > 0 for m in matches)
    assert all(int(m["running"]) <= 3 and 0 <= float(m["kv"]) <= 100 for m in matches)
    assert all(m["hit"] is not None for m in matches)  # prefix caching is on by default
