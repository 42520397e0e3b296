"""Cache state per target for ``neffbuild plan``: cached or to build, why, and how long."""

from __future__ import annotations

from neffbuild import settings
from neffbuild.compiler.backends import get_backend
from neffbuild.compiler.builder import backend_kwargs
from neffbuild.compiler.cache import Cache
from neffbuild.compiler.graphs import target_graph
from neffbuild.compiler.worker import graph_summary, key_for
from neffbuild.errors import BackendUnavailable, NeffbuildError


def _diff(meta: dict, fingerprint: dict, graph: dict, signature: list) -> list[str]:
    """Fields that differ between a cached entry and what this target would build."""
    out = []
    old_fp = meta.get("fingerprint", {})
    for k in sorted(set(old_fp) | set(fingerprint)):
        if old_fp.get(k) != fingerprint.get(k):
            out.append(f"{k}: {old_fp.get(k)!r} -> {fingerprint.get(k)!r}")
    if meta.get("graph") != graph:
        changed = [k for k in graph if meta.get("graph", {}).get(k) != graph[k]]
        out.append("shape: " + ", ".join(f"{k} {meta.get('graph', {}).get(k)!r} -> {graph[k]!r}" for k in changed)
                   if changed else "shape")
    elif meta.get("input_signature") != signature:
        out.append("input signature")
    if not out:
        out.append("graph (model code or config changed)")
    return out


def cache_states(recipe, targets, *, cache_root=None, backend_name=None, remote: str | None = None,
                 on_target=None) -> dict[str, dict]:
    """{label: {"cache": "local"|"remote"|"build", "why": str, "estimate_s": float|None}}.

    ``remote`` (s3://...): a local miss the remote tier holds is ``remote`` (a remote that cannot be
    asked leaves it ``build``, with the reason in ``why``).
    ``on_target(done, total)``: called after each target is keyed (each traces its graph: a big grid takes
    minutes, so the CLI prints progress from it)."""
    from neffbuild.compiler.remote_tier import open_tier

    tier = open_tier(remote, "ro")
    if tier is not None:
        tier.probe()
    cache = Cache(cache_root or recipe.cache_dir or settings.cache_dir())
    entries = cache.list()  # every entry here has been validated (sha256 checked) once
    valid_keys = {e["key"] for e in entries}
    times = [e["compile_seconds"] for e in entries if "compile_seconds" in e]
    kwargs = backend_kwargs(recipe, backend_name)
    try:
        get_backend(**kwargs)
    except BackendUnavailable as exc:
        return {t.label: {"cache": "unknown", "why": str(exc).split(";")[0]} for t in targets}
    out = {}
    for n, t in enumerate(targets):
        if on_target is not None:
            on_target(n, len(targets))
        backend = get_backend(**dict(kwargs, flags=recipe.flags_for(t.label)))
        spec = target_graph(recipe, t)
        try:
            key, _, signature, _ = key_for(spec, backend, fake=True)  # never allocates the KV pool
        except NeffbuildError as exc:
            out[t.label] = {"cache": "error", "why": str(exc)}
            continue
        if key in valid_keys:
            out[t.label] = {"cache": "local", "why": "", "cache_key": key}
            continue
        if tier is not None and tier.has(key):
            out[t.label] = {"cache": "remote", "why": f"in {tier.url}", "cache_key": key}
            continue
        same = [e for e in entries if e.get("label") == t.label]
        graph = graph_summary(spec)
        if same:
            nearest = max(same, key=lambda e: e.get("created", 0))
            why = "differs from cached " + nearest["key"][:12] + ": " + "; ".join(
                _diff(nearest, backend.fingerprint(), graph, signature))
        else:
            why = "no cached entry for this target"
        past = [e["compile_seconds"] for e in same] or times
        if tier is not None and tier.down:
            why += f"; remote {tier.state}"
        out[t.label] = {"cache": "build", "why": why, "cache_key": key,
                        "estimate_s": round(sum(past) / len(past), 1) if past else None}
    return out
