"""One rank's decode loop: request state, KV blocks, per-step dispatch, DP sync, metrics.

The decoder owns the KV cache and the engine-side block tables (one table per KV group:
full attention and sliding window). Each step it plans the artifact, syncs the plan
across DP ranks, builds the trimmed inputs and runs the artifact, which writes KV in place.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from neffbuild.runtime import attn_metadata, buckets, dp_sync
from neffbuild.runtime.dispatch import DECODE, TARGET_NOSPEC, GridSpec, StepPlan, plan_for
from neffbuild.runtime.kv_cache import NULL_BLOCK, BlockAllocator, KVLayout, allocate

Runner = Callable[[StepPlan], Callable[..., torch.Tensor]]


@dataclass
class Request:
    blocks: list[int] = field(default_factory=list)  # full-attention group
    blocks_swa: list[int] = field(default_factory=list)  # sliding-window group
    num_computed: int = 0


class Decoder:
    def __init__(self, *, layout: KVLayout, spec: GridSpec, num_swa: int, runner: Runner, group=None, device="cpu"):
        self.layout, self.spec, self.num_swa, self.runner, self.group = layout, spec, num_swa, runner, group
        self.kv_caches = allocate(layout, device)
        self.allocator = BlockAllocator(layout.num_blocks)
        self.max_blocks = buckets.table_width(spec.max_model_len, layout.block_size)
        self.requests: dict[int, Request] = {}
        self.executions: Counter[str] = Counter()  # neffbuild_neff_execution_count{bucket="decode_b4"}
        self.padding_rows = 0
        self.total_rows = 0
        self.steps: list[StepPlan] = []

    # -- requests
    def add_request(self, rid: int, num_tokens: int) -> Request:
        """Register a request and reserve blocks for its first ``num_tokens`` positions."""
        req = self.requests[rid] = Request()
        self.reserve(req, num_tokens)
        return req

    def reserve(self, req: Request, num_tokens: int) -> None:
        need = buckets.table_width(num_tokens, self.layout.block_size) - len(req.blocks)
        if need > 0:
            req.blocks += self.allocator.take(need)
            req.blocks_swa += self.allocator.take(need)

    def finish(self, rid: int) -> None:
        req = self.requests.pop(rid)
        self.allocator.give_back(req.blocks + req.blocks_swa)

    def table_rows(self, rid: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's engine block-table rows (padded with the null block)."""
        req = self.requests[rid]

        def row(blocks):
            return torch.tensor(blocks + [NULL_BLOCK] * (self.max_blocks - len(blocks)), dtype=torch.long)

        return row(req.blocks), row(req.blocks_swa)

    # -- one step
    def plan(self, rids: list[int]) -> StepPlan:
        """Local plan, then (with DP) the MAX-synced plan every rank agrees on."""
        padded = needed = 0  # an idle rank contributes nothing to the sync
        if rids:  # a local batch above every bucket fails here; a context too long fails on all ranks below
            padded = buckets.bucket_for(len(rids), self.spec.num_seqs_buckets)
            needed = buckets.needed_seq([self.requests[r].num_computed for r in rids])
        padded, needed = dp_sync.sync_step(padded, needed, self.group)
        family = TARGET_NOSPEC if self.spec.num_speculative_tokens else DECODE  # EAGLE3 bundles: plain = without-spec
        return plan_for(self.spec, batch_count=padded, needed=needed, num_reqs=len(rids), family=family)

    def step(self, tokens: dict[int, int]) -> tuple[StepPlan, torch.Tensor]:
        """Run one decode step for {request id: its next input token}; logits [R, vocab]."""
        rids = list(tokens)
        plan = self.plan(rids)
        for r in rids:
            self.reserve(self.requests[r], self.requests[r].num_computed + 1)
        rows = [self.table_rows(r) for r in rids]
        empty = torch.zeros((0, self.max_blocks), dtype=torch.long)
        inputs = attn_metadata.build(
            torch.tensor([[tokens[r]] for r in rids], dtype=torch.long).reshape(len(rids), 1),
            torch.tensor([self.requests[r].num_computed for r in rids], dtype=torch.long),
            torch.stack([a for a, _ in rows]) if rows else empty,
            torch.stack([b for _, b in rows]) if rows else empty,
            batch=plan.batch, ctx=plan.ctx, block_size=self.layout.block_size, num_swa=self.num_swa,
        )
        out = self.runner(plan)(*inputs.as_args(self.kv_caches))
        logits = out[0] if isinstance(out, (tuple, list)) else out
        for r in rids:
            self.requests[r].num_computed += 1
        self.executions[f"decode_b{plan.batch}"] += 1
        self.padding_rows += plan.padding
        self.total_rows += plan.batch
        self.steps.append(plan)
        return plan, logits[: len(rids), -1]

    # -- metrics
    def prometheus(self) -> str:
        lines = ["# TYPE neffbuild_neff_execution_count counter"]
        lines += [f'neffbuild_neff_execution_count{{bucket="{k}"}} {v}' for k, v in sorted(self.executions.items())]
        ratio = self.padding_rows / self.total_rows if self.total_rows else 0.0
        lines += ["# TYPE neffbuild_batch_padding_ratio gauge", f"neffbuild_batch_padding_ratio {ratio:.6f}"]
        return "\n".join(lines) + "\n"
