"""The worker's block tables: each request it holds has a persistent row of one
host array, into which a step's new block ids are appended (the whole row is
rewritten only when the scheduler starts the table over: a first step, or
after a preemption). A step's table is then one numpy gather of its rows,
not a rebuild from every request's ids in Python.

Columns past a row's own blocks hold 0, as the attention kernels never read
them (any valid block id would do). Rows are reused once a request ends; the
array grows when more requests are held than it has rows (preempted requests
keep theirs).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


class BlockTable:
    def __init__(self, max_blocks_per_req: int, num_rows: int):
        self.max_blocks_per_req = max_blocks_per_req
        self.ids = np.zeros((max(num_rows, 1), max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(len(self.ids), dtype=np.int64)
        self._free_rows = list(range(len(self.ids) - 1, -1, -1))  # popped from the end: lowest first

    def add_row(self) -> int:
        """A fresh row (all zeros, no blocks)."""
        if not self._free_rows:
            grown = len(self.ids)
            self.ids = np.concatenate([self.ids, np.zeros_like(self.ids)])
            self.num_blocks = np.concatenate([self.num_blocks, np.zeros_like(self.num_blocks)])
            self._free_rows = list(range(len(self.ids) - 1, grown - 1, -1))
        return self._free_rows.pop()

    def free_row(self, row: int) -> None:
        self.ids[row, : self.num_blocks[row]] = 0
        self.num_blocks[row] = 0
        self._free_rows.append(row)

    def append(self, row: int, block_ids: Sequence[int], reset: bool = False) -> None:
        """Adds block ids at the end of a row, or (reset) makes them the whole row."""
        start = 0 if reset else int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.max_blocks_per_req:
            raise RuntimeError(f"a block table of {end} blocks exceeds max_blocks_per_req={self.max_blocks_per_req}")
        if reset:
            self.ids[row, end : self.num_blocks[row]] = 0
        if block_ids:
            self.ids[row, start:end] = block_ids
        self.num_blocks[row] = end

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """The tables of these rows, [len(rows), their widest row's blocks] int32."""
        width = int(self.num_blocks[rows].max()) if len(rows) else 0
        return self.ids[rows, :width]
