"""``generate --check``'s judge: the bundle's tokens against the unsharded eager reference, by a stated rule.

The rule, per request:

1. identical tokens pass;
2. otherwise the first token where they differ (position N+1, after N agreeing tokens) passes as a **near-tie**
   only when the reference itself ranks the bundle's token at most ``tolerance`` below its own choice there:
   ``margin = logit_ref[ref token] - logit_ref[bundle token] <= tolerance`` (so the reference's top-2 margin is at
   most that too). The comparison stops there: after a near-tie the two runs continue from different tokens, so
   nothing later is evidence either way. Any wider margin is a real difference, and ``--check`` fails.

``tolerance = REL[dtype] * max(1, |top logit|)``, relative to the logits' own scale because rounding is:

* float32 (``1e-4``): the compiled graph and the eager model sum in other orders; float32's relative precision is
  ~6e-8 per rounding, and 1e-4 covers thousands of such differences yet stays far below any real defect.
* reduced precision (bfloat16 weights or KV, MXFP4 experts; ``2**-4``): bfloat16 keeps 8 significant bits (one
  rounding moves a value by up to ``2**-9`` relative). Eager rounds the residual stream to bfloat16 after every
  op while inductor keeps fused intermediates in float32, so the two differ by many roundings compounded over the
  layers: measured up to 0.35 on logits of magnitude ~7 (0.05 relative) on this project's tiny models while the
  tokens agree. ``2**-4`` (0.0625 relative: 0.44 at magnitude 7) covers that; a wrong weight, expert or KV row
  moves logits by several units (5-7 measured), far outside it.

``Recording*`` run the reference and record, at every position the reference generates, its top logit, its
top-2 margin and the margin to the bundle's token (the bundle's run goes first, so its tokens are known).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from neffbuild.serve.engine import Engine
from neffbuild.serve.parts import LocalPrefill, Request

REL = {"float32": 1e-4, "reduced": 2.0**-4}


@dataclass(frozen=True)
class Position:
    """The reference at one generated position: its top logit, its top-2 margin, and how far below its top it
    ranks the bundle's token there (0.0 where they agree; None: the bundle has no token there)."""

    top: float
    top2: float
    to_bundle: float | None


def tolerance(dtype: str, top: float) -> float:
    return REL[dtype] * max(1.0, abs(top))


def precision(weights: dict, kv_dtype: str) -> str:
    """"float32" when every floating weight and the KV are float32, else "reduced" (the rule's dtype)."""
    floats = {t.dtype for t in weights.values() if t.is_floating_point()}
    return "float32" if floats <= {torch.float32} and kv_dtype == "float32" else "reduced"


def judge(rid: str, tokens: Sequence[int], reference: Sequence[int], positions: Sequence[Position],
          dtype: str) -> dict:
    """One request's verdict: {"id", "ok", "agreed"} plus, after a difference, "margin", "tolerance",
    "top2_margin" and "near_tie"."""
    if list(tokens) == list(reference):
        return {"id": rid, "ok": True, "agreed": len(reference)}
    n = next((i for i, (a, b) in enumerate(zip(tokens, reference, strict=False)) if a != b),
             min(len(tokens), len(reference)))
    pos = positions[n] if n < len(positions) else None
    if pos is None or pos.to_bundle is None:  # a length difference: no token to weigh
        return {"id": rid, "ok": False, "agreed": n, "margin": None, "tolerance": None, "near_tie": False}
    tol = tolerance(dtype, pos.top)
    near = pos.to_bundle <= tol
    return {"id": rid, "ok": near, "agreed": n, "margin": round(pos.to_bundle, 6), "top2_margin": round(pos.top2, 6),
            "tolerance": round(tol, 6), "near_tie": near}


def describe(v: dict) -> str:
    """One line per request that differed (the verdict ``judge`` gave)."""
    n = v["agreed"]
    if v["margin"] is None:
        return f"request {v['id']}: agreed for {n} tokens, then the lengths differ"
    if v["near_tie"]:
        return (f"request {v['id']}: agreed for {n} tokens, near-tie at token {n + 1} "
                f"(margin {v['margin']:.4g} <= tolerance {v['tolerance']:.4g}; compared no further)")
    return (f"request {v['id']}: agreed for {n} tokens, differs at token {n + 1} (margin {v['margin']:.4g} > "
            f"tolerance {v['tolerance']:.4g}: a real difference)")


class Recorder:
    """Per request (by file index), the reference's ``Position`` at each generated token."""

    def __init__(self, bundle_tokens: Sequence[Sequence[int]]):
        self.bundle_tokens = bundle_tokens
        self.positions: dict[int, list[Position]] = {}

    def record(self, r: Request, k: int, logits: torch.Tensor) -> None:
        """The reference's logits ``[vocab]`` choosing request ``r``'s ``k``-th generated token."""
        row = logits.float()
        top2 = row.topk(min(2, row.numel())).values.tolist()
        theirs = self.bundle_tokens[r.index]
        gap = float(top2[0] - row[theirs[k]]) if k < len(theirs) else None
        self.positions.setdefault(r.index, []).append(Position(top2[0], top2[0] - top2[-1], gap))


class RecordingPrefill(LocalPrefill):
    """The reference's prefill, its first token's logits recorded (one request per prefill call, in order)."""

    def __init__(self, recorder: Recorder, prefill, kv_caches):
        super().__init__(prefill, kv_caches)
        self.recorder = recorder

    def admit(self, reqs: list[Request], blocks, hold: Sequence[int] = ()) -> None:
        inner, rows = self.prefill, []

        def capture(*args, **kw):
            out = inner(*args, **kw)
            rows.append(out[-1])
            return out

        self.prefill = capture
        try:
            super().admit(reqs, blocks, hold)
        finally:
            self.prefill = inner
        for r, row in zip(reqs, rows, strict=True):
            self.recorder.record(r, 0, row)


class RecordingEngine(Engine):
    """The engine with each decode step's logits recorded per request before the update."""

    def __init__(self, recorder: Recorder, *args, **kw):
        super().__init__(*args, **kw)
        self.recorder = recorder

    def _update(self, decision, out, plan) -> int:
        for i, r in enumerate(decision.rows):
            self.recorder.record(r, len(r.tokens), out.logits[i, 0])
        return super()._update(decision, out, plan)
