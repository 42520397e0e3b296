"""The serving engine: one loop per rank over a waiting queue, a KV source, the Stepper and a proposer.

Every mode is this loop with other parts (serve/parts.py): plain greedy (``LocalPrefill``,
no proposer), EAGLE3 (``Eagle3Proposer``), DI (``NixlSource``), DP and sharded bundles (the
Stepper's group; ``LocalPrefill`` in lockstep where the prefill has collectives).

One engine step (``t`` counts decode steps, the clock of ``Request.arrival``):

1. **admit** -- waiting requests that have arrived (``arrival <= t``), in arrival then file
   order, while the live batch is below the largest batch bucket and the pool holds every
   live request's *peak* blocks plus the newcomer's (so a run never exhausts the pool
   mid-way: nothing is preempted). A request that cannot fit yet waits; one that could
   never fit in an empty pool is refused before anything runs (``check_fits``).
2. **propose** -- the proposer drafts k tokens for the requests with verified rows and room.
3. **step** -- reserve blocks (``ahead`` positions past the step's as well: the most the pool
   can spare without making admission wait, ``runtime.blocks.lookahead``; a request's tables
   then change once per ``ahead`` tokens), build the ``StepBatch`` of the live requests, ``Stepper.plan``
   (the one DP collective: it syncs the buckets and whether any rank still has work),
   ``Stepper.run``. A rank without requests runs the synced bucket with no rows.
4. **accept** -- greedy: the longest prefix of drafts equal to the target's argmax plus the
   bonus token (just the argmax without drafts); a request that reached its own
   ``max_new_tokens`` leaves and its blocks go back to the pool.

The loop stops when, in one step's collective, no rank has live, waiting or unfinished
requests: all ranks stop together. The batch and context buckets follow the live batch
both ways because every step plans from the requests live in it.

Timing (``EngineStats``): ``step_seconds`` per decode step (wall time of 1..4 above without
the KV source's prefill or transfer, the artifact included), ``run_seconds`` inside
``Stepper.run`` (metadata + artifact), ``plan_seconds`` inside ``Stepper.plan`` (buckets and
the DP collective), and ``engine_seconds``: the engine's own work (admission bookkeeping,
scheduling, block tables, acceptance), i.e. the step minus run, plan and proposer;
``accept_seconds`` is its greedy sampling and acceptance part (one argmax of the logits and
its ``tolist``, then per request the accepted prefix), the rest is admission, scheduling and
tables. On CPU the artifact runs between two engine phases and leaves the interpreter's
caches cold: a Python call then costs ~1.5 us and a torch op ~30 us (docs/benchmarks.md), so
the per-step path makes no torch call but the one argmax (see ``_batch``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from neffbuild.errors import InvalidInput
from neffbuild.runtime.blocks import BlockManager, blocks_needed, lookahead
from neffbuild.runtime.buckets import ctx_buckets_with_fallback
from neffbuild.runtime.dispatch import StepPlan
from neffbuild.runtime.kept_batch import KeptBatch
from neffbuild.runtime.step import StepBatch, Stepper
from neffbuild.serve.parts import BlockRows, KVSource, Proposer, Request


@dataclass
class EngineStats:
    plans: list[StepPlan] = field(default_factory=list)  # the steps' plans, then the draft calls'
    draft_calls: list[str] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)  # tokens this rank emitted per step
    run_seconds: float = 0.0  # Stepper.run: trimmed metadata + the artifact
    plan_seconds: float = 0.0  # Stepper.plan: buckets, family and the DP collective (the runtime's)
    engine_seconds: float = 0.0
    accept_seconds: float = 0.0  # the part of engine_seconds in greedy sampling (argmax) and acceptance
    source_seconds: float = 0.0  # prefill / transfers (admission's model work)
    proposed: int = 0
    accepted: int = 0
    # One (plan, num_reqs, step, accepted) per decode step that ran; ``steps`` words them when read,
    # so the step itself only appends a tuple.
    log: list[tuple[StepPlan, int, int, int]] = field(default_factory=list)
    speculative: bool = False

    @property
    def steps(self) -> list[dict]:
        """One entry per decode step that ran: the plan's JSON, ``num_reqs`` and ``step`` (+ ``query_len``
        and ``accepted`` with a proposer)."""
        out = []
        for plan, num_reqs, t, accepted in self.log:
            entry = dict(plan.to_json(), num_reqs=num_reqs, step=t)
            if self.speculative:
                entry.update(query_len=plan.query_len, accepted=accepted)
            out.append(entry)
        return out

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


class Engine:
    """One rank's engine over a Stepper, a block manager, a KV source and an optional proposer."""

    def __init__(self, stepper: Stepper, blocks: BlockManager, source: KVSource, proposer: Proposer | None = None,
                 *, max_batch: int | None = None, on_step: Callable[[StepPlan, object], None] | None = None,
                 ahead: int | None = None):
        self.stepper, self.blocks, self.source, self.proposer = stepper, blocks, source, proposer
        self.grid = stepper.grid
        self.max_batch = max_batch or self.grid.num_seqs_buckets[-1]
        self.k = proposer.k if proposer is not None else 0
        self.on_step = on_step
        self.stats = EngineStats(speculative=bool(self.k))
        self._budget: dict[object, int] = {}  # key -> peak blocks reserved for admission
        self._used = 0  # their sum
        self.pool = blocks.num_free  # blocks the engine may hand out (the block manager starts empty)
        if ahead is not None and (isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 0):
            raise InvalidInput(f"Engine: ahead must be an integer >= 0 (tokens), got {ahead!r}")
        self.ahead = (lookahead(self.pool, self.max_batch, self.grid.max_model_len, blocks.block_size, blocks.groups,
                                1 + self.k) if ahead is None else ahead)
        self._tables: dict | None = None  # the last step's tables (BlockRows), while no request changed them
        self._cover = 0  # tokens the last tables' width covers
        self._ctx = ctx_buckets_with_fallback(self.grid.ctx_buckets, self.grid.max_model_len)  # (ctx_bucket_for)
        self._rows = BlockRows(blocks, self.max_batch, -(-(self.grid.max_model_len + self.k) // blocks.block_size))
        # Plain decode (no proposer): the last batch, advanced in place by _accept, serves the next ``_steady``
        # steps while no request joins or leaves and no table changes (``_tick``: BlockManager.tick then).
        self._steady, self._last, self._tick, self._going, self._edge = 0, None, -1, False, False
        # (row, request moved there) for each row a finished request left at the last step: a request joining at
        # the next one takes that row and the moved request goes back to its own (one table row written, not two)
        self._holes: list[tuple[int, Request]] = []

    def peak_blocks(self, req: Request) -> int:
        """The most blocks a request holds over its life (prompt + tokens + drafts past the last, and the
        engine's ``ahead``)."""
        n = min(len(req.prompt) + req.max_new_tokens + self.k, self.grid.max_model_len)
        return blocks_needed(n, self.blocks.block_size, self.blocks.groups, 1 + self.k + self.ahead)

    def check_fits(self, reqs: list[Request]) -> None:
        """Refuse (exit 2) a request that even an empty pool could not serve: waiting would not help. Sets each
        request's ``key`` (if it has none), ``reach`` and ``need`` (its peak blocks), which admission then reads."""
        mml = self.grid.max_model_len
        for r in reqs:
            r.key = f"req-{r.index}" if r.key is None else r.key  # the block manager's key, from admission on
            r.reach, r.ahead = min(len(r.prompt) + r.max_new_tokens + self.k, mml), self.ahead
            r.need = self.peak_blocks(r)
            if r.need > self.pool:
                raise InvalidInput(f"request {r.id!r}: needs {r.need} KV blocks at its longest, the "
                                   f"bundle's pool holds {self.pool}; shorten it or build with more serving.num_blocks")

    def run(self, requests: list[Request]) -> list[Request]:
        """Serve ``requests`` (this rank's) to the end; returns them with tokens and step indices. Requests are
        checked as the CLI checks a request file (InvalidInput naming the request and the field)."""
        from neffbuild.serve.requests import check_fields

        check_fields(requests, self.stepper.vocab_size, self.grid.max_model_len)
        self.check_fits(requests)
        waiting = sorted(requests, key=lambda r: (r.arrival, r.index))
        live: list[Request] = []
        check = getattr(self.source, "check", None)  # optional: a KV source that can die between admissions
        source, stats, clock, max_batch = self.source, self.stats, time.perf_counter, self.max_batch
        proposer, collective = self.proposer, source.collective
        solo = self.stepper.group is None and not collective
        # The step's timings add up in locals and go to ``stats`` when the run ends (or fails): the per-step path
        # then makes no attribute write for them. A step's wall time runs from its first clock read to its last; the
        # timing's own bookkeeping (these sums, the per-step lists) falls between two steps, outside both.
        step_seconds, step_tokens = stats.step_seconds.append, stats.step_tokens.append
        source_t = run_t = plan_t = engine_t = accept_t = 0.0
        t = 0
        try:
            while True:
                if not live and waiting and solo:
                    t = max(t, waiting[0].arrival)  # nothing runs until then: skip the idle steps (DP ranks count them)
                t0 = clock()
                if waiting and len(live) < max_batch and waiting[0].arrival <= t:  # (_admissible's common "no")
                    admit = self._admissible(waiting, live, t)
                else:
                    admit = ()
                if check is not None and len(waiting) > len(admit):
                    check(waiting[len(admit)])  # a remote KV source still alive for what waits (rate-limited)
                source_s = propose_s = 0.0
                if admit:
                    self._steady, self._last = 0, None  # the live set changes: the next batch is built afresh
                if admit or collective:
                    s0 = clock()
                    source.admit(list(admit), self.blocks)
                    source_s = clock() - s0
                    self._join(admit, waiting, live)
                if proposer is not None and live:
                    p0 = clock()
                    label = proposer.propose(live, self.blocks)
                    propose_s = clock() - p0
                    if label:
                        stats.draft_calls.append(label)
                # "more": this rank has work after this step for sure or maybe (a draft may finish a request early)
                batch = self._last
                if batch is not None and self._steady and self.blocks.tick == self._tick:
                    self._steady -= 1  # plain decode's kept batch, moved on by _accept: no pass (see _batch)
                    more = self._going or bool(waiting)
                else:
                    batch, more = self._batch(live, bool(waiting))
                q0 = clock()  # one clock read between phases (each read costs ~1 us here)
                plan = self.stepper.plan(batch, more=more)
                q1 = clock()
                if plan.any_work:
                    out = self.stepper.run(plan, batch)
                    r1 = clock()
                    emitted, finished = self._accept(live, out, plan, t)
                    now = clock()
                    accept_t += now - r1
                    if finished:
                        for r in finished:  # the last live request takes the row: one row rewritten, not all after
                            at = live.index(r)
                            live[at] = live[-1]
                            live.pop()
                            if at < len(live):  # (a request joining next step takes the row instead: see _join)
                                self._holes.append((at, live[at]))
                            self._leave(r)
                        now = clock()
                    wall = now - t0 - source_s  # the step, its KV source's prefill or transfer left out
                    step_seconds(wall)
                    step_tokens(emitted)
                    run_t += r1 - q1
                    plan_t += q1 - q0
                    engine_t += wall - propose_s - (r1 - q0)  # less the proposer, the plan and the run
                else:
                    now = clock()
                source_t += source_s
                if not plan.more:
                    break
                t += 1
        finally:
            stats.source_seconds += source_t
            stats.run_seconds += run_t
            stats.plan_seconds += plan_t
            stats.engine_seconds += engine_t
            stats.accept_seconds += accept_t
        return requests

    def _join(self, admit: list[Request], waiting: list[Request], live: list[Request]) -> None:
        """The admitted requests (their KV in place) join the live batch; one that local prefill already finished
        leaves. A row that the last step's leave emptied is taken first, and the request moved there goes back to
        its own row: one table row written, not two."""
        holes = self._holes
        del waiting[: len(admit)]  # admission takes the waiting requests from the front, in order
        for r in admit:
            if len(r.tokens) >= r.max_new_tokens:  # done: local prefill's token was its only one
                self._leave(r)
                continue
            while holes:
                at, moved = holes.pop()
                if at < len(live) and live[at] is moved:
                    live[at] = r
                    r = moved
                    break
            live.append(r)

    def _admissible(self, waiting: list[Request], live: list[Request], t: int) -> list[Request]:
        """The requests to admit this step: always a prefix of ``waiting`` (first come, first served; _join cuts it).
        ``run`` calls it only when one has arrived and a row is free."""
        free_slots = self.max_batch - len(live)
        out, used = [], self._used
        for r in waiting:
            if r.arrival > t or len(out) >= free_slots:
                break
            if used + r.need > self.pool:  # r.need: check_fits
                break  # first come, first served: a later, smaller request does not jump the queue
            used += r.need
            out.append(r)
            self._budget[r.key] = r.need  # r.key: check_fits
        self._used = used
        return out

    def _batch(self, live: list[Request], more: bool) -> tuple[StepBatch, bool]:
        """The step's batch, and whether this rank has work after it (``more``: waiting requests, or a
        live one with more than one token to go).

        Everything here runs with the interpreter's caches cold (the artifact ran since), where a
        call costs ~1.5 us and a torch op ~30: so one pass over the live requests, the block manager
        asked only for a request whose next positions leave its held blocks (``Request.hold``), and
        the tables of the step before reused while no request joined, left or crossed a block.

        A request's sliding-window blocks that fall out of the window go back to the pool at its
        next block boundary (the same ``reserve``), not at the step they fall out: between two
        boundaries it holds what it held at the last one, never more than its peak (admission's
        budget), and its tables change once per ``block_size`` tokens instead of twice.

        Plain decode goes further: every step moves each request one position, so the positions at
        which the next block boundary or wider context bucket comes are known here (``slack``); until
        then the batch of this step (a ``KeptBatch``), its tokens and positions advanced in place by
        ``_accept``, each row checked as it moves, is the next one: ``run`` takes it without calling this (one
        call less on the common step) while ``_steady`` counts down, and this steps it on at a block boundary."""
        last = self._last
        if last is not None and self.blocks.tick == self._tick and not self._edge and self._step_on(live, last):
            return last, more or self._going  # the same requests, no other part's reserve: stepped on
        self._holes.clear()  # a full pass places the requests where they are
        tokens, computed, upto, keys = [], [], [], []
        changed, top, versions, ahead = self._tables is None, 0, self.blocks.versions, self.ahead
        slack = 1 << 30
        for r in live:
            n = r.computed
            u = n + 1 + len(r.drafts)
            hold = r.hold  # set here; another part's reserve (a proposer's) moves the version
            if hold is None or u > hold[0] or versions.get(r.key) != hold[2]:
                # ``ahead`` more positions (to its last one at most): the next reserve comes that much later. Sliding
                # blocks out of the window go back here, not earlier.
                r.hold = hold = self.blocks.reserve(r.key, max(u, min(u + ahead, r.reach)), n)  # its hold_limits
                changed = True
            s = hold[0] - u  # steps until this request needs a new block
            slack = s if s < slack else slack
            d = r.drafts
            tokens.append([r.next, *d] if d else [r.next])
            computed.append(n)
            upto.append(u)
            keys.append(r.key)
            top = u if u > top else top
            if not more and r.max_new_tokens - len(r.tokens) > 1:  # (Request.remaining)
                more = True
        if changed or top > self._cover:
            # As wide as the context bucket the longest needs (the columns the graph reads): the
            # width, and so the tables' shape, changes only where the bucket does.
            for ctx in self._ctx:  # ctx_bucket_for: the smallest context bucket (or max_model_len) covering top
                if ctx >= top:
                    break
            else:
                ctx = top
            self._tables = self._rows(keys, upto, width=-(-ctx // self.blocks.block_size))
            self._cover = ctx
        if self.proposer is None and live:  # kept and advanced in place: its rows are checked as they change
            batch = self._last = KeptBatch(tokens, computed, self._tables)
            self._count_down(slack, top)
        else:
            batch = StepBatch(tokens, computed, self._tables)
        return batch, more

    def _step_on(self, live: list[Request], last: KeptBatch) -> bool:
        """Plain decode at a block boundary, the same requests as the kept batch's: reserve for the requests
        whose next position leaves their blocks, rewrite their rows (the kept batch's tables are a view of
        them), count the slack anew. False (nothing rewritten) when the batch needs a wider context bucket: the
        full pass builds the wider tables."""
        blocks, slack, top, moved, ahead = self.blocks, 1 << 30, 0, [], self.ahead
        for i, r in enumerate(live):
            u = r.computed + 1
            hold = r.hold
            if u > hold[0]:
                r.hold = hold = blocks.reserve(r.key, max(u, min(u + ahead, r.reach)), u - 1)
                moved.append(i)
            s = hold[0] - u
            slack = s if s < slack else slack
            top = u if u > top else top
        if top > self._cover:
            return False
        if moved:
            self._rows.rewrite(moved, [live[i].key for i in moved])
        self._count_down(slack, top)
        return True

    def _count_down(self, slack: int, top: int) -> None:
        """The kept batch serves the next steps until a request needs a block (``slack``), the batch a wider
        bucket or max_model_len comes, or another part reserves (``_tick``)."""
        edge = min(self._cover - top, self.grid.max_model_len - top)
        self._steady = max(0, min(slack, edge))
        self._edge = edge <= slack  # it ends at the bucket's edge: the next step builds afresh (no _step_on)
        self._tick = self.blocks.tick

    def _accept(self, live: list[Request], out, plan: StepPlan, t: int) -> tuple[int, list[Request]]:
        """Greedy acceptance of the step's output: (tokens emitted, the requests it finished)."""
        q, total, emitted_all, finished, going = plan.query_len, 0, 0, [], False
        after_step = self.proposer.after_step if self.proposer is not None else None
        last = self._last  # the kept batch (plain decode): advanced in place, where the runtime takes each
        # row's argmax and moves it on one position, its input check kept (KeptBatch)
        greedy = last.advance_greedy(out.logits) if last is not None else out.logits.argmax(-1).tolist()  # [R][q]
        for i, (r, g) in enumerate(zip(live, greedy, strict=True)):
            if q == 1:
                emitted = [g[0]]  # a live request has at least one token to go
            else:
                a, drafts = 0, r.drafts
                while a < q - 1 and drafts[a] == g[a]:
                    a += 1
                emitted = (drafts[:a] + [g[a]])[: r.remaining]
                total += a
            first_pos = r.computed
            r.tokens.extend(emitted)
            r.next, r.drafts = emitted[-1], []
            r.computed += len(emitted)
            if r.first_step is None:
                r.first_step = t
            r.last_step = t
            emitted_all += len(emitted)
            left = r.max_new_tokens - len(r.tokens)
            if left <= 0:  # Request.done
                finished.append(r)
            elif left > 1:
                going = True
            if after_step is not None:
                aux = out.aux_hidden[i, : len(emitted)] if out.aux_hidden is not None else None
                after_step(r, emitted, aux, first_pos)
        self._going = going
        self.stats.proposed += (q - 1) * len(live)
        self.stats.accepted += total
        self.stats.log.append((plan, len(live), t, total))
        self.stats.plans.append(plan)
        if self.on_step:
            self.on_step(plan, out)
        return emitted_all, finished

    def _leave(self, r: Request) -> None:
        self._steady, self._last = 0, None
        self._used -= self._budget.pop(r.key, 0)
        self._tables, r.hold = None, None  # the live set changed: the next step builds its tables
        self.blocks.release(r.key)
