"""Per-request block tables over the BlockPool: how many blocks a request
needs for its tokens, prefix-cache lookups, allocation that either succeeds
whole or returns None (the scheduler alone decides whom to preempt), and
freeing on finish, abort or preemption."""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.core.block_pool import BlockHash, BlockPool, KVCacheBlock, hash_block_tokens
from pagoda.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    """Cumulative, in tokens: `queries` looked up, `hits` served from the cache
    (one lookup per admission; a request that could not be admitted is not
    counted until it is)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        self.prefix_cache_stats = PrefixCacheStats()
        self._blocks: dict[str, list[KVCacheBlock]] = {}
        self._block_ids: dict[str, list[int]] = {}  # the same, as ids: read every step by the runner
        self._num_cached_blocks: dict[str, int] = {}  # leading blocks of a request already in the cache

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def block_hashes(self, request: Request) -> list[BlockHash]:
        """The chained hashes of the request's full blocks, extended as its
        tokens grow (prompt and output alike)."""
        hashes = request.block_hashes
        for index in range(len(hashes), request.num_tokens // self.block_size):
            start = index * self.block_size
            tokens = request.token_ids_slice(start, start + self.block_size)
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tokens))
        return hashes

    def get_computed_blocks(self, request: Request) -> list[KVCacheBlock] | None:
        """The longest cached prefix of the request's full blocks, or None when
        the request must not use the cache. The hit stops at least one token
        short of the request's tokens, so the last one is computed and there
        are logits to sample. Requests wanting prompt_logprobs skip the cache:
        they need the logits at every prompt position."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return None
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in self.block_hashes(request)[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(
        self, request: Request, num_tokens: int, new_computed_blocks: list[KVCacheBlock] | None = None
    ) -> list[KVCacheBlock] | None:
        """Makes room for the request's first `num_tokens` tokens (computed,
        cache hits and scheduled now), taking references on
        `new_computed_blocks` (from get_computed_blocks; None = no lookup).
        Returns the newly allocated blocks, or None -- with nothing changed --
        when the pool has too few free blocks."""
        hits = new_computed_blocks or []
        blocks = self._blocks.get(request.request_id, [])
        needed = max(cdiv(num_tokens, self.block_size) - len(blocks) - len(hits), 0)
        if not needed and new_computed_blocks is None:
            # Most decode steps: the tokens fit the blocks held; only a block
            # that just filled up may join the prefix cache.
            self._cache_full_blocks(request, blocks, num_tokens, 0)
            return []
        # Hits nobody references sit in the free queue: touching them uses it up.
        free_hits = sum(1 for block in hits if block.ref_cnt == 0)
        if needed > self.pool.num_free_blocks - free_hits:
            return None
        if new_computed_blocks is not None:
            stats = self.prefix_cache_stats
            stats.requests += 1
            stats.queries += request.num_tokens
            stats.hits += len(hits) * self.block_size
        self.pool.touch(hits)
        new_blocks = self.pool.allocate(needed)
        blocks = self._blocks.setdefault(request.request_id, blocks)
        blocks.extend(hits)
        blocks.extend(new_blocks)
        self._block_ids.setdefault(request.request_id, []).extend(block.block_id for block in hits + new_blocks)
        self._cache_full_blocks(request, blocks, num_tokens, len(hits))
        return new_blocks

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int, num_hits: int) -> None:
        """Cached as soon as scheduled: this step's forward writes every
        block's KV before any attention reads it, so a request admitted later
        in the same step may already share these blocks."""
        if not self.enable_caching:
            return
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self._num_cached_blocks.get(request.request_id, num_hits)
        if num_full > start:
            self.pool.cache_full_blocks(blocks, self.block_hashes(request), start, num_full)
            self._num_cached_blocks[request.request_id] = num_full
        elif request.request_id not in self._num_cached_blocks:
            self._num_cached_blocks[request.request_id] = start

    def block_ids(self, request_id: str, start: int = 0) -> list[int]:
        """The request's block ids from index `start` on (a copy)."""
        return self._block_ids.get(request_id, [])[start:]

    def free(self, request_id: str) -> None:
        """Returns a request's blocks, tail first (so the ends of cached chains
        are evicted before their shared beginnings)."""
        blocks = self._blocks.pop(request_id, [])
        self._block_ids.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)
        self.pool.free(list(reversed(blocks)))

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)
