"""`BlockTables`: every held request's block table as one row of a persistent int32 array.

A step's `[B, max_blocks]` table is then one gather of B rows, not a tensor built from B
Python lists (which cost ~1 ms of CPU per step at 256 requests); a plan's new blocks are
written into their request's row as they arrive.

    table:       row 0 | 7  8  9  0  0 ... |   num_blocks[0] = 3
                 row 1 | 4  0  0  0  0 ... |   num_blocks[1] = 1
                 row 2 | (free)            |
    gather([1, 0]) -> [[4, 0, 0],
                       [7, 8, 9]]        (width: the batch's longest table)

Columns past a row's `num_blocks` are 0, the padding the attention kernels expect. Both
dimensions double when full.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np


class BlockTables:
    """Rows of block ids; `live_rows` names the rows still held by someone when the free
    ones run out (the runner's request states: whatever dropped a request gave its row
    back, with no call to make)."""

    def __init__(self, live_rows: Callable[[], Iterable[int]], rows: int = 64, width: int = 64):
        self._live_rows = live_rows
        self.table = np.zeros((rows, width), dtype=np.int32)  # [rows, width]
        self.num_blocks = np.zeros(rows, dtype=np.int64)  # [rows]
        self._free_rows = list(range(rows - 1, -1, -1))

    @property
    def num_rows(self) -> int:
        return self.table.shape[0]

    def add(self, block_ids: Sequence[int]) -> int:
        """A row holding `block_ids`; returns its index."""
        if not self._free_rows:
            self._reclaim()
        row = self._free_rows.pop()
        self.table[row] = 0
        self.num_blocks[row] = 0
        self.append(row, block_ids)
        return row

    def append(self, row: int, block_ids: Sequence[int]) -> None:
        """Appends `block_ids` to the table of `row`."""
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            self._grow(self.num_rows, max(end, 2 * self.table.shape[1]))
        self.table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def block_ids(self, row: int) -> list[int]:
        return self.table[row, : self.num_blocks[row]].tolist()

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """[B, max blocks of those rows] int32, a copy (later appends do not change it)."""
        width = int(self.num_blocks[rows].max())
        return self.table[rows, :width]

    def _reclaim(self) -> None:
        """Frees every row no live request holds; doubles the rows when under half of them
        come free, so that reclaiming stays rare (amortized O(1) per `add`)."""
        live = set(self._live_rows())
        self._free_rows = [r for r in range(self.num_rows - 1, -1, -1) if r not in live]
        if len(self._free_rows) < self.num_rows // 2:
            old_rows = self.num_rows
            self._grow(2 * old_rows, self.table.shape[1])
            self._free_rows = list(range(self.num_rows - 1, old_rows - 1, -1)) + self._free_rows

    def _grow(self, rows: int, width: int) -> None:
        table = np.zeros((rows, width), dtype=np.int32)
        table[: self.table.shape[0], : self.table.shape[1]] = self.table
        num_blocks = np.zeros(rows, dtype=np.int64)
        num_blocks[: self.num_blocks.shape[0]] = self.num_blocks
        self.table, self.num_blocks = table, num_blocks
