"""What one worker does for one target: trace, key, then cache hit or compile + publish.

Runs inside a long-lived worker process (a warm worker compiles ~3x faster than a fresh
one). Everything the compiler prints goes to the target's log file (fds 1 and 2 are
redirected for the duration), and the result is a plain dict.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from neffbuild.compiler.graphs import GraphSpec

COMPILER_ERROR, KILLED, TIMEOUT, ENVIRONMENT = "compiler_error", "killed_or_oom", "timeout", "environment"


@dataclass(frozen=True)
class Job:
    label: str
    graph: GraphSpec
    backend: dict  # get_backend kwargs: name, target, optlevel, lnc, flags
    cache_root: str
    log_path: str


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


def run_job(job: Job, lookup: Callable[[str], dict | None] | None = None) -> dict:
    """Build one target through the cache. Never raises: failures come back classified.

    ``lookup(key)`` (Ray without a shared cache) asks the driver's cache first: on a hit
    the result carries the entry's meta and no local artifact path.
    """
    from neffbuild.compiler.backends import get_backend
    from neffbuild.errors import BackendUnavailable, InvalidInput

    result = {"label": job.label, "status": "failed", "hit": False, "log": job.log_path, "pid": os.getpid()}
    started = time.monotonic()
    try:
        with redirected_output(job.log_path):
            print(f"== {job.label}: {job.backend}", flush=True)
            backend = get_backend(**job.backend)
            key, exported, signature, _ = key_for(job.graph, backend)
            result.update(cache_key=key, input_signature=signature)
            meta = lookup(key) if lookup else None
            if meta is not None:
                result.update(hit=True, artifact=None)
                print(f"== cache hit {key} (driver's cache)", flush=True)
            else:
                entry, hit = _through_cache(job, backend, key, exported, signature)
                meta = entry.meta
                result.update(hit=hit, artifact=str(entry.path))
        result.update(status="ok", sha256=meta["sha256"], bytes=meta["bytes"],
                      compile_seconds=meta["compile_seconds"], ext=meta["ext"])
    except (BackendUnavailable, ImportError) as exc:
        result.update(kind=ENVIRONMENT, error=str(exc))
    except (InvalidInput, Exception) as exc:
        result.update(kind=COMPILER_ERROR, error=f"{type(exc).__name__}: {exc}".strip()[:2000])
        with contextlib.suppress(OSError), open(job.log_path, "a") as log:
            log.write(traceback.format_exc())
    result["seconds"] = round(time.monotonic() - started, 3)
    return result


def _through_cache(job: Job, backend, key: str, exported, signature) -> tuple:
    """(cache entry, hit): the cached artifact, or compile it and publish under the key's lock."""
    from neffbuild.compiler.cache import Cache
    from neffbuild.compiler.graphs import placeholder_groups

    cache = Cache(job.cache_root)
    with cache.lock(key):
        entry = cache.get(key)
        if entry is not None:
            print(f"== cache hit {key}", flush=True)
            return entry, True
        tmp = cache.new_tmp(key)
        t0 = time.monotonic()
        with placeholder_groups(job.graph.layout):
            artifact = backend.compile(exported, tmp)
        seconds = time.monotonic() - t0
        entry = cache.publish(key, tmp, artifact, {
            "label": job.label, "compile_seconds": round(seconds, 3), "fingerprint": backend.fingerprint(),
            "graph": graph_summary(job.graph), "input_signature": signature, "ext": backend.ext,
            "peak_rss_bytes": peak_rss_bytes(),
        })
        print(f"== compiled in {seconds:.1f}s -> {entry.path}", flush=True)
        return entry, False


def peak_rss_bytes() -> int:
    """This process's peak resident memory (a warm worker's includes earlier jobs: an upper bound)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def graph_summary(graph: GraphSpec) -> dict:
    return {"family": graph.family, "batch": graph.batch, "ctx": graph.ctx, "query_len": graph.query_len,
            "block_size": graph.block_size, "num_blocks": graph.num_blocks, "num_swa": graph.num_swa,
            "fp8_packed_kv": graph.fp8_packed_kv, "tp": graph.tp, "dp": graph.dp, "ep": graph.ep}


def warm_up() -> int:
    """Import the heavy modules once per worker so the first job does not pay for them."""
    import torch
    import torch._inductor  # noqa: F401

    from neffbuild import registry

    for arch in registry.ARCHITECTURES.values():
        arch.get("decode")
    return os.getpid()
