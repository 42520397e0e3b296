"""``generate``'s entry point and its one result type.

``generate(bundle, requests, opts)`` starts what the options ask for (the prefill worker
for DI; the world's ranks), runs the engine on every rank and merges the ranks' answers
into a ``GenerateResult``. ``reference_tokens`` is the ``--check`` oracle: the unsharded
eager model on the bundle's weights (a sharded bundle's pieces joined), in this process.

Speed: ``decode_seconds`` is the wall time of the decode steps (the slowest rank's), with
no loading, prefill or transfer in it; ``tokens_per_second`` counts the tokens emitted by
every step **after the first** over those steps' time (the first step pays one-time costs
such as first-call allocation; it is reported apart as ``first_step_seconds``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from neffbuild.errors import NeffbuildError
from neffbuild.runtime.bundle.facts import BundleFacts
from neffbuild.runtime.di.ingest import load_nixl
from neffbuild.serve.engine import Engine
from neffbuild.serve.parts import LocalPrefill, Request
from neffbuild.serve.prefill_worker import PrefillGroup, check_group_tp
from neffbuild.serve.rank import EAGER, open_rank
from neffbuild.serve.requests import check_requests
from neffbuild.serve.run import Options
from neffbuild.serve.world import run_ranks, world_for


@dataclass
class GenerateResult:
    requests: list[dict]  # file order: id, tokens, arrival, first_step, last_step
    steps: list[dict]  # rank 0's decode steps: label, family, batch, ctx, needed_seq, num_reqs, step
    decode_seconds: float
    decode_tokens: int
    first_step_seconds: float
    tokens_per_second: float
    engine_fraction: float  # the engine's own work / decode time (admission, scheduling, tables, acceptance)
    ranks: list[dict] = field(default_factory=list)  # per rank (more than one): steps, collectives, seconds
    transfers: list[dict] = field(default_factory=list)  # DI: per request, file order
    histogram: list = field(default_factory=list)  # (needed_seq, count) rows
    acceptance_rate: float | None = None
    metrics: str | None = None  # Prometheus text, when asked
    check: dict | None = None

    @property
    def tokens(self) -> list[list[int]]:
        return [r["tokens"] for r in self.requests]
    def to_json(self) -> dict:
        out = {"tokens": self.tokens, "requests": self.requests, "steps": self.steps,
               "decode_seconds": round(self.decode_seconds, 6), "decode_tokens": self.decode_tokens,
               "first_step_seconds": round(self.first_step_seconds, 6),
               "tokens_per_second": round(self.tokens_per_second, 3), "engine_fraction": round(self.engine_fraction, 6)}
        for key in ("ranks", "transfers", "acceptance_rate", "metrics", "check"):
            value = getattr(self, key)
            if value not in (None, []):
                out[key] = value
        return out


def merge(ranks: list[dict], n_requests: int, world: int, dp: int) -> GenerateResult:
    """One result from the ranks' answers; the TP ranks of a DP group must agree on every token."""
    per_group = world // dp
    reqs: list[dict | None] = [None] * n_requests
    for r in ranks:
        for q in r["requests"]:
            g = q["index"]  # its place in the request list (DP group g % dp served it)
            q = {k: v for k, v in q.items() if k != "index"}
            if reqs[g] not in (None, q):
                raise NeffbuildError(f"rank {r['rank']}: request {q['id']!r} differs from another TP rank of DP "
                                     f"group {r['dp_rank']}")
            reqs[g] = q
    leaders = [r for r in ranks if r["rank"] % per_group == 0]
    secs = max(sum(r["step_seconds"]) for r in ranks)
    first = max((r["step_seconds"][0] for r in ranks if r["step_seconds"]), default=0.0)
    tokens = sum(sum(r["step_tokens"]) for r in leaders)
    later = sum(sum(r["step_tokens"][1:]) for r in leaders)
    later_s = max(sum(r["step_seconds"][1:]) for r in ranks)
    engine = max(r["engine_seconds"] for r in ranks)
    rate = later / later_s if later_s > 0 else (tokens / secs if secs > 0 else 0.0)  # one step: that step
    res = GenerateResult(reqs, ranks[0]["steps"], secs, tokens, first, rate,
                         engine / secs if secs > 0 else 0.0, histogram=ranks[0]["histogram"],
                         metrics=ranks[0].get("metrics"))
    by_id = {t["id"]: t for r in leaders for t in r["transfers"]}
    res.transfers = [by_id[q["id"]] for q in reqs if q["id"] in by_id]
    if "proposed" in ranks[0]:
        proposed = sum(r["proposed"] for r in leaders)
        res.acceptance_rate = round(sum(r["accepted"] for r in leaders) / proposed, 6) if proposed else 0.0
    if world > 1:
        res.ranks = [{k: r[k] for k in ("rank", "dp_rank", "steps", "collectives", "draft_calls", "acceptance_rate")
                      if k in r} | {"decode_seconds": round(sum(r["step_seconds"]), 6)} for r in ranks]
    return res


