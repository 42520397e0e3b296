"""EAGLE3 greedy speculative decoding through a bundle's three families.

Each round: **verify** (the target runs ``[next token, d1..dk]`` at query 1+k, or only the
next token without spec) -> **accept** (the longest prefix of drafts equal to the
target's argmax, plus the bonus token: exactly what plain greedy would emit) ->
**propose** (one draft call catches up on the verified rows and proposes k new drafts).

Family per step: with-spec only when every request has k drafts and
``max_position + k + 1 <= max_model_len``; otherwise without-spec. Each rank's veto, its
padded batch and its needed context travel in the step's one MAX all-reduce, so all DP
ranks run the same target artifact (and a global batch of 0 ends the loop on every rank).
The draft is dense (no MoE collectives), so its call is per rank and needs no sync.

KV for rejected tokens needs no work: ``num_computed`` advances by the accepted count + 1
only; the slots past it hold rejected drafts (target) or speculative draft rows (draft),
which the causal mask hides and the next step overwrites before any query can see them.
Blocks stay reserved: the next step needs them anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from neffbuild.models.eagle3.config import Eagle3Config
from neffbuild.models.eagle3.draft import Eagle3Draft
from neffbuild.models.eagle3.draft import prefill as draft_prefill
from neffbuild.models.gpt_oss.config import GptOssConfig
from neffbuild.models.gpt_oss.prefill import prefill as target_prefill
from neffbuild.runtime import attn_metadata, buckets, dp_sync
from neffbuild.runtime.decoder import Decoder
from neffbuild.runtime.dispatch import StepPlan, must_run_without_spec, plan_draft, plan_spec_step
from neffbuild.runtime.kv_cache import allocate_draft
from neffbuild.runtime.spec_inputs import DraftInputs, build_draft

# (plan, draft inputs, requests) -> proposed target ids [len(requests), k]
Proposer = Callable[[StepPlan, DraftInputs, list], torch.Tensor]


@dataclass
class SpecRequest:
    rid: int
    want: int  # tokens to generate
    out: list[int] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)
    verified: tuple | None = None  # (tokens [n], aux [n, 3H], first position): the next draft call's rows

    @property
    def done(self) -> bool:
        return len(self.out) >= self.want


@dataclass
class SpecStats:
    proposed: int = 0
    accepted: int = 0
    steps: list[dict] = field(default_factory=list)  # one entry per target step
    draft_calls: list[str] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


class SpecLoop:
    """One rank's speculative loop. ``decoder`` holds blocks and the target KV; its runner maps
    a plan to the callable for its label (target families and the draft family alike)."""

    def __init__(self, decoder: Decoder, cfg: GptOssConfig, dcfg: Eagle3Config, weights: dict, *,
                 proposer: Proposer | None = None):
        self.decoder, self.cfg, self.dcfg, self.weights = decoder, cfg, dcfg, weights
        self.spec, self.k = decoder.spec, decoder.spec.num_speculative_tokens
        self.packed_k = decoder.layout.packed_k
        self.draft_cache = allocate_draft(decoder.layout)
        self.eager_draft = Eagle3Draft(dcfg, weights, num_speculative_tokens=self.k, packed_k=self.packed_k).eval()
        self.proposer = proposer or self.run_draft
        self.stats = SpecStats()

    # -- prefill: target KV + aux states, then the draft's KV for the prompt
    def prefill(self, rid: int, prompt: list[int], want: int) -> SpecRequest:
        dec = self.decoder
        dec.add_request(rid, len(prompt))
        full, swa = dec.table_rows(rid)
        logits, aux = target_prefill(self.cfg, self.weights, prompt, dec.kv_caches, full, swa, packed_k=self.packed_k,
                                     aux_layers=self.dcfg.aux_layers)
        dec.requests[rid].num_computed = len(prompt)
        first = int(logits[-1].argmax())
        draft_prefill(self.eager_draft, torch.as_tensor(prompt[1:], dtype=torch.long), aux[:-1], self.draft_cache, full)
        return SpecRequest(rid, want, [first], verified=([first], aux[-1:], len(prompt) - 1))

    def generate(self, prompts: list[list[int]], max_new_tokens: int, rid_base: int = 0) -> list[list[int]]:
        reqs = [self.prefill(rid_base + n, p, max_new_tokens) for n, p in enumerate(prompts)]
        self.propose([r for r in reqs if not r.done])
        while True:
            active = [r for r in reqs if not r.done]
            if not self.target_step(active):
                break
            for r in active:
                if r.done:
                    self.decoder.finish(r.rid)
            self.propose([r for r in active if not r.done])
        return [r.out[: r.want] for r in reqs]

    # -- verify + accept
    def target_step(self, active: list[SpecRequest]) -> bool:
        """One target step for this rank's ``active`` requests; False once no rank has work."""
        dec = self.decoder
        computed = [dec.requests[r.rid].num_computed for r in active]
        veto = must_run_without_spec(self.spec, computed, all_have_drafts=all(len(r.drafts) == self.k for r in active))
        padded = buckets.bucket_for(len(active), self.spec.num_seqs_buckets) if active else 0
        padded, needed, veto = dp_sync.sync_step(padded, buckets.needed_seq(computed) if active else 0, dec.group,
                                                 spec_flags=(int(veto),))
        if padded == 0:
            return False
        plan = plan_spec_step(self.spec, batch_count=padded, needed=needed, without_spec=bool(veto),
                              num_reqs=len(active))
        q = plan.query_len
        for r, p in zip(active, computed, strict=True):
            dec.reserve(dec.requests[r.rid], p + q)
        tokens = torch.tensor([[r.out[-1]] + r.drafts[: q - 1] for r in active], dtype=torch.long).reshape(-1, q)
        inputs = attn_metadata.build(tokens, torch.tensor(computed, dtype=torch.long), *self._tables(active),
                                     batch=plan.batch, ctx=plan.ctx, block_size=dec.layout.block_size,
                                     num_swa=dec.num_swa)
        logits, aux = dec.runner(plan)(*inputs.as_args(dec.kv_caches))
        accepted = self._accept(active, computed, logits[: len(active)].argmax(-1), aux, q)
        self.stats.steps.append(dict(plan.to_json(), query_len=q, num_reqs=len(active), accepted=accepted))
        dec.executions[plan.label] += 1
        dec.padding_rows += plan.padding
        dec.total_rows += plan.batch
        return True

    def _accept(self, active, computed, greedy: torch.Tensor, aux: torch.Tensor, q: int) -> int:
        total = 0
        for i, (r, p) in enumerate(zip(active, computed, strict=True)):
            g = greedy[i].tolist()  # [q] the target's argmax after each input token
            a = 0
            while a < q - 1 and r.drafts[a] == g[a]:
                a += 1
            emitted = r.drafts[:a] + [g[a]]
            r.out.extend(emitted)
            r.drafts, r.verified = [], (emitted, aux[i, : a + 1], p)
            self.decoder.requests[r.rid].num_computed = p + a + 1
            total += a
            self.stats.proposed += q - 1
        self.stats.accepted += total
        return total

    # -- propose
    def propose(self, reqs: list[SpecRequest]) -> None:
        """Draft k tokens for every request with room for a with-spec step after this one."""
        dec, k = self.decoder, self.k
        ready = []
        for r in reqs:
            p = dec.requests[r.rid].num_computed
            if r.verified is not None and p + k + 1 <= self.spec.max_model_len:
                ready.append(r)
            else:
                r.verified = None  # no room: this request runs without spec until it ends
        if not ready:
            return
        plan = plan_draft(self.spec, num_reqs=len(ready), max_computed=max(dec.requests[r.rid].num_computed
                                                                            for r in ready))
        for r in ready:
            dec.reserve(dec.requests[r.rid], dec.requests[r.rid].num_computed + k + 1)
        inputs = build_draft([r.verified for r in ready], self._tables(ready)[0], batch=plan.batch, ctx=plan.ctx,
                             query_len=1 + k, block_size=dec.layout.block_size, hidden_size=3 * self.cfg.hidden_size)
        drafts = self.proposer(plan, inputs, ready)
        for r, d in zip(ready, drafts[: len(ready)].tolist(), strict=True):
            r.drafts, r.verified = d, None
        self.stats.draft_calls.append(plan.label)
        dec.executions[plan.label] += 1

    def run_draft(self, plan: StepPlan, inputs: DraftInputs, _reqs) -> torch.Tensor:
        return self.decoder.runner(plan)(*inputs.as_args(self.draft_cache))

    def _tables(self, reqs) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [self.decoder.table_rows(r.rid) for r in reqs]
        if not rows:
            empty = torch.zeros((0, self.decoder.max_blocks), dtype=torch.long)
            return empty, empty
        return torch.stack([a for a, _ in rows]), torch.stack([b for _, b in rows])


def eager_runner(target, draft):
    """Runner for eager modules (tests, --check): target families -> ``target``, draft -> ``draft``."""
    def run(plan: StepPlan):
        return torch.no_grad()((draft if plan.family == "draft" else target).forward)

    return run
