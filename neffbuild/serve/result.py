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
from pathlib import Path

from neffbuild.errors import NeffbuildError
from neffbuild.serve.parts import Request
from neffbuild.serve.run import Options


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


def _check_early(bundle_path: str, requests: list[Request], what: str) -> None:
    """The requests are the user's: refuse them before any rank or worker starts (a valid manifest only)."""
    from neffbuild.runtime.bundle import read_manifest
    from neffbuild.runtime.manifest_schema import problems
    from neffbuild.serve.requests import check_requests
    from neffbuild.serve.run import model_config

    m = read_manifest(Path(bundle_path))
    if not problems(m):
        gi = m["graph_inputs"]
        check_requests(requests, model_config(gi).vocab_size, gi["max_model_len"], what)


def generate(bundle_path: str, requests: list[Request], opts: Options) -> GenerateResult:
    """Serve ``requests`` on the bundle with the parts ``opts`` names; one merged result."""
    from neffbuild.serve.world import run_ranks, world_for

    if opts.di:
        from neffbuild.runtime.kv_ingest import load_nixl

        load_nixl()  # no NIXL: exit 1 naming the extra, before anything is loaded
    world, dp = world_for(bundle_path, opts.dp)
    if world > 1 or opts.di:  # one process checks them after check_bundle (a broken bundle is exit 1 first)
        _check_early(bundle_path, requests, opts.source)
    if not opts.di:
        return merge(run_ranks(bundle_path, requests, opts), len(requests), world, dp)
    from neffbuild.serve.prefill_worker import PrefillGroup

    with PrefillGroup(bundle_path, opts.prefill_tp) as group:
        return merge(run_ranks(bundle_path, requests, opts, group), len(requests), world, dp)


def reference_tokens(bundle_path: str, requests: list[Request]) -> list[list[int]]:
    """Greedy tokens of the UNSHARDED eager model on the bundle's weights, per request (file order)."""
    from neffbuild import registry
    from neffbuild.runtime import bundle as reader
    from neffbuild.runtime import weights_file
    from neffbuild.runtime.dispatch import GridSpec
    from neffbuild.runtime.kv_cache import KVLayout
    from neffbuild.runtime.parallel import ParallelLayout
    from neffbuild.serve.engine import Engine
    from neffbuild.serve.parts import LocalPrefill
    from neffbuild.serve.run import model_config
    from neffbuild.serve.session import eager_artifacts, make_session

    root = Path(bundle_path)
    m = reader.read_manifest(root)
    gi = m["graph_inputs"]
    cfg = model_config(gi)
    weights = weights_file.load(reader.safe_path(root, m["weights"]["file"]), m["weights"]["tensors"])
    if "parallel" in m:
        parts = {name: weights_file.load(reader.safe_path(root, e["file"]), e["tensors"])
                 for name, e in m["parallel"]["pieces"].items()}
        weights = registry.arch(gi["arch"]).get("unshard")(cfg, dict(parts, shared=weights),
                                                            ParallelLayout.from_json(m["parallel"]))
    kv = gi["kv_layout"]
    _, nb, _, bs, d = kv["buffer_shape"]
    layout = KVLayout(kv["num_buffers"], nb, cfg.num_key_value_heads, bs, d, fp8=kv["dtype"].startswith("float8"),
                      packed_k=kv["packed_k"], kv_dtype=KVLayout.from_json(kv).kv_dtype)  # every KV head: unsharded
    spec = GridSpec(tuple(gi["num_seqs_buckets"]), tuple(gi["decode_context_length_buckets"]), gi["max_model_len"],
                    gi["num_speculative_tokens"])
    session = make_session(cfg, weights, eager_artifacts(cfg, weights, spec, layout, gi["num_swa"]))
    fresh = [Request(r.id, list(r.prompt), r.max_new_tokens, index=r.index) for r in requests]
    Engine(session.stepper, session.block_manager(), LocalPrefill(session.prefill, session.stepper.kv_caches)
           ).run(fresh)
    return [r.tokens for r in fresh]