def _check_early(facts: BundleFacts | None, requests: list[Request], what: str) -> None:
    """The requests are the user's: refuse them before any rank or worker starts (a valid manifest only)."""
    if facts is not None:
        check_requests(requests, facts.vocab_size, facts.graph_inputs.grid.max_model_len, what)


def generate(bundle_path: str, requests: list[Request], opts: Options, facts: BundleFacts | None) -> GenerateResult:
    """Serve ``requests`` on the bundle with the parts ``opts`` names; one merged result. ``facts``: the bundle's
    (``read_facts(bundle_path, strict=False)``, read once by the caller; None: broken, and the open says why)."""
    if opts.di:
        if opts.prefill_tp is not None:
            check_group_tp(bundle_path, opts.prefill_tp)  # the user's flag: exit 2 naming it, before anything starts
        load_nixl()  # no NIXL: exit 1 naming the extra, before anything is loaded
    world, dp = world_for(facts, opts.dp)
    if world > 1 or opts.di:  # one process checks them after open_rank (a broken bundle is exit 1 first)
        _check_early(facts, requests, opts.requests_flag)
    if not opts.di:
        return merge(run_ranks(bundle_path, requests, opts, world=(world, dp)), len(requests), world, dp)
    with PrefillGroup(bundle_path, opts.prefill_tp) as group:
        return merge(run_ranks(bundle_path, requests, opts, group, (world, dp)), len(requests), world, dp)


def check_against_reference(bundle_path: str, requests: list[Request], tokens: list[list[int]]) -> dict:
    """``--check``: the reference's tokens and, per request that differs, the verdict of serve/check.py's rule
    (a near-tie within the dtype's tolerance passes; a wider margin fails). JSON-able."""
    from neffbuild.serve import check

    ref = open_rank(bundle_path, decode=EAGER)
    recorder = check.Recorder(tokens)
    fresh = [Request(r.id, list(r.prompt), r.max_new_tokens, index=r.index) for r in requests]
    source = check.RecordingPrefill(recorder, ref.prefill, ref.kv_caches)
    check.RecordingEngine(recorder, ref.stepper, ref.block_manager(), source).run(fresh)
    dtype = check.precision(ref.weights, ref.kv_layout.dtype_name)
    reference = [r.result()["tokens"] for r in fresh]
    verdicts = [check.judge(r.id, t, want, recorder.positions.get(r.index, []), dtype)
                for r, t, want in zip(fresh, tokens, reference, strict=True)]
    return {"ok": all(v["ok"] for v in verdicts), "reference": reference, "precision": dtype,
            "relative_tolerance": check.REL[dtype], "differences": [v for v in verdicts if "margin" in v]}


def reference_tokens(bundle_path: str, requests: list[Request]) -> list[list[int]]:
    """Greedy tokens of the UNSHARDED eager model on the bundle's weights, per request (file order)."""
    ref = open_rank(bundle_path, decode=EAGER)
    fresh = [Request(r.id, list(r.prompt), r.max_new_tokens, index=r.index) for r in requests]
    Engine(ref.stepper, ref.block_manager(), LocalPrefill(ref.prefill, ref.kv_caches)).run(fresh)
    return [r.tokens for r in fresh]
