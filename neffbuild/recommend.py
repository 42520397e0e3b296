"""Choose context buckets from a needed_seq histogram: at most K, minimising KV tokens read.

A decode step that needs ``s`` tokens of context runs the smallest compiled bucket ``>= s``
(or the ``max_model_len`` fallback) and reads that many tokens of KV per sequence, so
the cost of a bucket set B is ``sum(count(s) * bucket_B(s)) / total``. The optimum is
found exactly by dynamic programming over candidate boundaries: every observed ``s``
rounded up to the bucket granularity (an optimal bucket can always shrink to the largest
such value it serves). Integer arithmetic throughout, so ties and equality are exact.

Left out: the per-bucket compile cost beyond counting NEFFs, and the sliding-window layers'
reads (constant per step, whatever the bucket).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from neffbuild.runtime.step.buckets import P_MAX, round_up
from neffbuild.runtime.step.dispatch import families


@dataclass(frozen=True)
class Choice:
    buckets: tuple[int, ...]  # chosen context buckets, ascending, each < max_model_len
    cost: int  # sum of count x tokens read over all steps

    def per_step(self, total: int) -> float:
        return float(Fraction(self.cost, total))


def candidates(rows: list[tuple[int, int]], max_model_len: int, *, tile: int = P_MAX, min_bucket: int = 0) -> list[int]:
    """Distinct bucket values worth considering: each observed value rounded up, below max_model_len."""
    out = {round_up(max(s, min_bucket), tile) for s, n in rows if n}
    return sorted(c for c in out if c < max_model_len)


def cost(rows: list[tuple[int, int]], buckets, max_model_len: int) -> int:
    """Total tokens read: each row pays the smallest bucket (or the fallback) that is >= its needed_seq."""
    chosen = sorted(b for b in buckets if b < max_model_len) + [max_model_len]
    return sum(n * next(b for b in chosen if b >= s) for s, n in rows)


def optimise(rows: list[tuple[int, int]], max_model_len: int, max_buckets: int, *, tile: int = P_MAX,
             min_bucket: int = 0) -> list[Choice]:
    """The optimal choice with at most k buckets, for k = 0..max_buckets (index k).

    Among equal costs the smaller set wins (fewer NEFFs), so the list's costs are
    non-increasing and a k-entry repeats the (k-1)-entry once extra buckets stop paying.
    """
    cands = candidates(rows, max_model_len, tile=tile, min_bucket=min_bucket)
    m = len(cands)
    weight = [0] * m  # steps served by candidate j when it is the smallest chosen bucket above them
    over = 0  # steps only the fallback can serve
    index = {c: j for j, c in enumerate(cands)}
    for s, n in rows:
        r = round_up(max(s, min_bucket), tile)
        if n and r < max_model_len:
            weight[index[r]] += n
        else:
            over += n
    prefix = [0]
    for w in weight:
        prefix.append(prefix[-1] + w)
    total_w = prefix[-1]

    # best[j]: least cost of the steps up to candidate j with exactly k buckets, the last at j.
    inf = None
    best: list[int | None] = [inf] * m
    back: list[list[int]] = []  # back[k-1][j]: the previous bucket's index (-1: none) for best[j] at k
    answers = [Choice((), (total_w + over) * max_model_len)]
    for k in range(1, max_buckets + 1):
        if k > m:  # more buckets than candidates cannot help
            answers.append(answers[-1])
            continue
        nxt, arg = [inf] * m, [-1] * m
        for j in range(m):
            if k == 1:
                nxt[j] = cands[j] * prefix[j + 1]
                continue
            for i in range(j):
                if best[i] is not None:
                    c = best[i] + cands[j] * (prefix[j + 1] - prefix[i + 1])
                    if nxt[j] is None or c < nxt[j]:
                        nxt[j], arg[j] = c, i
        best = nxt
        back.append(arg)
        answers.append(_best_ending(best, back, cands, prefix, total_w, over, max_model_len, answers[-1]))
    return answers


def _best_ending(best, back, cands, prefix, total_w, over, max_model_len, previous: Choice) -> Choice:
    """The best exactly-k set (steps above its last bucket pay the fallback), unless k-1 was as good."""
    top, top_j = None, -1
    for j, b in enumerate(best):
        if b is not None:
            c = b + (total_w - prefix[j + 1] + over) * max_model_len
            if top is None or c < top:
                top, top_j = c, j
    if top is None or top >= previous.cost:
        return previous
    chosen, j, k = [], top_j, len(back)
    while j >= 0:
        chosen.append(cands[j])
        j = back[k - 1][j]
        k -= 1
    return Choice(tuple(reversed(chosen)), top)


@dataclass(frozen=True)
class Constraints:
    """What a bucket list must satisfy to validate: granularity, the smallest allowed bucket."""

    max_model_len: int
    tile: int = P_MAX  # lcm(128, block_size) with a recipe
    min_bucket: int = 0  # the sliding-window table width with a recipe
    num_seqs_buckets: int = 1  # |num_seqs_buckets|, for the NEFF count
    families: int = 1


def constraints_for(recipe) -> Constraints:
    """The bucket rules the recipe's validator applies, so the recommendation validates."""
    tile = math.lcm(P_MAX, recipe.block_size)
    return Constraints(recipe.max_model_len, tile, recipe.num_swa * recipe.block_size,
                       len(recipe.num_seqs_buckets), len(families(recipe.num_speculative_tokens)))


def report(rows: list[tuple[int, int]], con: Constraints, max_buckets: int,
           current: tuple[int, ...] | None = None) -> dict:
    """Everything ``neffbuild recommend`` prints: the choice, the comparisons, the table for k = 1..K."""
    total = sum(n for _, n in rows)
    n_mml = con.max_model_len
    answers = optimise(rows, n_mml, max_buckets, tile=con.tile, min_bucket=con.min_bucket)
    best = answers[-1]

    def neffs(k: int) -> int:
        return con.num_seqs_buckets * (k + 1) * con.families

    def per_step(c: int) -> float:
        return round(float(Fraction(c, total)), 3)

    out = {
        "buckets": list(best.buckets), "expected_tokens_per_step": per_step(best.cost),
        "fallback_only_tokens_per_step": float(n_mml), "max_model_len": n_mml, "steps": total,
        "neffs": neffs(len(best.buckets)),
        "fallback_vs_chosen": round(float(Fraction(n_mml * total, best.cost)), 3),
        "table": [{"k": k, "buckets": list(a.buckets), "expected_tokens_per_step": per_step(a.cost),
                   "neffs": neffs(len(a.buckets))} for k, a in enumerate(answers) if k],
    }
    if current is not None:
        cur = cost(rows, current, n_mml)
        out.update(recipe_buckets=list(current), recipe_tokens_per_step=per_step(cur), recipe_neffs=neffs(len(current)),
                   recipe_vs_chosen=round(float(Fraction(cur, best.cost)), 3),
                   neuron_config={"decode_context_length_buckets": list(best.buckets)})
    return out
