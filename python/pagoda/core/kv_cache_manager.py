"""Per-request block tables over the BlockPool: how many blocks a request
needs for its tokens, allocation that either succeeds whole or returns None (the
scheduler alone decides whom to preempt), and freeing on finish, abort or
preemption."""

from __future__ import annotations

from pagoda.core.block_pool import BlockPool, KVCacheBlock


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._blocks: dict[str, list[KVCacheBlock]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def allocate_slots(self, request_id: str, num_tokens: int) -> list[KVCacheBlock] | None:
        """Makes room for a request's first `num_tokens` tokens (computed plus
        scheduled now). Returns the newly allocated blocks, or None -- with
        nothing changed -- when the pool has too few free blocks."""
        blocks = self._blocks.setdefault(request_id, [])
        needed = cdiv(num_tokens, self.block_size) - len(blocks)
        if needed <= 0:
            return []
        if needed > self.pool.num_free_blocks:
            if not blocks:
                del self._blocks[request_id]
            return None
        new_blocks = self.pool.allocate(needed)
        blocks.extend(new_blocks)
        return new_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self._blocks.get(request_id, [])]

    def free(self, request_id: str) -> None:
        """Returns a request's blocks, tail first (so with prefix caching the
        ends of chains are reused before their shared beginnings)."""
        blocks = self._blocks.pop(request_id, [])
        self.pool.free(list(reversed(blocks)))

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)
