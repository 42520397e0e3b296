"""KV block accounting (the one formula) and an optional per-group block manager.

Pure Python (no torch): the recipe validator imports the formula, so what validates is
exactly what the block manager can serve.

KV groups share one pool of ``num_blocks`` block ids (block 0 is the null block, never
handed out). A full-attention group holds every block of a sequence; a sliding-window
group holds only the blocks a future query can still read: a step that runs positions
``[n, n+q)`` reads keys from ``n - window + 1`` on, so older blocks go back to the pool
and their table entries become the null block (the kernels mask those positions anyway).

Blocks one sequence of ``L`` tokens needs at its peak, with at most ``q`` tokens per step:

    full(L)    = ceil(L / block_size)
    sliding(L) = min(ceil(L / block_size), (window + q - 1 + block_size - 2) // block_size + 1)
    need(L)    = full(L) + sliding(L)            (summed over the model's groups)
    pool       >= num_seqs * need(max_model_len) + 1   (the null block)

``(T + block_size - 2) // block_size + 1`` is the most blocks a run of ``T`` consecutive
positions can touch (``T = window + q - 1``: the oldest key the first query reads to the
last position written).

What this module leaves out: engines with their own allocator (vLLM) keep using it; the
step API (runtime/step/stepper.py) takes whatever block tables it is given.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from neffbuild.errors import InvalidInput, KVPoolExhausted

NULL_BLOCK = 0  # the same constant as kv_cache.NULL_BLOCK (that module imports torch)
FULL_GROUP, SLIDING_GROUP = "full", "sliding"


@dataclass(frozen=True)
class KVGroup:
    """One block table per request: ``window`` tokens for sliding-window layers, None for full attention."""

    name: str
    window: int | None = None


def kv_groups(sliding_window: int | None) -> tuple[KVGroup, ...]:
    """The target model's groups: full attention, plus sliding window when the model has such layers."""
    return (KVGroup(FULL_GROUP),) + ((KVGroup(SLIDING_GROUP, sliding_window),) if sliding_window else ())


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def group_blocks(num_tokens: int, block_size: int, window: int | None = None, query_len: int = 1) -> int:
    """Peak blocks one group holds for a sequence of ``num_tokens`` tokens."""
    full = _ceil_div(num_tokens, block_size)
    if window is None:
        return full
    span = window + query_len - 1
    return min(full, (span + block_size - 2) // block_size + 1)


def blocks_needed(num_tokens: int, block_size: int, groups: Iterable[KVGroup], query_len: int = 1) -> int:
    """Peak blocks one sequence of ``num_tokens`` tokens holds over all groups (null block not included)."""
    return sum(group_blocks(num_tokens, block_size, g.window, query_len) for g in groups)


def min_pool_blocks(max_model_len: int, block_size: int, groups: Iterable[KVGroup], query_len: int = 1,
                    num_seqs: int = 1) -> int:
    """Smallest ``num_blocks`` that serves ``num_seqs`` sequences of ``max_model_len`` tokens at once."""
    return num_seqs * blocks_needed(max_model_len, block_size, groups, query_len) + 1


def lookahead(pool: int, num_seqs: int, max_model_len: int, block_size: int, groups: Iterable[KVGroup],
              query_len: int = 1) -> int:
    """Tokens (whole blocks) an engine's reserves may hold past a step's positions: the most for which ``pool``
    blocks still hold ``num_seqs`` sequences of ``max_model_len`` tokens, each step ``query_len`` + that long (so
    admission by peak blocks never waits for it). 0 at the recipe's formula minimum; every position when the pool
    has room for it.

    A full-attention group holds no more at its peak for it (a reserve stops at the sequence's last position);
    a sliding-window group holds up to ``lookahead / block_size`` blocks more than its window. What it buys: a
    sequence's tables change once per ``lookahead`` tokens, not once per block, and on CPU each change runs its
    Python with the caches the artifact left cold (docs/benchmarks.md)."""
    lo, hi = 0, _ceil_div(max_model_len, block_size)  # blocks ahead: 0 always fits the formula; hi covers all
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if num_seqs * blocks_needed(max_model_len, block_size, groups, query_len + mid * block_size) <= pool:
            lo = mid
        else:
            hi = mid - 1
    return lo * block_size


def live_blocks(group: KVGroup, block_size: int, upto: int, next_query: int) -> range:
    """Logical block indices a group must hold: positions below ``upto`` a query at ``next_query`` or later reads."""
    hi = _ceil_div(upto, block_size)
    if group.window is None:
        return range(hi)
    return range(min(max(0, next_query - group.window + 1) // block_size, hi), hi)


class BlockManager:
    """Per-request, per-group block tables over one shared pool (a convenience; engines may own their own).

    Tables are lists indexed by logical block (position // block_size); entries a group no
    longer needs hold ``NULL_BLOCK``.
    """

    def __init__(self, num_blocks: int, block_size: int, groups: Sequence[KVGroup]):
        for name, v, lo in (("num_blocks", num_blocks, 2), ("block_size", block_size, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise InvalidInput(f"BlockManager: {name} must be an integer >= {lo}, got {v!r}")
        groups = tuple(groups)
        if not groups or any(not isinstance(g, KVGroup) or (g.window is not None and
                                                            (not isinstance(g.window, int) or g.window < 1))
                             for g in groups):
            raise InvalidInput(f"BlockManager: groups must be KVGroups with window None or >= 1, got {groups!r}")
        self.block_size, self.groups = block_size, tuple(groups)
        self._free = list(range(num_blocks - 1, NULL_BLOCK, -1))  # pop() hands out 1, 2, 3, ...
        self.tables: dict[object, dict[str, list[int]]] = {}
        # First held index per request and group: entries below it are NULL_BLOCK, entries from
        # it to the end are held, so a step touches only the blocks that change (never O(length)).
        self._start: dict[object, dict[str, int]] = {}
        # Per request: (upto, next_query) limits below which ``reserve`` changes nothing (the step's
        # common case: no block boundary crossed, no sliding block leaving), and a counter that
        # moves whenever its table changes (engines cache the tensors they build from a row on it).
        self._quick: dict[object, tuple[int, float, int]] = {}  # (upto, next_query, version)
        self._version: dict[object, int] = {}
        # The last version handed out: one counter for all, so a reused key never repeats one; public, read-only:
        # while it has not moved, no table changed (an engine keeps a step's batch on it).
        self.tick = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def reserve(self, rid, upto: int, next_query: int | None = None) -> tuple[int, float, int]:
        """Hold blocks for positions ``< upto`` that a query at ``next_query`` (default ``upto - 1``) or later reads.

        A decode step running positions ``[n, n+q)`` calls ``reserve(rid, n + q, n)``; prefill of
        ``N`` tokens (which reads no cache) calls ``reserve(rid, N, N)``. Sliding-window blocks
        that fell out of the window return to the pool first. All or nothing: raises
        KVPoolExhausted (needed vs free) and changes nothing when the pool is short.
        Returns ``hold_limits(rid)`` after it (an engine keeps it: one call, not two).
        """
        nq = upto - 1 if next_query is None else next_query
        quick = self._quick.get(rid)
        if quick is not None and upto <= quick[0] and nq < quick[1]:
            return quick
        # One pass to plan (per group: the new first held block, the blocks leaving, the blocks wanted), written
        # out without helper calls: engines call this between two steps, with the interpreter's caches cold.
        bs, free = self.block_size, self._free
        tables = self.tables.get(rid) or {g.name: [] for g in self.groups}
        starts = self._start.get(rid) or {g.name: 0 for g in self.groups}
        hi = -(-upto // bs)  # live_blocks(...).stop
        plan, n_release, n_want = [], 0, 0
        for g in self.groups:
            name, window = g.name, g.window
            table, start = tables[name], starts[name]
            lo = 0 if window is None else min(max(0, nq - window + 1) // bs, hi)  # live_blocks(...).start
            new_start = start if start > lo else lo
            n = len(table)
            release_end = new_start if new_start < n else n  # releases [start, release_end)
            want_from = new_start if new_start > n else n  # wants [want_from, hi)
            plan.append((name, table, start, new_start, release_end, want_from))
            if release_end > start:
                n_release += release_end - start
            if hi > want_from:
                n_want += hi - want_from
        if n_want > len(free) + n_release:
            raise KVPoolExhausted(n_want, len(free) + n_release, f"for request {rid!r}")
        self.tables[rid], self._start[rid] = tables, starts
        for name, table, start, new_start, release_end, _ in plan:
            if release_end > start:  # (slices, not a loop per block: an engine may reserve many blocks ahead)
                free.extend(table[start:release_end])
                table[start:release_end] = [NULL_BLOCK] * (release_end - start)
            starts[name] = new_start
        for _, table, _, new_start, _, want_from in plan:
            if new_start > len(table):
                table.extend([NULL_BLOCK] * (new_start - len(table)))
            if hi > want_from:  # the blocks pop() would hand out, in that order
                table.extend(free[-1:want_from - hi - 1:-1])
                del free[want_from - hi:]
        self.tick += 1
        self._version[rid] = self.tick
        quick = self._quick[rid] = (*self._limits(tables, starts), self.tick)
        return quick

    def _limits(self, tables: dict[str, list[int]], starts: dict[str, int]) -> tuple[int, float]:
        """(upto, next_query) limits of a no-op reserve: every group's table already reaches ``upto``
        and no sliding group's first held block falls out of the window before ``next_query``."""
        bs = self.block_size
        upto = min(len(tables[g.name]) for g in self.groups) * bs
        nq = min(((starts[g.name] + 1) * bs + g.window - 1 for g in self.groups if g.window is not None),
                 default=float("inf"))
        return upto, nq

    def version(self, rid) -> int:
        """Changes whenever the request's table does; never the same for two tables (0: none held)."""
        return self._version.get(rid, 0)

    @property
    def versions(self) -> dict:
        """rid -> ``version(rid)`` for every request holding blocks (read-only: an engine's per-step lookup)."""
        return self._version

    def hold_limits(self, rid) -> tuple[int, float, int] | None:
        """``(upto, next_query, version)``: while the table is at ``version``, ``reserve(rid, u, n)`` with
        ``u <= upto`` and ``n < next_query`` changes nothing (an engine may skip the call)."""
        return self._quick.get(rid)  # (kept with its version by reserve)

    def release(self, rid) -> None:
        """Return every block of a finished request to the pool."""
        starts = self._start.pop(rid, None)
        self._quick.pop(rid, None)
        self._version.pop(rid, None)
        free = self._free
        for name, table in self.tables.pop(rid, {}).items():  # held: from the group's start to the end (C slices)
            free.extend(reversed(table[starts[name]:]))

    def row(self, rid, group: str, width: int) -> list[int]:
        """One group's table row for a request, padded with the null block to ``width`` entries."""
        table = self.tables[rid][group]
        return table[:width] + [NULL_BLOCK] * (width - len(table))

    def row_runs(self, rid, width: int) -> list[tuple[list[int], tuple[int, int]]]:
        """Per group, in ``groups`` order: the request's blocks (its table, at most ``width`` entries, not padded)
        and the columns they fill, ``(start, stop)`` (a TableBuffer's ``run``). One call per request, not per group."""
        tables, starts, out = self.tables[rid], self._start[rid], []
        for g in self.groups:
            table = tables[g.name]
            n = len(table)
            out.append((table[:width], (starts[g.name], n if n < width else width)))
        return out

    def held(self, rid) -> int:
        """Blocks a request holds over all groups."""
        return sum(b != NULL_BLOCK for t in self.tables.get(rid, {}).values() for b in t)
