"""Host memory of compiles (peak RSS per target, the local pool's admission) and ``plan``'s memory section.

Torch-free: a target's estimate comes from its ``TargetGraph`` and the cache's records, never
from tracing. The peak RSS of one compile, in the order of what is known:

1. ``key``: a past compile of the same cache key recorded ``peak_rss_bytes``: that x 1.25;
2. ``graph``: a past compile of the same label and graph shape (``graph_summary``): that x 1.25;
3. ``size``: ``BASE_MEMORY + GRAPH_FACTOR x graph_bytes`` (one rank's weights at 2 bytes, its KV pool by
   ``runtime/kv/layout.py``, fp32 attention scores of every layer).

The Ray executor reserves this per task; the local pool starts a compile only while the
estimates of the compiles running plus this one fit the host's free memory
(``settings.free_memory_bytes``), always at least one (a build never stalls), and never kills one.
"""

from __future__ import annotations

import math

from neffbuild import registry
from neffbuild.compiler.graph_spec import TargetGraph, graph_summary, target_graph
from neffbuild.memory import fmt_bytes

GIB = 1 << 30
BASE_MEMORY = 2 * GIB  # one compile worker: torch + compiler imported, tracing and codegen of a small graph
GRAPH_FACTOR = 3  # trace + export + compile each hold a copy of the graph's tensors at some point
HISTORY_MARGIN = 1.25


def graph_bytes(graph: TargetGraph) -> int:
    """Bytes the traced graph holds: one rank's weights (bf16), its KV pool, fp32 attention scores of every layer."""
    cfg = graph.config
    shapes = registry.arch(graph.arch).get("rank_shapes")(cfg, graph.parallel)
    weights = sum(2 * math.prod(s) for s in shapes.values())
    scores = 4 * graph.batch * graph.query_len * graph.ctx * cfg.num_attention_heads * cfg.num_hidden_layers
    return weights + graph.kv_layout().total_bytes + scores


def _rss(meta: dict) -> bool:
    value = meta.get("peak_rss_bytes")
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def estimate_rss(graph: TargetGraph, label: str, history: list[dict], key: str | None = None) -> tuple[int, str]:
    """(peak RSS to expect from compiling ``graph``, where the number came from: key, graph or size)."""
    if key:
        past = [m["peak_rss_bytes"] for m in history if m.get("key") == key and _rss(m)]
        if past:
            return int(max(past) * HISTORY_MARGIN), "key"
    summary = graph_summary(graph)
    past = [m["peak_rss_bytes"] for m in history
            if _rss(m) and m.get("graph") == summary and m.get("label") == label]
    if past:
        return int(max(past) * HISTORY_MARGIN), "graph"
    return BASE_MEMORY + GRAPH_FACTOR * graph_bytes(graph), "size"


class Admission:
    """The local pool's memory gate: which compile may start now, and what it held back."""

    def __init__(self, estimates: dict[str, int], free: int | None, source: str, jobs: int):
        self.estimates, self.free, self.source, self.jobs = estimates, free, source, jobs
        self.running: dict[str, int] = {}
        self.max_running = 0
        self.held = 0  # times a compile waited although a worker was free

    def workers(self) -> int:
        """Workers worth starting: no more than the smallest compiles that fit at once (at least one)."""
        if self.free is None:
            return self.jobs
        fit, used = 0, 0
        for est in sorted(self.estimates.values()):
            if used + est > self.free:
                break
            fit, used = fit + 1, used + est
        return max(1, min(self.jobs, fit))

    def may_start(self, label: str) -> bool:
        if self.free is None or not self.running:
            return True
        if sum(self.running.values()) + self.estimates[label] <= self.free:
            return True
        self.held += 1
        return False

    def started(self, label: str) -> None:
        self.running[label] = self.estimates[label]
        self.max_running = max(self.max_running, len(self.running))

    def finished(self, label: str) -> None:
        self.running.pop(label, None)

    def note(self) -> str | None:
        """The summary line when memory kept the pool below its job count, else None."""
        want = min(self.jobs, len(self.estimates))
        if self.free is None or self.max_running >= want:
            return None
        biggest = max(self.estimates.values(), default=0)
        return (f"host memory: at most {self.max_running} compile(s) at once instead of {want} (free "
                f"{fmt_bytes(self.free)} from {self.source}; a compile needs up to {fmt_bytes(biggest)}, "
                "estimated from past compiles or graph size)")

    def to_json(self) -> dict:
        return {"free_memory_bytes": self.free, "source": self.source, "jobs": self.jobs,
                "max_concurrent": self.max_running, "held_back": self.note() is not None}


