"""The pool of KV cache blocks: fixed-size blocks with reference counts and an
O(1) free queue (a doubly linked list threaded through the blocks), so a block
can leave the middle of the queue in constant time when it is reused.

The scheduler's KVCacheManager is the only user; the model runner sees block ids
only through the scheduler's output.
"""

from __future__ import annotations


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "prev_free", "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None


class FreeBlockQueue:
    """Free blocks, least recently freed first."""

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
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free += 1


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, count: int) -> list[KVCacheBlock]:
        """`count` blocks with a reference each; the caller checked there are enough."""
        if count > self.num_free_blocks:
            raise ValueError(f"asked for {count} KV cache blocks, only {self.num_free_blocks} are free")
        blocks = [self.free_queue.popleft() for _ in range(count)]
        for block in blocks:
            block.ref_cnt = 1
        return blocks

    def free(self, blocks: list[KVCacheBlock]) -> None:
        """Drops one reference from each block; unreferenced blocks become free."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"KV cache block {block.block_id} freed twice")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)
