"""BlockTable: the worker's persistent block-table rows -- appends, a reset
after a preemption, rows reused after a request ends, growth past the rows
it started with, and a step's gather (zero past each row's blocks)."""

import numpy as np
import pytest

from pagoda.worker.block_table import BlockTable


def test_append_reset_and_gather():
    table = BlockTable(max_blocks_per_req=6, num_rows=4)
    a, b = table.add_row(), table.add_row()
    table.append(a, [5, 9], reset=True)
    table.append(b, [7], reset=True)
    table.append(a, [])  # a decode step without a new block
    table.append(a, [3])
    np.testing.assert_array_equal(table.gather(np.array([b, a])), [[7, 0, 0], [5, 9, 3]])
    table.append(a, [8], reset=True)  # preempted and readmitted: the table starts over
    np.testing.assert_array_equal(table.gather(np.array([a, b])), [[8], [7]])
    assert not table.ids[a, 1:].any(), "the old table's ids outlived the reset"


def test_rows_are_reused_zeroed_and_grow():
    table = BlockTable(max_blocks_per_req=4, num_rows=2)
    rows = [table.add_row() for _ in range(5)]  # past the 2 rows it started with
    assert sorted(rows) == list(range(5)) and len(table.ids) >= 5
    for i, row in enumerate(rows):
        table.append(row, [i + 1] * (i % 4 + 1), reset=True)
    table.free_row(rows[3])
    again = table.add_row()
    assert again == rows[3] and not table.ids[again].any() and table.num_blocks[again] == 0
    np.testing.assert_array_equal(table.gather(np.array([rows[4], rows[0]])), [[5], [1]])


def test_a_table_past_max_blocks_is_refused():
    table = BlockTable(max_blocks_per_req=2, num_rows=1)
    row = table.add_row()
    table.append(row, [1, 2], reset=True)
    with pytest.raises(RuntimeError, match="exceeds max_blocks_per_req=2"):
        table.append(row, [3])
    assert table.num_blocks[row] == 2


def test_gather_of_no_rows():
    assert BlockTable(max_blocks_per_req=3, num_rows=1).gather(np.array([], dtype=np.int64)).shape == (0, 0)
