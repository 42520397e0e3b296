"""Recipe -> the exact, ordered list of graphs to compile.

Count = |num_seqs_buckets| x (|decode_context_length_buckets| + 1), times 3 with EAGLE3.
Enumeration is batch-major, context ascending then the max_model_len fallback; build
order (largest first) is a separate function so the enumeration stays stable.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from neffbuild.runtime.step.buckets import ctx_buckets_with_fallback
from neffbuild.runtime.step.dispatch import DECODE, DRAFT, FAMILIES, TARGET_NOSPEC, TARGET_SPEC, families, label

__all__ = ["DECODE", "DRAFT", "FAMILIES", "TARGET_NOSPEC", "TARGET_SPEC", "Target", "families", "label", "targets"]


@dataclass(frozen=True, order=True)
class Target:
    family: str
    batch: int
    ctx: int
    query_len: int
    label: str

    def to_json(self) -> dict:
        return asdict(self)


def enumerate_targets(num_seqs_buckets, ctx_buckets, max_model_len: int,
                      num_speculative_tokens: int = 0) -> list[Target]:
    out = []
    for batch in num_seqs_buckets:
        for ctx in ctx_buckets_with_fallback(ctx_buckets, max_model_len):
            for fam, q in families(num_speculative_tokens):
                out.append(Target(fam, batch, ctx, q, label(fam, batch, ctx, q)))
    return out


def targets(recipe) -> list[Target]:
    """Every graph the recipe compiles, batch-major."""
    return enumerate_targets(
        recipe.num_seqs_buckets, recipe.decode_context_length_buckets, recipe.max_model_len,
        recipe.num_speculative_tokens,
    )


def build_order(tgts: list[Target]) -> list[Target]:
    """Largest first (batch x ctx x query_len), so the longest compiles start earliest."""
    return sorted(tgts, key=lambda t: (-(t.batch * t.ctx * t.query_len), t.label))


def count_formula(recipe) -> str:
    n_b = len(recipe.num_seqs_buckets)
    n_c = len(recipe.decode_context_length_buckets) + 1
    fam = len(families(recipe.num_speculative_tokens))
    total = n_b * n_c * fam
    tail = f" x {fam} families (EAGLE3)" if fam > 1 else ""
    return f"{n_b} num_seqs buckets x ({n_c - 1} context buckets + 1 fallback){tail} = {total}"
