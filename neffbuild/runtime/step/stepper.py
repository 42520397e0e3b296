"""The per-step API serving engines call: plan -> DP sync -> trimmed metadata -> artifact.

An engine hands over its view of one step (per request: tokens already computed, the
tokens to run now, its block-table row per KV group) and gets back the plan, the logits
of the rows it ran and, for EAGLE3 target families, the auxiliary hidden states. The
``Stepper`` keeps no per-request state between steps (engines own block tables); it holds
only what does not change per step: the artifacts, the KV buffers, the DP group, a hook.

DP: every rank calls ``step`` once per engine step, an idle rank ``idle()`` (the empty step,
``StepBatch.EMPTY``): it enters the same collective, learns the synced bucket and runs that
artifact on padding rows only, so a busy rank's collectives inside the artifact (MoE over EP)
find their peer. One MAX all-reduce carries ``(num_reqs, needed_base, nospec, bad_input, more)``
over the DP group the engine hands in (its own, e.g. vLLM's, or the bundle's world); local
problems (a batch above every bucket, a context above ``max_model_len``, malformed input)
therefore reach every rank in the same collective and all ranks raise together: a DP job never
hangs. ``collectives`` counts this Stepper's all-reduces.

Drafts (EAGLE3): a row carries its next token and 0..k drafts. A with-spec step (some row has
drafts, and room: ``dispatch.needs_nospec``) runs every row at query 1+k; a row with fewer drafts
is padded and its padded positions write no KV (slot -1). The draft's KV buffer is the engine's
when it hands one in (``draft_kv_cache``), else allocated here.

Not here: block allocation (runtime/kv/blocks.py, optional), sampling and prefill (serve/).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from neffbuild.errors import StepInputError
from neffbuild.runtime.kv import cache as kv_cache
from neffbuild.runtime.kv.blocks import FULL_GROUP, SLIDING_GROUP
from neffbuild.runtime.kv.cache import KVLayout, allocate, allocate_draft
from neffbuild.runtime.step import attn_metadata, buckets, dp_sync, draft_inputs
from neffbuild.runtime.step import checks as step_checks
from neffbuild.runtime.step.dispatch import Grid, StepPlan, needs_nospec, plan_draft, plan_synced
from neffbuild.runtime.step.metrics import StepMetrics


class Artifacts(Protocol):
    """What a Stepper runs: a Bundle satisfies it; serve.eager wraps an eager graph the same way."""

    grid: Grid
    kv_layout: KVLayout
    num_swa: int

    def artifact(self, label: str) -> Callable[..., object]: ...


@dataclass(frozen=True)
class StepBatch:
    """The engine's view of one step; row r of every field is request r (output rows follow it)."""

    tokens: Sequence[Sequence[int]]  # per request: its next token, then its drafts (0..k of them)
    num_computed: Sequence[int]  # per request: tokens already in the KV cache (= position of tokens[r][0])
    block_tables: Mapping[str, torch.Tensor]  # KV group ("full", "sliding") -> [R, W] block ids, any W


StepBatch.EMPTY = StepBatch((), (), {})  # an idle DP rank's step: no rows, the synced artifact on padding


@dataclass(frozen=True)
class StepOutput:
    plan: StepPlan  # label, family, batch bucket, ctx bucket, needed_seq (DP-synced)
    logits: torch.Tensor  # [R, plan.query_len, vocab]; query_len 1 when the step ran without drafts
    aux_hidden: torch.Tensor | None  # [R, plan.query_len, A] for EAGLE3 target families, else None


