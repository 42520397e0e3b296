"""What one worker does for one target: trace, key, then cache hit or compile + publish,
then a smoke run of the artifact bound to the bundle's weights (compiler/smoke.py).

Runs inside a long-lived worker process (a warm worker compiles ~3x faster than a fresh
one). Everything the compiler prints goes to the target's log file (fds 1 and 2 are
redirected for the duration), and the result is a plain dict. ``cached_result`` is the
cheap path the builder tries first, in its own process: a pre-key hit needs no tracing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from neffbuild.compiler.graphs import GraphSpec

COMPILER_ERROR, KILLED, TIMEOUT, ENVIRONMENT = "compiler_error", "killed_or_oom", "timeout", "environment"
LOAD_ERROR = "load_error"
# The source that shapes a traced graph: the kernels, the models (which import only models,
# kernels and runtime layout types), the runtime, and how a Target becomes a graph and is traced.
_GRAPH_SOURCES = ("kernels", "neffbuild/models", "neffbuild/runtime", "neffbuild/compiler/graphs.py",
                  "neffbuild/compiler/backends")


@dataclass(frozen=True)
class Job:
    label: str
    graph: GraphSpec
    backend: dict  # get_backend kwargs: name, target, optlevel, lnc, flags
    cache_root: str
    log_path: str
    weights_path: str | None = None  # the bundle's weights, for the smoke run (None: skip it)
    remote: tuple[str, str] | None = None  # (s3:// URL, mode) of the remote cache tier (compiler/remote_cache.py)


@functools.cache
def source_digest() -> str:
    """sha256 over the source of the packages that define the graphs (part of the pre-key)."""
    import kernels

    root = Path(kernels.__file__).resolve().parent.parent
    h = hashlib.sha256()
    for rel in _GRAPH_SOURCES:
        path = root / rel
        for f in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def pre_key_for(graph: GraphSpec, backend) -> str:
    """The key a warm rebuild looks up before tracing: the graph's spec, the backend, the source.

    Like the cache key, it covers a sharded graph's parallel layout and ignores dp for an unsharded one.
    """
    from neffbuild.compiler.cache import pre_key

    spec = dataclasses.asdict(graph)
    if graph.layout.sharded:
        spec["parallel"] = graph.layout.to_json()
    else:
        spec = {k: v for k, v in spec.items() if k not in ("tp", "dp", "ep")}
    return pre_key(spec, backend.fingerprint(), source_digest())


@contextlib.contextmanager
def redirected_output(path: str):
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "a") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def key_for(graph: GraphSpec, backend) -> tuple[str, object, list, str]:
    """(cache key, exported graph, input signature, graph text) for one target."""
    from neffbuild.compiler.cache import cache_key
    from neffbuild.compiler.graphs import (
        build_graph,
        input_signature,
        placeholder_groups,
    )

    module, inputs = build_graph(graph)
    with placeholder_groups(graph.layout):
        exported = backend.export(module, inputs)
    text = backend.graph_text(exported)
    signature = input_signature(inputs, graph.family)
    fingerprint = backend.fingerprint()
    if graph.layout.sharded:  # the layout is part of a sharded graph's key (an unsharded graph ignores dp)
        fingerprint = dict(fingerprint, parallel=graph.layout.to_json())
    return cache_key(text, signature, fingerprint), exported, signature, text


def _ok(result: dict, entry, hit: bool) -> dict:
    return dict(result, status="ok", hit=hit, cache_key=entry.key, input_signature=entry.meta["input_signature"],
                artifact=str(entry.path), sha256=entry.meta["sha256"], bytes=entry.meta["bytes"],
                compile_seconds=entry.meta["compile_seconds"], ext=entry.meta["ext"])


def _smoke(job: Job, backend, entry) -> None:
    """Load + one zero step (EAGLE3 drafts too: compiler/smoke.py); skipped without weights (or where this
    node cannot see them) and for sharded graphs (their collectives need live peers)."""
    if job.weights_path is None or not Path(job.weights_path).is_file() or job.graph.layout.sharded:
        return
    from neffbuild.compiler.smoke import smoke_run
    from neffbuild.runtime import weights_file

    t0 = time.monotonic()
    smoke_run(backend, entry.path, job.graph, weights_file.load(Path(job.weights_path)))
    print(f"== smoke run ok in {time.monotonic() - t0:.2f}s", flush=True)


def _classified(result: dict, exc: BaseException, job: Job) -> dict:
    from neffbuild.compiler.smoke import LoadFailed
    from neffbuild.errors import BackendUnavailable

    if isinstance(exc, LoadFailed):
        kind, error = LOAD_ERROR, f"{job.label}: the artifact does not load or run with the bundle's weights: {exc}"
    elif isinstance(exc, (BackendUnavailable, ImportError)):
        kind, error = ENVIRONMENT, str(exc)
    else:
        kind, error = COMPILER_ERROR, f"{type(exc).__name__}: {exc}".strip()
    with contextlib.suppress(OSError), open(job.log_path, "a") as log:
        log.write(traceback.format_exc() if kind != ENVIRONMENT else f"== {kind}: {error}\n")
    return dict(result, status="failed", kind=kind, error=error[:2000])


def cached_result(job: Job) -> dict | None:
    """The result of a pre-key hit (smoke run included), or None when the target must be traced."""
    from neffbuild.compiler.backends import get_backend
    from neffbuild.compiler.cache import Cache

    started = time.monotonic()
    try:
        backend = get_backend(**job.backend)
        entry = Cache(job.cache_root).get_pre(pre_key_for(job.graph, backend))
    except Exception:
        return None
    if entry is None:
        return None
    result = {"label": job.label, "log": job.log_path, "pid": os.getpid(), "traced": False}
    try:
        with redirected_output(job.log_path):
            print(f"== {job.label}: cache hit {entry.key} (pre-key, not traced)", flush=True)
            _smoke(job, backend, entry)
        result = _ok(result, entry, hit=True)
    except Exception as exc:
        result = _classified(result, exc, job)
    result["seconds"] = round(time.monotonic() - started, 3)
    return result


def _build(job: Job, backend, result: dict):
    """Trace, key, then the cache entry (compiled and published on a miss); records the pre-key."""
    from neffbuild.compiler.cache import Cache
    from neffbuild.compiler.graphs import placeholder_groups

    t0 = time.monotonic()
    key, exported, signature, _ = key_for(job.graph, backend)
    trace_s = time.monotonic() - t0
    result.update(cache_key=key, input_signature=signature)
    cache = Cache(job.cache_root)
    with cache.lock(key):
        entry = cache.get(key)
        if entry is None and job.remote:  # the second tier: fetched, checked, published locally
            entry = _remote_fetch(job, cache, key, result)
        hit = entry is not None
        if entry is None:
            tmp = cache.new_tmp(key)
            t0 = time.monotonic()
            with placeholder_groups(job.graph.layout):  # a sharded graph's group names resolve while compiling
                artifact = backend.compile(exported, tmp)
            seconds = time.monotonic() - t0
            entry = cache.publish(key, tmp, artifact, {
                "label": job.label, "compile_seconds": round(seconds, 3), "fingerprint": backend.fingerprint(),
                "graph": graph_summary(job.graph), "input_signature": signature, "ext": backend.ext,
                "peak_rss_bytes": peak_rss_bytes(),  # the Ray executor's memory estimate reads it
            })
            print(f"== compiled in {seconds:.1f}s -> {entry.path}", flush=True)
            if getattr(backend, "profile", None):
                print(f"== compile profile: trace {trace_s:.1f}s, {backend.profile}", flush=True)
        else:
            print(f"== cache hit {key}", flush=True)
    cache.put_pre(pre_key_for(job.graph, backend), key)
    return entry, hit


def _remote_fetch(job: Job, cache, key: str, result: dict):
    from neffbuild.compiler.remote_cache import RemoteStats, for_worker

    remote = for_worker(*job.remote)
    remote.stats = RemoteStats()
    entry = remote.fetch(cache, key)
    result["remote"] = dict(remote.stats.to_json(), state=remote.state)
    if entry is not None:
        print(f"== remote cache hit {key} ({remote.url})", flush=True)
    return entry


def _driver_hit(job: Job, backend, result: dict, lookup: Callable[[str], dict | None]) -> bool:
    """Ray without a shared cache: ask the driver's cache for the traced key; a hit carries its meta, no path."""
    key, _, signature, _ = key_for(job.graph, backend)
    result.update(cache_key=key, input_signature=signature)
    meta = lookup(key)
    if meta is None:
        return False
    print(f"== cache hit {key} (driver's cache)", flush=True)
    result.update(status="ok", hit=True, artifact=None, sha256=meta["sha256"], bytes=meta["bytes"],
                  compile_seconds=meta["compile_seconds"], ext=meta["ext"])
    return True


