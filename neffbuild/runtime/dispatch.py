"""Per-step plan: batch padding, needed_seq, context bucket, family, artifact label. Pure.

A shape the bundle does not cover raises ``ShapeNotCovered``; nothing here ever compiles.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from neffbuild.errors import ShapeNotCovered
from neffbuild.runtime import buckets

# The one definition of families and labels: the grid (neffbuild.grid) names the targets it
# compiles with them, the dispatcher the artifact it runs, and the manifest's compile label
# is the same string, so the three can never disagree.
DECODE, TARGET_SPEC, TARGET_NOSPEC, DRAFT = "decode", "target_spec", "target_nospec", "draft"
FAMILIES = (DECODE, TARGET_SPEC, TARGET_NOSPEC, DRAFT)


@dataclass(frozen=True)
class GridSpec:
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


def choose_family(spec: GridSpec, needed_with_drafts: int, *, all_have_drafts: bool, after_transfer: bool) -> str:
    """With EAGLE3: with-spec normally; without-spec near max_model_len, right after a DI
    transfer (no aux hidden states yet), or when any request has no drafts."""
    if spec.num_speculative_tokens == 0:
        return DECODE
    if needed_with_drafts > spec.max_model_len or after_transfer or not all_have_drafts:
        return TARGET_NOSPEC
    return TARGET_SPEC


def must_run_without_spec(spec: GridSpec, num_computed_tokens: Sequence[int], *, all_have_drafts: bool,
                          after_transfer: bool = False) -> bool:
    """This rank's with-spec veto: some request lacks k drafts, came from a DI transfer, or has
    no room (``max_position + k + 1 > max_model_len``). An idle rank vetoes nothing."""
    if not num_computed_tokens:
        return False
    needed = buckets.needed_seq(num_computed_tokens, spec.num_speculative_tokens)
    return choose_family(spec, needed, all_have_drafts=all_have_drafts, after_transfer=after_transfer) != TARGET_SPEC


def plan_spec_step(spec: GridSpec, *, batch_count: int, needed: int, without_spec: bool, num_reqs: int) -> StepPlan:
    """The target artifact once the ranks agreed: ``needed`` = max(num_computed) + 1 over all
    ranks, ``without_spec`` = any rank's veto (both MAX-reduced in the step's one collective).
    With spec the query is 1+k and needed_seq includes the drafts."""
    k = spec.num_speculative_tokens
    with_spec = k > 0 and not without_spec and needed + k <= spec.max_model_len
    family = TARGET_SPEC if with_spec else (TARGET_NOSPEC if k else DECODE)
    q = 1 + k if with_spec else 1
    return plan_for(spec, batch_count=batch_count, needed=needed + q - 1, num_reqs=num_reqs, family=family,
                    query_len=q)


def plan_draft(spec: GridSpec, *, num_reqs: int, max_computed: int) -> StepPlan:
    """The draft artifact for ``num_reqs`` requests whose largest num_computed (after acceptance)
    is ``max_computed``: query 1+k, the context bucket of the with-spec step that follows."""
    k = spec.num_speculative_tokens
    return plan_for(spec, batch_count=num_reqs, needed=buckets.needed_seq(max_computed, k), num_reqs=num_reqs,
                    family=DRAFT, query_len=1 + k)


def plan_for(spec: GridSpec, *, batch_count: int, needed: int, num_reqs: int, family: str = DECODE,
             query_len: int = 1) -> StepPlan:
    """The artifact for ``batch_count`` rows needing ``needed`` context; ShapeNotCovered if none.

    ``batch_count`` may exceed ``num_reqs``: after a DP sync it is the largest rank's padded batch.
    """
    if batch_count > spec.num_seqs_buckets[-1]:
        raise ShapeNotCovered(
            f"batch of {batch_count} requests is above the largest num_seqs bucket {spec.num_seqs_buckets[-1]} "
            f"(bundle buckets: {list(spec.num_seqs_buckets)})"
        )
    if needed > spec.max_model_len:
        raise ShapeNotCovered(
            f"needed context {needed} is above max_model_len {spec.max_model_len} "
            f"(bundle context buckets: {list(spec.ctx_buckets) + [spec.max_model_len]})"
        )
    batch = buckets.bucket_for(max(batch_count, 1), spec.num_seqs_buckets)
    ctx = buckets.ctx_bucket_for(needed, spec.ctx_buckets, spec.max_model_len)
    return StepPlan(batch, num_reqs, needed, ctx, family, query_len, label(family, batch, ctx, query_len))


def plan_step(
    num_computed_tokens: Sequence[int],
    num_reqs: int,
    num_draft_tokens: int = 0,
    *,
    spec: GridSpec,
    all_have_drafts: bool = True,
    after_transfer: bool = False,
) -> StepPlan:
    """The artifact for one decode step of ``num_reqs`` requests."""
    k = spec.num_speculative_tokens
    family = choose_family(spec, buckets.needed_seq(num_computed_tokens, k),
                           all_have_drafts=all_have_drafts and num_draft_tokens > 0, after_transfer=after_transfer)
    q = 1 + k if family == TARGET_SPEC else 1
    needed = buckets.needed_seq(num_computed_tokens, q - 1)  # drafts ride along only in the with-spec family
    return plan_for(spec, batch_count=num_reqs, needed=needed, num_reqs=num_reqs, family=family, query_len=q)
