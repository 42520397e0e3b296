"""Block tables an engine keeps from step to step, checked when a row is written.

The step API checks every block id an artifact can read before native code touches it
(runtime/step/checks.py). For tables handed over as tensors that costs torch reads on every
step, and on CPU each one runs with the interpreter's caches cold after the artifact: about
15 us of an 800 us step. Most of a decode's rows do not change between two steps (a row
changes when its request crosses a block boundary), so ``TableBuffer`` checks a row once,
when it is written, and keeps what the step check needs as plain Python:

- the rows live in one buffer of ``[groups, max_rows, max_width]`` int64 ids (a flat
  ``array('q')`` shared with a tensor through ``torch.frombuffer``), so a step's
  ``[R, W]`` table is a view, made once per shape;
- ``write`` takes a row's ids as anything ``array('q')`` takes (ints; a float or a string is
  a ``StepInputError``), stores them, sets the columns past them that an earlier, longer
  write of the row left to the null block (so a row is its ids, then nulls, at any width),
  and records, from the ids stored (what the graph will read, exactly), their smallest and
  largest id, the width, and where the null block (0) is: the first null column, and the run
  of columns holding blocks (C-level scans: a write runs no Python loop over its columns);
- ``view(rows, width)`` returns ``BlockTables``: a plain ``{group: [R, W] tensor}`` dict
  (every caller that reads tensors still works) that also carries its buffer, so
  ``step_checks`` reads those Python values instead of the tensors (``checked``: one verdict
  per buffer write, kept while nothing is written).

A view is trusted when every row it shows was written, at any width: a row written narrower
than the view shows nulls past its ids (its first null column and its run of blocks end
there), one written wider shows a prefix of them (its min and max id cover more than the view
shows: a sound bound). So a wider or narrower context bucket is a new view over the same rows,
not a rewrite of every row. Writes go through ``write``: a view's tensors are the graph's
inputs, and ids stored into them directly are not seen by the check (the contract every caller
of a view keeps; the engine never writes them).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

from neffbuild.errors import StepInputError
from neffbuild.runtime.kv.blocks import FULL_GROUP, SLIDING_GROUP


class TableBuffer:
    """Rows of block ids per KV group, checked once per write; ``view`` gives the step's tables."""

    def __init__(self, groups: Sequence[str], max_rows: int, max_width: int):
        if max_rows < 1 or max_width < 1:
            raise StepInputError(f"TableBuffer: max_rows {max_rows} and max_width {max_width} must be >= 1")
        self.groups, self.max_rows, self.max_width = tuple(groups), max_rows, max_width
        G = len(self.groups)
        self._buf = array("q", bytes(8 * G * max_rows * max_width))  # every id the null block until written
        self._nulls = array("q", bytes(8 * max_width))
        self._all = torch.frombuffer(self._buf, dtype=torch.long).view(G, max_rows, max_width)
        # Per group, per row: the ids' min and max, the width written (0: never), ``first_null`` (the first
        # column holding the null block 0, or the width) and ``run``: ``(start, end)``, the columns of the row's
        # blocks when they sit in one run (released blocks null before it, null padding after it: what a block
        # manager writes), else (0, 0). The live columns [a, h) hold no null block if h <= first_null (full group),
        # or a >= start and h <= end (sliding; exact for one run, a refusal the reference re-decides otherwise).
        self.lo = [[0] * max_rows for _ in self.groups]
        self.hi = [[0] * max_rows for _ in self.groups]
        self.width = [[0] * max_rows for _ in self.groups]
        self.first_null = [[0] * max_rows for _ in self.groups]
        self.run_start = [[0] * max_rows for _ in self.groups]
        self.run_end = [[0] * max_rows for _ in self.groups]
        self.writes = 0  # moves on every write: a view's last verdict holds while it has not moved
        self._views: dict[tuple[int, int], BlockTables] = {}

    def write(self, group: int, row: int, ids, run: tuple[int, int] | None = None) -> None:
        """Row ``row`` of group index ``group`` := ``ids`` (one row's width of block ids).

        ``run``: the writer's word for where the row's blocks sit, ``(start, end)`` columns, null elsewhere (a
        block manager knows it). It is not trusted: two C-level counts over the ids stored confirm it (every null
        outside ``[start, end)``, none inside), else the row is scanned as without it."""
        if not 0 <= row < self.max_rows or not 0 <= group < len(self.groups):
            raise StepInputError(f"TableBuffer.write: row {row} of group {group}; the buffer has "
                                 f"{self.max_rows} rows of {len(self.groups)} groups")
        try:
            a = array("q", ids)
        except (TypeError, OverflowError) as exc:
            raise StepInputError(f"block table row {row} ({self.groups[group]}): block ids must be integers "
                                 f"({exc})") from None
        w = len(a)
        if not 0 < w <= self.max_width:
            raise StepInputError(f"block table row {row} ({self.groups[group]}) has {w} ids; "
                                 f"must be 1..{self.max_width}")
        at = (group * self.max_rows + row) * self.max_width
        self._buf[at: at + w] = a  # same length: the buffer (and the tensor over it) never moves
        was = self.width[group][row]
        if was > w:  # the columns an earlier, longer write left: null, so the row reads as its ids at any width
            self._buf[at + w: at + was] = self._nulls[: was - w]
        self.lo[group][row], self.hi[group][row] = min(a), max(a)
        self.width[group][row] = w
        nulls = a.count(0) if run is not None else -1
        if run is not None and 0 <= run[0] < run[1] <= w and nulls == w - run[1] + run[0] \
                and (not nulls or 0 not in a[run[0]: run[1]]):  # the claim holds: blocks in [start, end), nulls else
            start, end = run
            first = end if start == 0 else 0
        else:
            nz = bytes(map(bool, a))  # 1 per column holding a block, 0 per null column: the scans below run in C
            first, start, end = nz.find(0), nz.find(1), nz.rfind(1) + 1
            if start < 0 or nz.find(0, start, end) >= 0:  # no block, or a null column between two runs of blocks
                start = end = 0
        self.first_null[group][row] = w if first < 0 else first
        self.run_start[group][row], self.run_end[group][row] = start, end
        self.writes += 1

    def view(self, rows: int, width: int) -> BlockTables:
        """The ``{group: [rows, width]}`` tables over the buffer (made once per shape)."""
        got = self._views.get((rows, width))
        if got is None:
            if not 0 <= rows <= self.max_rows or not 0 < width <= self.max_width:
                raise StepInputError(f"TableBuffer.view: [{rows}, {width}] is outside the buffer's "
                                     f"[{self.max_rows}, {self.max_width}]")
            got = self._views[rows, width] = BlockTables(self, rows, width)
        return got


