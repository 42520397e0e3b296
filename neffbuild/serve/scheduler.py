"""The engine's scheduler: the waiting queue, admission, block reservations and each step's rows.

The engine asks it twice per step. ``admit(t)``: the waiting requests that join now, a prefix
of the queue in arrival then file order (first come, first served: a later, smaller request
does not jump it), while a batch row is free and the pool holds every live request's *peak*
blocks plus the newcomer's, so a run never exhausts the pool mid-way and nothing is
preempted. Once their KV is in place (the KV source) and the proposer drafted,
``schedule(t)`` gives the ``StepDecision``: the rows in batch order, the ``StepBatch`` with
each row's blocks reserved for its positions and ``ahead`` more (the most the pool spares
without making admission wait, ``runtime.blocks.lookahead``: a request's tables then change
once per ``ahead`` tokens), and whether this rank has work after the step. ``finish`` lets
requests leave: their blocks go back to the pool and their rows to the next joiner (one
table row rewritten, not every row after it).

The engine's bookkeeping per request lives here (``Seq``), not on the user's ``Request``.
Pure Python over a ``BlockManager`` and the grid: no artifact runs here, so the fast tests
drive it without a compiled bundle. Not here: the KV source, the proposer, sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

from neffbuild.errors import InvalidInput
from neffbuild.runtime.kv.blocks import BlockManager, blocks_needed, lookahead
from neffbuild.runtime.step.buckets import ctx_buckets_with_fallback
from neffbuild.runtime.step.dispatch import Grid
from neffbuild.runtime.step.stepper import StepBatch
from neffbuild.serve.parts import BlockRows, Request


@dataclass
class Seq:
    """The engine's own state for one admitted or waiting request."""

    req: Request
    need: int  # the most KV blocks it ever holds: admission's budget
    reach: int  # positions its blocks ever cover (prompt + max_new_tokens + k, at most max_model_len)
    hold: tuple | None = None  # BlockManager.hold_limits after its last reserve


@dataclass(frozen=True)
class StepDecision:
    t: int  # the decode step (the clock of ``Request.arrival``)
    rows: list[Request]  # the step's rows, in batch order
    batch: StepBatch
    more: bool  # this rank has work after this step: waiting requests, or a row with more than one token to go