def run_job(job: Job, lookup: Callable[[str], dict | None] | None = None) -> dict:
    """Build one target through the cache and smoke-run it. Never raises: failures come back classified.

    ``lookup(key)`` (Ray without a shared cache) asks the driver's cache first: on a hit the
    result carries the entry's meta and no local artifact path.
    """
    from neffbuild.compiler.backends import get_backend

    result = {"label": job.label, "status": "failed", "hit": False, "log": job.log_path, "pid": os.getpid(),
              "traced": True}
    started = time.monotonic()
    try:
        with redirected_output(job.log_path):
            print(f"== {job.label}: {job.backend}", flush=True)
            backend = get_backend(**job.backend)
            if lookup is not None and _driver_hit(job, backend, result, lookup):
                result["seconds"] = round(time.monotonic() - started, 3)
                return result
            entry, hit = _build(job, backend, result)
            _smoke(job, backend, entry)
        result = _ok(result, entry, hit)
    except Exception as exc:
        result = _classified(result, exc, job)
    result["seconds"] = round(time.monotonic() - started, 3)
    return result


def peak_rss_bytes() -> int:
    """This process's peak resident memory (a warm worker's includes earlier jobs: an upper bound)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def graph_summary(graph: GraphSpec) -> dict:
    return {"family": graph.family, "batch": graph.batch, "ctx": graph.ctx, "query_len": graph.query_len,
            "block_size": graph.block_size, "num_blocks": graph.num_blocks, "num_swa": graph.num_swa,
            "fp8_packed_kv": graph.fp8_packed_kv, "tp": graph.tp, "dp": graph.dp, "ep": graph.ep}


def warm_up() -> int:
    """Import the heavy modules once per worker so the first job does not pay for them.

    Inductor's own compile pool is switched off: an AOTInductor CPU artifact is one C++
    translation unit per kind (wrapper, kernels), so the pool only adds processes (one per
    core, in every worker) that compete with the workers themselves for the same cores.
    """
    import torch._inductor
    import torch._inductor.config

    from neffbuild import registry

    torch._inductor.config.compile_threads = 1
    for arch in registry.ARCHITECTURES.values():
        arch.get("decode")
    return os.getpid()