class BlockTables(dict):
    """``{group: [R, W] tensor}`` over a ``TableBuffer``; ``checked`` gives the same ids as lists."""

    def __init__(self, buffer: TableBuffer, rows: int, width: int):
        super().__init__({g: buffer._all[i, :rows, :width] for i, g in enumerate(buffer.groups)})
        self.buffer, self.num_rows, self.num_cols = buffer, rows, width
        # The last verdict, for (R, num_blocks) ``verdict_for`` at ``buffer.writes == verdict_at``: read-only
        # outside ``checked``, which the step check calls only when they no longer match (one call less per step).
        self.verdict, self.verdict_at, self.verdict_for = None, -1, None

    def checked(self, R: int, num_blocks: int):
        """``(first null column per full row, first and end column of each sliding row's run of blocks, or None
        twice)`` when the view has the groups full and (optionally) sliding and every one of its R rows was last
        written (at any width: see the module's docstring) with ids in ``[0, num_blocks)``; else None (the caller
        then reads the tensors). The columns are the rows' own: a row written wider than the view may give a first
        null column or a run end past the view's width (the step check compares live columns with both). Kept
        until the next write."""
        at, key = self.buffer.writes, (R, num_blocks)
        if at != self.verdict_at or key != self.verdict_for:
            self.verdict, self.verdict_at, self.verdict_for = self._check(R, num_blocks), at, key
        return self.verdict

    def _check(self, R: int, num_blocks: int):
        buf, groups = self.buffer, self.buffer.groups
        if self.num_rows != R or groups not in ((FULL_GROUP,), (FULL_GROUP, SLIDING_GROUP)):
            return None
        for g in range(len(groups)):
            widths, lo, hi = buf.width[g], buf.lo[g], buf.hi[g]
            for r in range(R):
                if not widths[r] or lo[r] < 0 or hi[r] >= num_blocks:
                    return None
        if len(groups) == 1:
            return buf.first_null[0][:R], None, None
        return buf.first_null[0][:R], buf.run_start[1][:R], buf.run_end[1][:R]