class Stepper:
    """Runs one decode step per call for the rows an engine hands it; stateless about requests.

    ``kv_caches`` are the engine's KV buffers and ``draft_kv_cache`` its EAGLE3 draft buffer (each
    allocated here from the bundle's layout when not given; checked against it when given).
    ``group``: a torch.distributed process group of the DP ranks (gloo), or None; a host engine
    passes its own DP group (vLLM's), neffbuild's engine the bundle's world.
    ``on_plan``: called with each step's synced plan (``plan.needed_seq``: the histogram hook).
    ``registry``: the engine's prometheus_client registry for the step counters (default: the
    library's global one; nothing is registered without prometheus_client, see runtime/step/metrics.py).
    """

    def __init__(self, artifacts: Artifacts, *, kv_caches: Sequence[torch.Tensor] | None = None, group=None,
                 on_plan: Callable[[StepPlan], None] | None = None, device: str = "cpu", registry=None,
                 draft_kv_cache: torch.Tensor | None = None):
        step_checks.check_group(group)  # a string or another object would be taken for "no DP" silently
        self.artifacts, self.group, self.on_plan = artifacts, group, on_plan
        self.metrics = StepMetrics(registry)
        self.grid, self.kv_layout, self.num_swa = artifacts.grid, artifacts.kv_layout, artifacts.num_swa
        device = getattr(artifacts, "device", device)  # a Bundle's artifacts run on its device
        self.vocab_size, self.aux_hidden_size = step_checks.model_dims(artifacts)
        self.kv_caches = (kv_cache.check_kv_buffers(kv_caches, artifacts.kv_layout, device)
                          if kv_caches is not None else allocate(self.kv_layout, device))
        if draft_kv_cache is not None and not self.kv_layout.has_draft:
            raise StepInputError("draft_kv_cache: this bundle has no EAGLE3 draft (no draft KV group)")
        self.draft_cache = (kv_cache.check_kv_buffers([draft_kv_cache], self.kv_layout, device, draft=True)[0]
                            if draft_kv_cache is not None else allocate_draft(self.kv_layout, device))
        self.collectives = 0  # DP all-reduces this Stepper issued
        self.kv_guard = kv_cache.KVGuard(self.kv_caches)  # re-checked at every step (runtime/kv/cache.py)
        self.draft_guard = kv_cache.KVGuard([self.draft_cache] if self.draft_cache is not None else [])

    def plan(self, batch: StepBatch, *, more: bool = False) -> StepPlan:
        """The synced plan every DP rank runs; ShapeNotCovered / StepInputError on all ranks alike.

        ``more``: this rank has work after this step (waiting or unfinished requests); synced in
        the same collective, ``plan.more`` tells every rank whether to go on (all stop together).
        """
        k, R, lay, mml = self.grid.num_speculative_tokens, len(batch.tokens), self.kv_layout, self.grid.max_model_len
        if step_checks.step_ok(batch.tokens, batch.num_computed, batch.block_tables, k, self.vocab_size,
                               lay.block_size, lay.num_blocks, mml):
            problem = None
        else:
            problem = step_checks.step_problem(batch, k=k, vocab=self.vocab_size, layout=lay, max_model_len=mml)
        base = buckets.needed_seq([int(n) for n in batch.num_computed]) if R and not problem else 0
        nospec = R > 0 and not problem and needs_nospec(
            self.grid, base, any_drafts=any(len(t) > 1 for t in batch.tokens))
        (count, base, nospec, bad, more), synced = dp_sync.sync_step(R, base, self.group,
                                                                     spec_flags=(nospec, problem is not None, more))
        self.collectives += synced
        if bad:
            raise StepInputError(problem or "another DP rank was handed a malformed step (see its error)")
        plan = plan_synced(self.grid, batch_count=count, needed_base=base, nospec=bool(nospec), num_reqs=R)
        plan = replace(plan, any_work=count > 0, more=bool(more))
        if self.on_plan is not None:
            self.on_plan(plan)
        return plan

    def step(self, batch: StepBatch) -> StepOutput:
        """Plan, sync, build the trimmed inputs, run the artifact (KV written in place)."""
        return self.run(self.plan(batch), batch)

    def idle(self, *, more: bool = False) -> StepOutput:
        """An idle DP rank's step: the collective, then the synced artifact on padding rows (no KV written)."""
        return self.run(self.plan(StepBatch.EMPTY, more=more), StepBatch.EMPTY)

    def lockstep(self, lengths: Sequence[int]) -> list[int]:
        """The padded prompt lengths every DP rank prefills this step (``dp_sync.lockstep``), for a bundle whose
        eager prefill has collectives across DP groups (``parallel.ep_gathers``): prefill n runs at ``pad_to`` =
        entry n on every rank, an empty prompt where a rank has no n-th one."""
        pads, synced = dp_sync.lockstep(lengths, self.group)
        self.collectives += synced
        return pads

    def run(self, plan: StepPlan, batch: StepBatch) -> StepOutput:
        """Run a plan from ``self.plan(batch)`` (a loop may look at it first, e.g. ``plan.any_work``)."""
        R, q = len(batch.tokens), plan.query_len
        self.kv_guard.check()
        rows = [list(t)[:q] for t in batch.tokens]
        short = [len(r) for r in rows if len(r) < q]  # rows with fewer than k drafts in a with-spec step
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.long) if short else None
        tokens = torch.tensor([r + [0] * (q - len(r)) for r in rows] if short else rows,
                              dtype=torch.long).reshape(R, q)
        empty = torch.zeros((R, 1), dtype=torch.long)
        full = batch.block_tables.get(FULL_GROUP, empty)
        inputs = attn_metadata.build(
            tokens, torch.tensor([int(n) for n in batch.num_computed], dtype=torch.long), full,
            batch.block_tables.get(SLIDING_GROUP, full), batch=plan.batch, ctx=plan.ctx,
            block_size=self.kv_layout.block_size, num_swa=self.num_swa, lengths=lengths)
        out = self.artifacts.artifact(plan.label)(*inputs.as_args(self.kv_caches))
        self.metrics.record(f"decode_b{plan.batch}", plan.batch, plan.padding)
        logits, aux = (out[0], out[1]) if isinstance(out, (tuple, list)) and len(out) > 1 else (_first(out), None)
        return StepOutput(plan, logits[:R], aux[:R] if aux is not None else None)

    def draft(self, rows: Sequence[tuple], full_table: torch.Tensor, *, max_computed: int
              ) -> tuple[StepPlan, torch.Tensor]:
        """EAGLE3: one draft call -> (plan, proposed target ids [R, k]); draft KV written in place.

        rows: per request ``(tokens [n], aux [n, A], first position)``, the n (1..1+k) rows the
        target just verified; ``full_table`` [R, W]: their full-attention block ids (the draft's
        group uses them). Not DP-synced: the draft has no collectives.
        """
        if self.draft_cache is None:
            raise StepInputError("draft: this bundle has no EAGLE3 draft artifacts")
        problem, max_computed = step_checks.draft_problem(
            rows, full_table, k=self.grid.num_speculative_tokens, vocab=self.vocab_size,
            aux_width=self.aux_hidden_size, layout=self.kv_layout,
            max_model_len=self.grid.max_model_len, max_computed=max_computed)
        if problem:
            raise StepInputError(problem)
        self.draft_guard.check()
        plan = plan_draft(self.grid, num_reqs=len(rows), max_computed=max_computed)
        inputs = draft_inputs.build_draft(rows, full_table, batch=plan.batch, ctx=plan.ctx, query_len=plan.query_len,
                                         block_size=self.kv_layout.block_size, hidden_size=self.aux_hidden_size)
        out = self.artifacts.artifact(plan.label)(*inputs.as_args(self.draft_cache))
        return plan, _first(out)[: len(rows)]


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out
