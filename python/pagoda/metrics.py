"""The periodic stats line, like vLLM's LoggingStatLogger:

  Avg prompt throughput: X tokens/s, Avg generation throughput: Y tokens/s,
  Running: R reqs, Waiting: W reqs, KV cache usage: U%[, Prefix cache hit rate: H%]

The engine calls record() once per model step (from whichever thread steps it),
so a line appears only while the engine works: an idle engine logs nothing and
needs no timer thread. Throughputs are averages over the interval since the
previous line.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pagoda.logger import init_logger

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
    def __init__(self, engine, interval: float = 10.0, clock=time.monotonic):
        if interval <= 0:
            raise ValueError(f"stats interval must be positive seconds, got {interval!r}")
        self.engine = engine
        self.interval = interval
        self.clock = clock
        self.last_stats: Stats | None = None
        self._start = clock()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._prefix_base = self._prefix_counts()

    def record(self, scheduler_output, num_generated_tokens: int) -> None:
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
        if now - self._start >= self.interval:
            self.log(now)

    def log(self, now: float | None = None) -> Stats:
        now = self.clock() if now is None else now
        elapsed = max(now - self._start, 1e-9)
        scheduler = self.engine.scheduler
        kv = self.engine.kv_cache_manager
        stats = Stats(
            prompt_throughput=self._prompt_tokens / elapsed,
            generation_throughput=self._generation_tokens / elapsed,
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            kv_cache_usage=kv.usage(),
            prefix_cache_hit_rate=self._prefix_hit_rate(),
        )
        logger.info(stats.format())
        self.last_stats = stats
        self._start, self._prompt_tokens, self._generation_tokens = now, 0, 0
        return stats

    # Prefix-cache counters come from kv_cache_manager.prefix_cache_stats when
    # the manager has them (queries/hits in tokens or blocks, cumulative); the
    # rate shown is over this interval, as vLLM's is over recent requests.
    def _prefix_counts(self) -> tuple[int, int] | None:
        kv = self.engine.kv_cache_manager
        stats = getattr(kv, "prefix_cache_stats", None)
        if stats is None or not getattr(kv, "enable_caching", True):
            return None
        queries, hits = getattr(stats, "queries", None), getattr(stats, "hits", None)
        if queries is None or hits is None:
            return None
        return queries, hits

    def _prefix_hit_rate(self) -> float | None:
        counts = self._prefix_counts()
        if counts is None:
            return None
        base = self._prefix_base or (0, 0)
        self._prefix_base = counts
        queries, hits = counts[0] - base[0], counts[1] - base[1]
        return hits / queries if queries > 0 else 0.0
