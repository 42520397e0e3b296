"""What one worker does for one target: trace, key, then cache hit or compile + publish,
then a smoke run of the artifact bound to the bundle's weights (compiler/smoke.py).

Runs inside a long-lived worker process (a warm worker compiles ~3x faster than a fresh
one). Everything the job and the compiler print goes to the target's log file (``job_output``: in a worker
process fds 1 and 2 too; never the caller's stdout), and the result is a ``JobResult`` (compiler/jobs.py).
``cached_result`` is the cheap path the builder tries first, in its own process: a pre-key hit needs no tracing.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import resource
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from neffbuild import registry
from neffbuild.compiler.backends import get_backend
from neffbuild.compiler.cache import Cache, cache_key, pre_key
from neffbuild.compiler.graph_spec import graph_summary
from neffbuild.compiler.graphs import (
    TargetGraph,
    build_graph,
    fake_example_inputs,
    input_signature,
    placeholder_groups,
)
from neffbuild.compiler.jobs import (
    COMPILER_ERROR,
    ENVIRONMENT,
    KILLED,
    LOAD_ERROR,
    TIMEOUT,
    Job,
    JobResult,
    publish,
)
from neffbuild.compiler.smoke import LoadFailed, smoke_run
from neffbuild.compiler.sources import source_digest
from neffbuild.errors import BackendUnavailable
from neffbuild.runtime.bundle import weights_file

# Re-exported: executors, tests and the CLI name the job types from here too.
__all__ = ["COMPILER_ERROR", "ENVIRONMENT", "KILLED", "LOAD_ERROR", "TIMEOUT", "Job", "JobResult", "cached_result",
           "graph_summary", "key_for", "pre_key_for", "run_job", "source_digest", "warm_up"]


def pre_key_for(graph: TargetGraph, backend) -> str:
    """The key a warm rebuild looks up before tracing: the graph's spec, the backend, the source.

    Like the cache key, it covers a sharded graph's parallel layout and ignores dp for an unsharded one.
    """
    return pre_key(graph.spec(), backend.fingerprint(), source_digest())


_OWN_PROCESS = False  # set by warm_up: a pool worker runs one job at a time, so its fds 1 and 2 may be the job's
_LOG: contextvars.ContextVar = contextvars.ContextVar("job_log", default=None)


def _say(line: str) -> None:
    """One line into the running job's log file (never the caller's stdout: ``--json`` owns that)."""
    log = _LOG.get()
    if log is not None:
        log.write(line + "\n")
        log.flush()


@contextlib.contextmanager
def job_output(path: str, *, own_process: bool | None = None):
    """The job's log for its duration. The job's own lines go there through ``_say``, whatever process or thread
    runs it. In a process of its own (a pool or Ray worker) fds 1 and 2 point there too, so a compiler's native
    output is kept; in a shared process (the driver's pre-key hits, the inline executor) the fds stay as they
    are, because swapping them would carry other threads' output (the progress line, another job) with it."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    own = _OWN_PROCESS if own_process is None else own_process
    with open(path, "a") as log:
        token = _LOG.set(log)
        saved = None
        if own:
            sys.stdout.flush()
            sys.stderr.flush()
            saved = os.dup(1), os.dup(2)
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            _LOG.reset(token)
            if saved is not None:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                os.close(saved[0])
                os.close(saved[1])


def key_for(graph: TargetGraph, backend, *, fake: bool = False) -> tuple[str, object, list, str]:
    """(cache key, exported graph, input signature, graph text) for one target.

    ``fake``: trace on fake example inputs (``plan``: the same key, no KV pool allocated; the
    exported graph is then only good for its text)."""
    with fake_example_inputs() if fake else contextlib.nullcontext():
        module, inputs = build_graph(graph)
    with placeholder_groups(graph.parallel):
        exported = backend.export(module, inputs)
    text = backend.graph_text(exported)
    signature = input_signature(inputs, graph.family)
    fingerprint = backend.fingerprint()
    if graph.parallel.sharded:  # the layout is part of a sharded graph's key (an unsharded graph ignores dp)
        fingerprint = dict(fingerprint, parallel=graph.parallel.to_json())
    return cache_key(text, signature, fingerprint), exported, signature, text


def _ok(result: JobResult, entry, hit: bool) -> JobResult:
    return result.from_meta(entry.meta, hit=hit, artifact=str(entry.path)).replace(cache_key=entry.key)


def _smoke(job: Job, backend, entry) -> None:
    """Load + one zero step (EAGLE3 drafts too: compiler/smoke.py); skipped without weights (or where this
    node cannot see them) and for sharded graphs (their collectives need live peers)."""
    if job.weights_path is None or not Path(job.weights_path).is_file() or job.graph.parallel.sharded:
        return
    t0 = time.monotonic()
    smoke_run(backend, entry.path, job.graph, weights_file.load(Path(job.weights_path)))
    _say(f"== smoke run ok in {time.monotonic() - t0:.2f}s")


def _classified(result: JobResult, exc: BaseException, job: Job) -> JobResult:
    if isinstance(exc, LoadFailed):
        kind, error = LOAD_ERROR, f"{job.label}: the artifact does not load or run with the bundle's weights: {exc}"
    elif isinstance(exc, (BackendUnavailable, ImportError)):
        kind, error = ENVIRONMENT, str(exc)
    else:
        kind, error = COMPILER_ERROR, f"{type(exc).__name__}: {exc}".strip()
    with contextlib.suppress(OSError), open(job.log_path, "a") as log:
        log.write(traceback.format_exc() if kind != ENVIRONMENT else f"== {kind}: {error}\n")
    return result.failure(kind, error)


def cached_result(job: Job) -> JobResult | None:
    """The result of a pre-key hit (smoke run included), or None when the target must be traced."""
    started = time.monotonic()
    try:
        backend = get_backend(**job.backend)
        pre = pre_key_for(job.graph, backend)
        entry = Cache(job.cache_root).get_pre(pre)
    except Exception:
        return None
    if entry is None:
        return None
    result = JobResult(job.label, job.log_path, pid=os.getpid(), traced=False, pre_key=pre)
    try:
        with job_output(job.log_path):
            _say(f"== {job.label}: cache hit {entry.key} (pre-key, not traced)")
            _smoke(job, backend, entry)
        result = _ok(result, entry, hit=True)
    except Exception as exc:
        result = _classified(result, exc, job)
    return result.replace(seconds=round(time.monotonic() - started, 3))


def _build(job: Job, backend, result: JobResult):
    """Trace, key, then the cache entry (compiled and published on a miss, with the pre-key)."""
    t0 = time.monotonic()
    key, exported, signature, _ = key_for(job.graph, backend)
    trace_s = time.monotonic() - t0
    compiled, fetched = [], []
    result = result.replace(cache_key=key, input_signature=signature)
    remote = _remote_tier(job)

    def produce(tmp: Path):
        if remote is not None and key not in job.remote_skip:  # the second tier: fetched and checked into tmp
            from neffbuild.compiler.remote_meta import expected_meta
            from neffbuild.compiler.smoke_child import fetched_check

            got = remote.fetch_to(key, tmp, fetched_check(job), expected_meta(job, backend, signature))
            if got is not None:
                fetched.append(got)
                return got
        t0 = time.monotonic()
        with placeholder_groups(job.graph.parallel):  # a sharded graph's group names resolve while compiling
            artifact = backend.compile(exported, tmp)
        seconds = time.monotonic() - t0
        compiled.append(seconds)
        return artifact, {
            "label": job.label, "compile_seconds": round(seconds, 3), "fingerprint": backend.fingerprint(),
            "graph": graph_summary(job.graph), "input_signature": signature, "ext": backend.ext,
            "peak_rss_bytes": peak_rss_bytes(),  # the Ray executor's memory estimate reads it
        }

    entry = publish(Cache(job.cache_root), key, result.pre_key, produce)
    if remote is not None:
        result = result.replace(remote=dict(remote.stats.to_json(), state=remote.state), remote_hit=bool(fetched))
    if compiled:
        _say(f"== compiled in {compiled[0]:.1f}s -> {entry.path}")
        if getattr(backend, "profile", None):
            _say(f"== compile profile: trace {trace_s:.1f}s, {backend.profile}")
    elif fetched:
        _say(f"== remote cache hit {key} ({remote.url})")
    else:
        _say(f"== cache hit {key}")
    return entry, not compiled, result


def _remote_tier(job: Job):
    """This worker's RemoteCache for the job's tier (its counts reset for this job), or None without one."""
    if not job.remote:
        return None
    from neffbuild.compiler.remote_cache import RemoteStats, for_worker

    remote = for_worker(*job.remote, job.remote_trust)
    remote.stats = RemoteStats()
    return remote


def _driver_hit(job: Job, backend, result: JobResult, lookup: Callable[[str], dict | None]) -> JobResult:
    """Ray without a shared cache: ask the driver's cache for the traced key; a hit carries its meta, no path."""
    key, _, signature, _ = key_for(job.graph, backend)
    result = result.replace(cache_key=key, input_signature=signature)
    meta = lookup(key)
    if meta is None:
        return result
    _say(f"== cache hit {key} (driver's cache)")
    return result.from_meta(dict(meta, input_signature=signature), hit=True, artifact=None)


def run_job(job: Job, lookup: Callable[[str], dict | None] | None = None, *,
            own_process: bool | None = None) -> JobResult:
    """Build one target through the cache and smoke-run it. Never raises: failures come back classified.

    ``lookup(key)`` (Ray without a shared cache) asks the driver's cache first: on a hit the
    result carries the entry's meta and no local artifact path. ``own_process``: this process runs only this
    job (a Ray task), so the compiler's native output may be captured by fd (``job_output``).
    """
    result = JobResult(job.label, job.log_path, pid=os.getpid(), traced=True)
    started = time.monotonic()
    try:
        with job_output(job.log_path, own_process=own_process):
            _say(f"== {job.label}: {job.backend}")
            backend = get_backend(**job.backend)
            result = result.replace(pre_key=pre_key_for(job.graph, backend))
            if lookup is not None:
                result = _driver_hit(job, backend, result, lookup)
                if result.ok:
                    return result.replace(seconds=round(time.monotonic() - started, 3))
            entry, hit, result = _build(job, backend, result)
            _smoke(job, backend, entry)
        result = _ok(result, entry, hit)
    except Exception as exc:
        result = _classified(result, exc, job)
    return result.replace(seconds=round(time.monotonic() - started, 3))


def peak_rss_bytes() -> int:
    """This process's peak resident memory (a warm worker's includes earlier jobs: an upper bound)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def warm_up() -> int:
    """Import the heavy modules once per worker so the first job does not pay for them.

    Inductor's own compile pool is switched off: an AOTInductor CPU artifact is one C++
    translation unit per kind (wrapper, kernels), so the pool only adds processes (one per
    core, in every worker) that compete with the workers themselves for the same cores.
    """
    global _OWN_PROCESS
    _OWN_PROCESS = True
    import torch._inductor.config  # workers only: the driver never compiles, and its start stays short

    torch._inductor.config.compile_threads = 1
    for arch in registry.ARCHITECTURES.values():
        arch.get("decode")
    return os.getpid()