class Scheduler:
    """Admission and block reservations for one rank: ``add``, then per step ``admit``/``join``, ``schedule``,
    ``finish``."""

    def __init__(self, blocks: BlockManager, grid: Grid, *, k: int = 0, max_batch: int | None = None,
                 ahead: int | None = None):
        if ahead is not None and (isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 0):
            raise InvalidInput(f"Engine: ahead must be an integer >= 0 (tokens), got {ahead!r}")
        self.blocks, self.grid, self.k = blocks, grid, k
        self.max_batch = max_batch or grid.num_seqs_buckets[-1]
        self.pool = blocks.num_free  # blocks admission may hand out (the block manager starts empty)
        self.ahead = lookahead(self.pool, self.max_batch, grid.max_model_len, blocks.block_size, blocks.groups,
                               1 + k) if ahead is None else ahead
        self.waiting: list[Request] = []
        self.rows: list[Request | None] = []  # batch rows; None: a row the last step's leaver freed
        self.seqs: dict[object, Seq] = {}  # block-manager key -> the engine's state of that request
        self.used = 0  # the admitted requests' budgets
        self._ctx = ctx_buckets_with_fallback(grid.ctx_buckets, grid.max_model_len)
        self._tables_of = BlockRows(blocks, self.max_batch, -(-(grid.max_model_len + k) // blocks.block_size))
        self._tables: dict | None = None  # the last step's tables while no request joined, left or moved a block
        self._cover = 0  # tokens their width covers

    @property
    def live(self) -> list[Request]:
        return [r for r in self.rows if r is not None]

    def peak_blocks(self, req: Request) -> int:
        """The most blocks a request holds over its life (prompt + tokens + drafts past the last, and ``ahead``)."""
        n = min(len(req.prompt) + req.max_new_tokens + self.k, self.grid.max_model_len)
        return blocks_needed(n, self.blocks.block_size, self.blocks.groups, 1 + self.k + self.ahead)

    def add(self, requests: list[Request]) -> None:
        """Queue ``requests``; refuse (exit 2) one that even an empty pool could not serve: waiting would not help.
        A request without a ``key`` gets ``req-{index}`` (the block manager's key from admission on)."""
        for r in requests:
            r.key = f"req-{r.index}" if r.key is None else r.key
            seq = Seq(r, self.peak_blocks(r), min(len(r.prompt) + r.max_new_tokens + self.k, self.grid.max_model_len))
            if seq.need > self.pool:
                raise InvalidInput(f"request {r.id!r}: needs {seq.need} KV blocks at its longest, the "
                                   f"bundle's pool holds {self.pool}; shorten it or build with more serving.num_blocks")
            self.seqs[r.key] = seq
        self.waiting = sorted(self.waiting + list(requests), key=lambda r: (r.arrival, r.index))

    def first_hold(self, req: Request) -> int:
        """The positions a request's first decode reserve holds after a local prefill of its prompt (its next
        token, ``ahead`` more, within its reach): a KV source that reserves this much at admission spares that
        reserve a table change."""
        n = len(req.prompt)
        return max(n, min(n + 1 + self.ahead, self.seqs[req.key].reach))

    def idle_until(self, t: int) -> int:
        """The next step at which anything can run: with nothing live, the first arrival (a rank alone skips the
        idle steps between; DP ranks step through them together)."""
        return max(t, self.waiting[0].arrival) if self.waiting and not self.live else t

    def admit(self, t: int) -> list[Request]:
        """The waiting requests that join at step ``t`` (taken off the queue, their budgets counted)."""
        out, free_rows = [], self.max_batch - len(self.live)
        while self.waiting and len(out) < free_rows and self.waiting[0].arrival <= t:
            need = self.seqs[self.waiting[0].key].need
            if self.used + need > self.pool:
                break  # first come, first served: it waits for blocks, and so does everything behind it
            self.used += need
            out.append(self.waiting.pop(0))
        return out

    def join(self, admitted: list[Request]) -> None:
        """The admitted requests, their KV in place, take the rows leavers freed, then new rows; one that is done
        already (local prefill's token was its only one) leaves. Rows still free are closed up from the end."""
        for r in admitted:
            if r.done:
                self.finish([r])
            elif None in self.rows:
                self.rows[self.rows.index(None)] = r
            else:
                self.rows.append(r)
        rows = self.rows
        while None in rows:
            while rows and rows[-1] is None:
                rows.pop()
            if None in rows:
                rows[rows.index(None)] = rows.pop()
        if admitted:
            self._tables = None

    def schedule(self, t: int) -> StepDecision:
        """The step's rows and batch: every row's blocks reserved for the positions it runs (its next token and
        drafts) and ``ahead`` more, the tables as wide as the context bucket the longest row needs."""
        rows, blocks, versions = self.live, self.blocks, self.blocks.versions
        tokens, computed, upto, keys = [], [], [], []
        changed, top, more = self._tables is None, 0, bool(self.waiting)
        for r in rows:
            seq, n = self.seqs[r.key], r.computed
            u = n + 1 + len(r.drafts)
            hold = seq.hold  # another part's reserve (a proposer's) moves the version
            if hold is None or u > hold[0] or versions.get(r.key) != hold[2]:
                seq.hold = blocks.reserve(r.key, max(u, min(u + self.ahead, seq.reach)), n)
                changed = True
            tokens.append([r.next, *r.drafts])
            computed.append(n)
            upto.append(u)
            keys.append(r.key)
            top = max(top, u)
            more = more or r.remaining > 1
        if changed or top > self._cover:  # the width (the tables' shape) changes only where the bucket does
            ctx = next((c for c in self._ctx if c >= top), top)
            self._tables, self._cover = self._tables_of(keys, upto, width=-(-ctx // blocks.block_size)), ctx
        return StepDecision(t, rows, StepBatch(tokens, computed, self._tables), more)

    def finish(self, reqs: list[Request]) -> None:
        """The requests leave: their blocks go back to the pool, their rows to the next joiner."""
        for r in reqs:
            seq = self.seqs.pop(r.key)
            self.used -= seq.need
            at = next((i for i, x in enumerate(self.rows) if x is r), None)  # by identity: requests compare by value
            if at is not None:
                self.rows[at] = None
            self.blocks.release(r.key)
        if reqs:
            self._tables = None
