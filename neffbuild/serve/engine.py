"""The serving engine: per rank, a loop that decides, runs, then updates.

Every mode is this loop with other parts (serve/parts.py): plain greedy (``LocalPrefill``,
no proposer), EAGLE3 (``Eagle3Proposer``), DI (``NixlSource``), DP and sharded bundles (the
Stepper's group; ``LocalPrefill`` in lockstep where the prefill has collectives).

One engine step (``t`` counts decode steps, the clock of ``Request.arrival``):

1. **admit** -- the scheduler (serve/scheduler.py) picks the waiting requests that join; the
   KV source puts their prompts' KV in place; they take free rows. A request that could
   never fit in an empty pool is refused before anything runs.
2. **propose** -- the proposer drafts k tokens for the requests with verified rows and room.
3. **decide** -- the scheduler's ``StepDecision``: rows, blocks reserved, the ``StepBatch``.
4. **run** -- ``Stepper.plan`` (the one DP collective: it syncs the buckets and whether any
   rank still has work), then ``Stepper.run``. A rank without requests runs the synced
   bucket with no rows.
5. **update** -- greedy acceptance (serve/sampling.py): the longest prefix of drafts equal to
   the target's argmax plus the bonus token (just the argmax without drafts); a request that
   reached its own ``max_new_tokens`` leaves and its blocks go back to the pool.

The loop stops when, in one step's collective, no rank has live, waiting or unfinished
requests: all ranks stop together. The batch and context buckets follow the live batch
both ways because every step plans from the requests live in it.

Timing (``EngineStats``): ``step_seconds`` per decode step (wall time of 1..5 without the KV
source's prefill or transfer, the artifact included), ``run_seconds`` inside ``Stepper.run``
(metadata + artifact), ``plan_seconds`` inside ``Stepper.plan`` (buckets and the DP
collective), and ``engine_seconds``: the engine's own work (admission, scheduling, block
tables, acceptance), i.e. the step minus run, plan and proposer; ``accept_seconds`` is its
update part (the argmax of the logits and its ``tolist``, then per request the accepted prefix).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from neffbuild.runtime.kv.blocks import BlockManager
from neffbuild.runtime.step.dispatch import StepPlan
from neffbuild.runtime.step.stepper import Stepper
from neffbuild.serve import sampling
from neffbuild.serve.parts import KVSource, Proposer, Request
from neffbuild.serve.requests import check_fields
from neffbuild.serve.scheduler import Scheduler, StepDecision


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
    """One rank's engine over a Stepper, a block manager, a KV source and an optional proposer.

    ``scheduler`` (public) holds the queue, the rows and the look-ahead (``scheduler.ahead``);
    ``on_step(plan, out)`` is called after each step's update, before its finished requests leave.
    """

    def __init__(self, stepper: Stepper, blocks: BlockManager, source: KVSource, proposer: Proposer | None = None,
                 *, max_batch: int | None = None, on_step: Callable[[StepPlan, object], None] | None = None,
                 ahead: int | None = None):
        self.stepper, self.blocks, self.source, self.proposer = stepper, blocks, source, proposer
        k = proposer.k if proposer is not None else 0
        self.scheduler = Scheduler(blocks, stepper.grid, k=k, max_batch=max_batch, ahead=ahead)
        self.on_step = on_step
        self.stats = EngineStats(speculative=bool(k))

    def run(self, requests: list[Request]) -> list[Request]:
        """Serve ``requests`` (this rank's) to the end; returns them with tokens and step indices. Requests are
        checked as the CLI checks a request file (InvalidInput naming the request and the field)."""
        sched, stats, clock = self.scheduler, self.stats, time.perf_counter
        check_fields(requests, self.stepper.vocab_size, self.stepper.grid.max_model_len)
        sched.add(requests)
        solo = self.stepper.group is None and not self.source.collective
        t = 0
        while True:
            if solo:
                t = sched.idle_until(t)  # nothing can run before then: skip the idle steps (DP ranks count them)
            t0 = clock()
            source_s = self._admit(t)
            propose_s = self._propose()
            decision = sched.schedule(t)
            q0 = clock()
            plan = self.stepper.plan(decision.batch, more=decision.more)
            q1 = clock()
            if plan.any_work:
                out = self.stepper.run(plan, decision.batch)
                r1 = clock()
                emitted = self._update(decision, out, plan)
                now = clock()
                wall = now - t0 - source_s  # the step, its KV source's prefill or transfer left out
                stats.step_seconds.append(wall)
                stats.step_tokens.append(emitted)
                stats.run_seconds += r1 - q1
                stats.plan_seconds += q1 - q0
                stats.accept_seconds += now - r1
                stats.engine_seconds += wall - propose_s - (r1 - q0)  # less the proposer, the plan and the run
            stats.source_seconds += source_s
            if not plan.more:
                return requests
            t += 1

    def _admit(self, t: int) -> float:
        """Step 1: who joins, their KV through the source, their rows; the seconds the source took."""
        sched = self.scheduler
        admit = sched.admit(t)
        check = getattr(self.source, "check", None)  # optional: a KV source that can die between admissions
        if check is not None and sched.waiting:
            check(sched.waiting[0])  # still alive for what waits (rate-limited by the source)
        seconds = 0.0
        if admit or self.source.collective:  # a collective source takes part at every step
            s0 = time.perf_counter()
            self.source.admit(admit, self.blocks, [sched.first_hold(r) for r in admit])
            seconds = time.perf_counter() - s0
        sched.join(admit)
        return seconds

    def _propose(self) -> float:
        """Step 2: the proposer's drafts for the live rows; the seconds it took."""
        live = self.scheduler.live
        if self.proposer is None or not live:
            return 0.0
        p0 = time.perf_counter()
        label = self.proposer.propose(live, self.blocks)
        if label:
            self.stats.draft_calls.append(label)
        return time.perf_counter() - p0

    def _update(self, decision: StepDecision, out, plan: StepPlan) -> int:
        """Step 5: the step's output into each row's request; the finished leave. Returns the tokens emitted."""
        t, accepted, emitted_all, finished = decision.t, 0, 0, []
        after_step = self.proposer.after_step if self.proposer is not None else None
        for i, (r, target) in enumerate(zip(decision.rows, sampling.greedy(out.logits), strict=True)):
            emitted, a = sampling.accept(r.drafts, target, r.remaining)
            first_pos = r.computed
            r.tokens.extend(emitted)
            r.next, r.drafts = emitted[-1], []
            r.computed += len(emitted)
            r.first_step = t if r.first_step is None else r.first_step
            r.last_step = t
            emitted_all += len(emitted)
            accepted += a
            if r.done:
                finished.append(r)
            if after_step is not None:
                aux = out.aux_hidden[i, : len(emitted)] if out.aux_hidden is not None else None
                after_step(r, emitted, aux, first_pos)
        q, stats = plan.query_len, self.stats
        stats.proposed += (q - 1) * len(decision.rows)
        stats.accepted += accepted
        stats.log.append((plan, len(decision.rows), t, accepted))
        stats.plans.append(plan)
        if self.on_step:
            self.on_step(plan, out)
        self.scheduler.finish(finished)
        return emitted_all
