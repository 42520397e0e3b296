"""Per-step plan: batch padding, needed_seq, context bucket, family, artifact label. Pure.

A shape the bundle does not cover raises ``ShapeNotCovered``; nothing here ever compiles.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from neffbuild.errors import ShapeNotCovered
from neffbuild.runtime.step import buckets

# The one definition of families and labels: the grid (neffbuild.grid) names the targets it
# compiles with them, the dispatcher the artifact it runs, and the manifest's compile label
# is the same string, so the three can never disagree.
DECODE, TARGET_SPEC, TARGET_NOSPEC, DRAFT = "decode", "target_spec", "target_nospec", "draft"
FAMILIES = (DECODE, TARGET_SPEC, TARGET_NOSPEC, DRAFT)


def families(num_speculative_tokens: int) -> list[tuple[str, int]]:
    """(family, query_len) pairs compiled for each (batch, ctx) cell."""
    if num_speculative_tokens <= 0:
        return [(DECODE, 1)]
    k = num_speculative_tokens
    return [(TARGET_SPEC, 1 + k), (TARGET_NOSPEC, 1), (DRAFT, 1 + k)]


@dataclass(frozen=True)
class Grid:
    """What a bundle compiled: the inputs that decide every step's artifact."""

    num_seqs_buckets: tuple[int, ...]
    ctx_buckets: tuple[int, ...]  # without the max_model_len fallback
    max_model_len: int
    num_speculative_tokens: int = 0




@dataclass(frozen=True)
class StepPlan:
    batch: int  # padded batch bucket
    num_reqs: int
    needed_seq: int
    ctx: int  # context bucket
    family: str
    query_len: int
    label: str
    any_work: bool = True  # False: after the DP sync no rank had a request (a loop may stop here)
    more: bool = False  # after the DP sync: some rank has work after this step (an engine goes on)

    @property
    def padding(self) -> int:
        return self.batch - self.num_reqs

    def to_json(self) -> dict:
        return {"label": self.label, "family": self.family, "batch": self.batch, "ctx": self.ctx,
                "needed_seq": self.needed_seq}


def label(family: str, batch: int, ctx: int, query_len: int) -> str:
    """decode_b{B}_ctx{S}, decode_b{B}_s{q}_ctx{S} (target families), draft_b{B}_ctx{S}."""
    if family == DECODE:
        return f"decode_b{batch}_ctx{ctx}"
    if family in (TARGET_SPEC, TARGET_NOSPEC):
        return f"decode_b{batch}_s{query_len}_ctx{ctx}"
    if family == DRAFT:
        return f"draft_b{batch}_ctx{ctx}"
    raise ValueError(f"unknown family {family!r}")


def needs_nospec(grid: Grid, needed_base: int, *, any_drafts: bool) -> bool:
    """With EAGLE3, whether this rank must run without speculation: no request has drafts (none proposed,
    or right after a DI transfer: no aux hidden states yet), or there is no room for them (the one "room
    for drafts" rule: ``max_position + k + 1 > max_model_len``). A with-spec step runs every row at query
    1+k: a row with d < k drafts (a host engine's scheduler may schedule fewer) is padded, its padded
    positions' KV writes masked (runtime/step/attn_metadata.py) and their logits ignored. Synced across
    DP ranks with MAX."""
    k = grid.num_speculative_tokens
    return k > 0 and (not any_drafts or needed_base + k > grid.max_model_len)


def family_for(grid: Grid, nospec: bool) -> tuple[str, int]:
    """(family, query_len) of a step: decode without EAGLE3, else target_spec (1+k) or target_nospec (1)."""
    k = grid.num_speculative_tokens
    if k == 0:
        return DECODE, 1
    return (TARGET_NOSPEC, 1) if nospec else (TARGET_SPEC, 1 + k)


def plan_draft(grid: Grid, *, num_reqs: int, max_computed: int) -> StepPlan:
    """The draft artifact for ``num_reqs`` requests whose largest num_computed (after acceptance)
    is ``max_computed``: query 1+k, the context bucket of the with-spec step that follows."""
    k = grid.num_speculative_tokens
    return plan_for(grid, batch_count=num_reqs, needed=buckets.needed_seq(max_computed, k), num_reqs=num_reqs,
                    family=DRAFT, query_len=1 + k)


def plan_for(grid: Grid, *, batch_count: int, needed: int, num_reqs: int, family: str = DECODE,
             query_len: int = 1) -> StepPlan:
    """The artifact for ``batch_count`` rows needing ``needed`` context; ShapeNotCovered if none.

    ``batch_count`` may exceed ``num_reqs``: after a DP sync it is the largest rank's padded batch.
    """
    if batch_count > grid.num_seqs_buckets[-1]:
        raise ShapeNotCovered(
            f"batch of {batch_count} requests is above the largest num_seqs bucket {grid.num_seqs_buckets[-1]} "
            f"(bundle buckets: {list(grid.num_seqs_buckets)})"
        )
    if needed > grid.max_model_len:
        raise ShapeNotCovered(
            f"needed context {needed} is above max_model_len {grid.max_model_len} "
            f"(bundle context buckets: {list(grid.ctx_buckets) + [grid.max_model_len]})"
        )
    batch = buckets.bucket_for(max(batch_count, 1), grid.num_seqs_buckets)
    ctx = buckets.ctx_bucket_for(needed, grid.ctx_buckets, grid.max_model_len)
    return StepPlan(batch, num_reqs, needed, ctx, family, query_len, label(family, batch, ctx, query_len))


def plan_synced(grid: Grid, *, batch_count: int, needed_base: int, nospec: bool, num_reqs: int) -> StepPlan:
    """The plan from (DP-synced) values: the family first, then needed_seq = needed_base + drafts run."""
    family, q = family_for(grid, nospec)
    return plan_for(grid, batch_count=batch_count, needed=needed_base + q - 1, num_reqs=num_reqs, family=family,
                    query_len=q)


def plan_step(
    num_computed_tokens: Sequence[int],
    num_reqs: int,
    num_draft_tokens: int = 0,
    *,
    grid: Grid,
    any_drafts: bool = True,
    after_transfer: bool = False,
) -> StepPlan:
    """The artifact for one decode step of ``num_reqs`` requests on one rank (no DP sync)."""
    base = buckets.needed_seq(num_computed_tokens)
    nospec = needs_nospec(grid, base, any_drafts=any_drafts and num_draft_tokens > 0 and not after_transfer)
    return plan_synced(grid, batch_count=num_reqs, needed_base=base, nospec=nospec, num_reqs=num_reqs)