def admission_for(jobs: list, pool_jobs: int) -> Admission:
    """The gate for a local build of ``jobs`` (each with graph, label, cache_root) on ``pool_jobs`` workers."""
    from neffbuild import settings
    from neffbuild.compiler.cache import Cache

    history = Cache(jobs[0].cache_root).metas() if jobs else []
    free, source = settings.free_memory_bytes()
    return Admission({j.label: estimate_rss(j.graph, j.label, history)[0] for j in jobs}, free, source, pool_jobs)


# -- plan

def _created(meta: dict) -> float:
    value = meta.get("created", 0)
    return value if isinstance(value, (int, float)) else 0

def _largest_artifact(targets, states: dict, entries: list[dict]) -> dict:
    """The largest artifact: its cached size where the target's key is cached, else the latest size of a past
    compile with the same label (an estimate); unknown when neither exists."""
    by_key = {e["key"]: e for e in entries}
    best = {"label": None, "bytes": None, "source": "unknown"}
    for t in targets:
        entry = by_key.get(states.get(t.label, {}).get("cache_key"))
        source = "cache"
        if entry is None:
            same = [e for e in entries if e.get("label") == t.label and e.get("bytes")]
            entry, source = (max(same, key=_created), "estimate") if same else (None, "")
        if entry and (best["bytes"] is None or entry["bytes"] > best["bytes"]):
            best = {"label": t.label, "bytes": int(entry["bytes"]), "source": source}
    return best


def plan_doc(recipe, targets, states: dict, *, device_bytes: int | None, cache_root) -> dict:
    """``plan``'s ``memory`` document: per rank (neffbuild.memory) plus each target's compile RSS."""
    from neffbuild import memory, settings
    from neffbuild.compiler.cache import Cache

    entries = Cache(cache_root).metas()
    doc = memory.per_rank(recipe, device_bytes, _largest_artifact(targets, states, entries))
    compile_rows = {}
    for t in targets:
        rss, source = estimate_rss(target_graph(recipe, t), t.label, entries, states.get(t.label, {}).get("cache_key"))
        compile_rows[t.label] = {"peak_rss_bytes": rss, "source": source}
    free, where = settings.free_memory_bytes()
    admission = Admission({k: v["peak_rss_bytes"] for k, v in compile_rows.items()}, free, where,
                          recipe.jobs or settings.default_jobs())
    doc["compile"] = {"free_memory_bytes": free, "free_memory_source": where,
                      "concurrent_compiles": admission.workers(), "targets": compile_rows}
    return doc


SOURCE_TEXT = {"key": "past compile, same key", "graph": "past compile, same graph", "size": "graph size"}


def describe(doc: dict, jobs: int) -> list[str]:
    """Text lines for ``plan``: device memory per rank, then each target's compile memory."""
    from neffbuild import memory

    lines = memory.describe(doc)
    c = doc["compile"]
    lines.append(f"compile memory (expected peak host RSS; host free {fmt_bytes(c['free_memory_bytes'])} from "
                 f"{c['free_memory_source']}: {c['concurrent_compiles']} of {jobs} jobs at once):")
    width = max((len(label) for label in c["targets"]), default=0)
    for label, row in c["targets"].items():
        lines.append(f"  {label:<{width}}  {fmt_bytes(row['peak_rss_bytes']):>10}  ({SOURCE_TEXT[row['source']]})")
    return lines
