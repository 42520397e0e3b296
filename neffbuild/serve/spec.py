"""EAGLE3 greedy speculative decoding through a bundle's three families.

Each round: **verify** (the target runs ``[next token, d1..dk]`` at query 1+k, or only the
next token without spec) -> **accept** (the longest prefix of drafts equal to the
target's argmax, plus the bonus token: exactly what plain greedy would emit) ->
**propose** (one draft call catches up on the verified rows and proposes k new drafts).

The family is the step API's choice (runtime/step.py): with-spec only when every request
hands k drafts and ``max_position + k + 1 <= max_model_len``; the veto rides in the step's
one MAX all-reduce, so all DP ranks run the same target artifact, and a step where no
rank has work (``plan.any_work`` false) ends the loop on every rank. A request stops
drafting for good once it has no room, so near the end a mixed batch runs without spec.
The draft is dense (no MoE collectives): its call is per rank and not synced.

KV for rejected tokens needs no work: ``computed`` advances by the accepted count + 1
only; the slots past it hold rejected drafts (target) or speculative rows (draft), which
the causal mask hides and the next step overwrites before any query can see them. Blocks
stay reserved: the next step needs them anyway.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from neffbuild import registry
from neffbuild.models.eagle3.config import Eagle3Config
from neffbuild.models.eagle3.draft import Eagle3Draft
from neffbuild.models.eagle3.draft import prefill as draft_prefill
from neffbuild.runtime.blocks import FULL_GROUP, SLIDING_GROUP, BlockManager
from neffbuild.runtime.dispatch import DRAFT, StepPlan, plan_draft
from neffbuild.runtime.step import StepBatch, Stepper
from neffbuild.serve.greedy import tables_for

# (draft plan, requests) -> proposed target ids [len(requests), k]: replaces the draft artifact (tests)
Proposer = Callable[[StepPlan, list], torch.Tensor]


@dataclass
class SpecRequest:
    rid: int
    want: int  # tokens to generate
    computed: int  # tokens in the target KV (= position of out[-1])
    out: list[int] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)
    verified: tuple | None = None  # (tokens [n], aux [n, A], first position): the next draft call's rows

    @property
    def done(self) -> bool:
        return len(self.out) >= self.want


@dataclass
class SpecStats:
    proposed: int = 0
    accepted: int = 0
    steps: list[dict] = field(default_factory=list)  # one entry per target step
    plans: list[StepPlan] = field(default_factory=list)  # target steps, then the draft calls' plans
    draft_calls: list[str] = field(default_factory=list)
    decode_seconds: float = 0.0
    decode_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


class SpecLoop:
    """One rank's speculative loop over a Stepper (target + draft artifacts) and a block manager."""

    def __init__(self, stepper: Stepper, blocks: BlockManager, cfg, dcfg: Eagle3Config, weights: dict, *,
                 proposer: Proposer | None = None):
        self.stepper, self.blocks, self.cfg, self.dcfg, self.weights = stepper, blocks, cfg, dcfg, weights
        self.grid, self.k = stepper.grid, stepper.grid.num_speculative_tokens
        self.packed_k = stepper.kv_layout.packed_k
        self.target_prefill = registry.arch_of(cfg).get("prefill")
        self.eager_draft = Eagle3Draft(dcfg, weights, num_speculative_tokens=self.k, packed_k=self.packed_k).eval()
        self.proposer = proposer
        self.stats = SpecStats()

    def prefill(self, rid: int, prompt: list[int], want: int) -> SpecRequest:
        """Target KV + aux states for the prompt, then the draft's KV for positions 0..N-2."""
        n = len(prompt)
        self.blocks.reserve(rid, n, n)
        rows = {g: t[0] for g, t in tables_for(self.blocks, [rid], [n]).items()}
        logits, aux = self.target_prefill(self.cfg, self.weights, prompt, self.stepper.kv_caches, rows[FULL_GROUP],
                                          rows.get(SLIDING_GROUP, rows[FULL_GROUP]), packed_k=self.packed_k,
                                          aux_layers=self.dcfg.aux_layers)
        first = int(logits[-1].argmax())
        draft_prefill(self.eager_draft, torch.as_tensor(prompt[1:], dtype=torch.long), aux[:-1],
                      self.stepper.draft_cache, rows[FULL_GROUP])
        return SpecRequest(rid, want, n, [first], verified=([first], aux[-1:], n - 1))

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        reqs = [self.prefill(n, p, max_new_tokens) for n, p in enumerate(prompts)]
        start = time.perf_counter()
        live = [r for r in reqs if not r.done]
        self.propose(live)
        while self.target_step(live):
            for r in live:
                if r.done:
                    self.blocks.release(r.rid)
            live = [r for r in live if not r.done]
            self.propose(live)
        self.stats.decode_seconds = time.perf_counter() - start
        self.stats.decode_tokens = sum(r.want - 1 for r in reqs)
        return [r.out[: r.want] for r in reqs]

    # -- verify + accept
    def target_step(self, active: list[SpecRequest]) -> bool:
        """One target step for this rank's ``active`` requests; False once no rank has work."""
        for r in active:
            self.blocks.reserve(r.rid, r.computed + 1 + len(r.drafts), r.computed)
        batch = StepBatch([[r.out[-1]] + r.drafts for r in active], [r.computed for r in active],
                          tables_for(self.blocks, [r.rid for r in active],
                                     [r.computed + 1 + len(r.drafts) for r in active]))
        plan = self.stepper.plan(batch)
        if not plan.any_work:
            return False
        out = self.stepper.run(plan, batch)
        accepted = self._accept(active, out.logits.argmax(-1), out.aux_hidden, plan.query_len)
        self.stats.steps.append(dict(plan.to_json(), query_len=plan.query_len, num_reqs=len(active),
                                     accepted=accepted))
        self.stats.plans.append(plan)
        return True

    def _accept(self, active: list[SpecRequest], greedy: torch.Tensor, aux: torch.Tensor, q: int) -> int:
        total = 0
        for i, r in enumerate(active):
            g = greedy[i].tolist()  # [q] the target's argmax after each input token
            a = 0
            while a < q - 1 and r.drafts[a] == g[a]:
                a += 1
            emitted = r.drafts[:a] + [g[a]]
            r.out.extend(emitted)
            r.drafts, r.verified = [], (emitted, aux[i, : a + 1], r.computed)
            r.computed += a + 1
            total += a
            self.stats.proposed += q - 1
        self.stats.accepted += total
        return total

    # -- propose
    def propose(self, reqs: list[SpecRequest]) -> None:
        """Draft k tokens for every request with room for a with-spec step after this one."""
        k, ready = self.k, []
        for r in reqs:
            if r.verified is not None and r.computed + k + 1 <= self.grid.max_model_len:
                ready.append(r)
            else:
                r.verified = None  # no room: this request runs without spec until it ends
        if not ready:
            return
        for r in ready:
            self.blocks.reserve(r.rid, r.computed + k + 1, r.computed)
        top = max(r.computed for r in ready)
        if self.proposer is not None:
            plan = plan_draft(self.grid, num_reqs=len(ready), max_computed=top)
            drafts = self.proposer(plan, ready)
        else:
            full = tables_for(self.blocks, [r.rid for r in ready], [r.computed + k + 1 for r in ready])[FULL_GROUP]
            plan, drafts = self.stepper.draft([r.verified for r in ready], full, max_computed=top)
        for r, d in zip(ready, drafts[: len(ready)].tolist(), strict=True):
            r.drafts, r.verified = d, None
        self.stats.draft_calls.append(plan.label)
        self.stats.plans.append(plan)


@dataclass
class EagerSpecArtifacts:
    """Eager target (with aux outputs) for target labels and the eager draft for draft labels."""

    spec: object
    kv_layout: object
    num_swa: int
    target: torch.nn.Module
    draft: torch.nn.Module

    def artifact(self, label: str):
        module = self.draft if label.startswith(DRAFT) else self.target
        return torch.no_grad()(module.forward)
