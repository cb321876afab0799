"""The pool of KV cache blocks: fixed-size blocks with reference counts and an
O(1) free queue (a doubly linked list threaded through the blocks), so a block
can leave the middle of the queue in constant time when a prefix-cache hit
reuses it.

Prefix caching (vLLM v1's design): a full block gets a hash chained from its
parent's, so one hash names a whole prefix. Cached blocks stay in the free
queue, hash and all, when no request references them; they are forgotten only
when allocate() takes them for new tokens, least recently freed first, after
the free blocks that hold no hash.

The scheduler's KVCacheManager is the only user; the model runner sees block ids
only through the scheduler's output.
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Any, Sequence

BlockHash = bytes


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple[Any, ...] | None = None) -> BlockHash:
    """The chained hash of one full block. SHA-256 rather than Python's hash():
    a collision would silently serve another prompt's KV."""
    return hashlib.sha256(pickle.dumps((parent_hash, tuple(token_ids), extra_keys), protocol=5)).digest()


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None  # set while the block is in the prefix cache
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Free blocks in the order allocate() takes them (BlockPool.free decides
    which end a block joins)."""

    def __init__(self, blocks: list[KVCacheBlock]):
        self.num_free = len(blocks)
        self._head = KVCacheBlock(-1)  # sentinels keep the links branch-free
        self._tail = KVCacheBlock(-1)
        previous = self._head
        for block in blocks:
            previous.next_free, block.prev_free = block, previous
            previous = block
        previous.next_free, self._tail.prev_free = self._tail, previous

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free KV cache blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        self._insert_after(self._tail.prev_free, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        self._insert_after(self._head, block)

    def _insert_after(self, previous: KVCacheBlock, block: KVCacheBlock) -> None:
        following = previous.next_free
        previous.next_free, block.prev_free = block, previous
        block.next_free, following.prev_free = following, block
        self.num_free += 1

    def block_ids(self) -> list[int]:
        """In eviction order (tests and debugging)."""
        ids, block = [], self._head.next_free
        while block is not self._tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def allocate(self, count: int) -> list[KVCacheBlock]:
        """`count` blocks with a reference each; the caller checked there are
        enough. A cached block taken here leaves the prefix cache (eviction)."""
        if count > self.num_free_blocks:
            raise ValueError(f"asked for {count} KV cache blocks, only {self.num_free_blocks} are free")
        blocks = [self.free_queue.popleft() for _ in range(count)]
        for block in blocks:
            self._evict(block)
            block.ref_cnt = 1
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Takes a reference on prefix-cache hits; a hit nobody referenced
        leaves the free queue so it cannot be evicted while in use."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[BlockHash], start: int, end: int) -> None:
        """Enters blocks[start:end] (now full) into the prefix cache. A block
        whose hash another block already holds (two requests computed the same
        prefix in one step) stays out: it is simply freed later."""
        for block, block_hash in zip(blocks[start:end], block_hashes[start:end]):
            if block.block_hash is None and block_hash not in self.cached_block_hash_to_block:
                block.block_hash = block_hash
                self.cached_block_hash_to_block[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix; False, changing nothing, while any
        block is referenced (a running sequence's blocks may be cached)."""
        if self.num_free_blocks < self.num_blocks:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

    def free(self, blocks: list[KVCacheBlock]) -> None:
        """Drops one reference from each block; unreferenced blocks become free.
        Cached ones keep their hash until allocate() reuses them, least
        recently freed first; a block without a hash has nothing to keep and
        is reused before them, most recently freed first: its memory is
        already touched (a run that needs N blocks at a time stays within N
        blocks' pages instead of walking the whole cache) and warm."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"KV cache block {block.block_id} freed twice")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)
