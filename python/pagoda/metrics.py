"""The periodic stats line, like vLLM's LoggingStatLogger:

  Avg prompt throughput: X tokens/s, Avg generation throughput: Y tokens/s,
  Running: R reqs, Waiting: W reqs, KV cache usage: U%[, Prefix cache hit rate: H%]

The engine core calls record() once per model step (from whichever thread
steps it) with the step's scheduler output and its SchedulerStats (the core's
state after the step, as data: the logger never reaches into the engine), so
a line appears only while the engine works: an idle engine logs nothing and
needs no timer thread. Throughputs are averages over the interval since the
previous line.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagoda.logger import init_logger

if TYPE_CHECKING:
    from pagoda.core.scheduler import SchedulerOutput
    from pagoda.engine.core_messages import SchedulerStats

logger = init_logger(__name__)


@dataclass
class Stats:
    """One interval's numbers (also what tests and a /metrics endpoint read)."""

    prompt_throughput: float
    generation_throughput: float
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of blocks in use, 0..1
    prefix_cache_hit_rate: float | None  # 0..1; None when the KV cache manager has no prefix-cache stats

    def format(self) -> str:
        line = (
            f"Avg prompt throughput: {self.prompt_throughput:.1f} tokens/s, "
            f"Avg generation throughput: {self.generation_throughput:.1f} tokens/s, "
            f"Running: {self.num_running} reqs, Waiting: {self.num_waiting} reqs, "
            f"KV cache usage: {self.kv_cache_usage * 100:.1f}%"
        )
        if self.prefix_cache_hit_rate is not None:
            line += f", Prefix cache hit rate: {self.prefix_cache_hit_rate * 100:.1f}%"
        return line


class StatLogger:
    def __init__(self, interval: float = 10.0, clock=time.monotonic):
        if interval <= 0:
            raise ValueError(f"stats interval must be positive seconds, got {interval!r}")
        self.interval = interval
        self.clock = clock
        self.last_stats: Stats | None = None
        self._start = clock()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._latest: SchedulerStats | None = None  # the last step's
        self._prefix_base = (0, 0)  # the core's cumulative (queries, hits) at the last line

    def record(self, scheduler_output: SchedulerOutput, num_generated_tokens: int, stats: SchedulerStats) -> None:
        """Counts one step's work; logs when the interval has passed."""
        now = self.clock()
        if self._prompt_tokens == 0 and self._generation_tokens == 0 and now - self._start >= self.interval:
            # First step after an idle spell: start the interval here, or the
            # idle time would drag the average throughput down.
            self._start = now
        # Prompt tokens computed this step (prefill chunks; prefix-cache hits
        # are never scheduled, so they do not count as throughput).
        for item in scheduler_output.scheduled:
            end = min(item.start_position + len(item.token_ids), item.num_prompt_tokens)
            self._prompt_tokens += max(0, end - item.start_position)
        self._generation_tokens += num_generated_tokens
        self._latest = stats
        if now - self._start >= self.interval:
            self.log(now)

    def log(self, now: float | None = None) -> Stats:
        """The interval's line, from the last recorded step's state."""
        now = self.clock() if now is None else now
        elapsed = max(now - self._start, 1e-9)
        latest = self._latest
        running, waiting, usage = (0, 0, 0.0) if latest is None else (
            latest.num_running, latest.num_waiting, latest.kv_cache_usage)
        stats = Stats(
            prompt_throughput=self._prompt_tokens / elapsed,
            generation_throughput=self._generation_tokens / elapsed,
            num_running=running,
            num_waiting=waiting,
            kv_cache_usage=usage,
            prefix_cache_hit_rate=self._prefix_hit_rate(latest),
        )
        logger.info(stats.format())
        self.last_stats = stats
        self._start, self._prompt_tokens, self._generation_tokens = now, 0, 0
        return stats

    def _prefix_hit_rate(self, latest: SchedulerStats | None) -> float | None:
        """Over this interval, as vLLM's is over recent requests; None with
        prefix caching off (or before any step)."""
        if latest is None or not latest.prefix_caching:
            return None
        base = self._prefix_base
        self._prefix_base = (latest.prefix_cache_queries, latest.prefix_cache_hits)
        queries, hits = latest.prefix_cache_queries - base[0], latest.prefix_cache_hits - base[1]
        return hits / queries if queries > 0 else 0.0
