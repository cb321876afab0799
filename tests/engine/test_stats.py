"""The periodic stats line (pagoda.metrics.StatLogger): its fields, numbers
that add up to the work done, silence while idle, and the AsyncLLM default."""

import asyncio
import logging
import re
import time
from types import SimpleNamespace

import pytest

from pagoda import LLM, SamplingParams
from pagoda.core.scheduler import ScheduledRequest, SchedulerOutput
from pagoda.engine.async_llm import AsyncLLM
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


def fake_engine(queries=0, hits=0, with_prefix_stats=True):
    kv = SimpleNamespace(usage=lambda: 0.25)
    if with_prefix_stats:
        kv.prefix_cache_stats = SimpleNamespace(queries=queries, hits=hits)
    return SimpleNamespace(kv_cache_manager=kv, scheduler=SimpleNamespace(running=[1, 2], waiting=[3]))


def chunk(start, num, num_prompt_tokens):
    return ScheduledRequest("r", list(range(num)), start, [], start + num >= num_prompt_tokens, num_prompt_tokens)


def test_line_fields_and_interval_arithmetic(stats_lines):
    clock = FakeClock()
    engine = fake_engine(queries=100, hits=10)
    stats = StatLogger(engine, interval=10.0, clock=clock)
    engine.kv_cache_manager.prefix_cache_stats = SimpleNamespace(queries=300, hits=110)  # +200 queries, +100 hits
    # A 30-token prompt in chunks of 20 and 10 (the last samples), then decodes.
    clock.now = 4.0
    stats.record(SchedulerOutput([chunk(0, 20, 30)]), num_generated_tokens=0)
    clock.now = 8.0
    stats.record(SchedulerOutput([chunk(20, 10, 30)]), num_generated_tokens=1)
    assert stats_lines() == []  # not yet 10 s
    clock.now = 10.0
    stats.record(SchedulerOutput([chunk(30, 1, 30), chunk(5, 1, 5)]), num_generated_tokens=2)
    [line] = stats_lines()
    m = LINE.match(line)
    assert m, line
    assert float(m["prompt"]) == 3.0 and float(m["gen"]) == 0.3  # 30 prompt, 3 generated tokens in 10 s
    assert (m["running"], m["waiting"], m["kv"], m["hit"]) == ("2", "1", "25.0", "50.0")
    # Idle for a minute, then 5 s of work: the average covers the work only.
    clock.now = 70.0
    stats.record(SchedulerOutput([chunk(30, 1, 30)]), num_generated_tokens=1)
    clock.now = 80.0
    stats.record(SchedulerOutput([chunk(31, 1, 30)]), num_generated_tokens=1)
    assert len(stats_lines()) == 2
    assert stats.last_stats.generation_throughput == pytest.approx(0.2)
    assert stats.last_stats.prefix_cache_hit_rate == 0.0  # no lookups this interval


def test_no_hit_rate_without_prefix_cache_stats(stats_lines):
    stats = StatLogger(fake_engine(with_prefix_stats=False), interval=1.0, clock=FakeClock())
    line = stats.log().format()
    assert LINE.match(line) and "Prefix cache" not in line


def test_offline_engine_counts_every_token(folder, stats_lines):
    llm = LLM(folder, dtype="float32", kv_cache_space=0.05, max_num_batched_tokens=16)
    core = llm.llm_engine.core
    assert core.stat_logger is None  # off by default, as vLLM's disable_log_stats=True
    clock = FakeClock()
    stats = core.stat_logger = StatLogger(core, interval=1e9, clock=clock)
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
