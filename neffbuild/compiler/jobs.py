"""A compile job, its typed result, and the one way a job's artifact is published to a cache.

``Job`` is what an executor runs (picklable: a local worker or a Ray task); ``JobResult`` is
what every executor yields and what the builder, the CLI and the bundle read. ``publish``
is the only path from a finished compile into a cache, on a worker, on a Ray node and on
the Ray driver alike: it writes the entry under the key's lock (when it is missing) and
records the pre-key, so a later warm rebuild of the same target traces nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

OK, FAILED = "ok", "failed"
COMPILER_ERROR, KILLED, TIMEOUT, ENVIRONMENT = "compiler_error", "killed_or_oom", "timeout", "environment"
LOAD_ERROR = "load_error"


@dataclass(frozen=True)
class Job:
    label: str
    graph: object  # compiler.graphs.TargetGraph
    backend: dict  # get_backend kwargs: name, target, optlevel, lnc, flags
    cache_root: str
    log_path: str
    weights_path: str | None = None  # the bundle's weights, for the smoke run (None: skip it)
    remote: tuple[str, str] | None = None  # (s3:// URL, mode) of the remote cache tier (compiler/remote_cache.py)
    remote_skip: tuple[str, ...] = ()  # keys whose remote entry the driver already rejected: not fetched again
    remote_trust: tuple[bytes, ...] = ()  # PEM keys whose signature a remote entry needs (empty: none needed)


@dataclass(frozen=True)
class JobResult:
    """One target's outcome. ``artifact`` is a path in the cache that yields it (None for a Ray
    task's hit in the driver's cache until the driver resolves it)."""

    label: str
    log: str
    status: str = FAILED
    hit: bool = False
    traced: bool = False  # the graph was traced to compute its key (a pre-key hit is not)
    pid: int | None = None
    cache_key: str | None = None
    pre_key: str | None = None
    input_signature: list | None = None
    artifact: str | None = None
    sha256: str | None = None
    bytes: int | None = None
    compile_seconds: float | None = None
    ext: str | None = None
    kind: str | None = None  # a failure's class: COMPILER_ERROR, KILLED, TIMEOUT, ENVIRONMENT, LOAD_ERROR
    error: str | None = None
    seconds: float = 0.0
    node: str | None = None  # Ray: the host that ran it (build-info.json, never the manifest)
    remote: dict | None = None  # the worker's remote-tier report: RemoteStats.to_json() plus "state"
    remote_hit: bool = False  # the entry came from the remote tier
    push: str | None = None  # the driver's push outcome (RemoteCache.push), None when not pushed

    @property
    def ok(self) -> bool:
        return self.status == OK

    def replace(self, **changes) -> JobResult:
        return dataclasses.replace(self, **changes)

    def from_meta(self, meta: dict, *, hit: bool, artifact: str | None) -> JobResult:
        """This result made ok from a cache entry's meta."""
        return self.replace(status=OK, hit=hit, artifact=artifact, sha256=meta["sha256"], bytes=meta["bytes"],
                            compile_seconds=meta["compile_seconds"], ext=meta["ext"],
                            input_signature=meta.get("input_signature", self.input_signature))

    def failure(self, kind: str, error: str) -> JobResult:
        return self.replace(status=FAILED, kind=kind, error=error[:2000])


def failure(job: Job, kind: str, message: str) -> JobResult:
    """A job that ended outside the worker (killed, timed out, lost by the cluster), noted in its log."""
    try:
        with open(job.log_path, "a") as log:
            log.write(f"\n== {kind}: {message}\n")
    except OSError:
        pass
    return JobResult(job.label, job.log_path).failure(kind, message)


def publish(cache, key: str, pre_key: str | None, produce: Callable[[Path], tuple[Path, dict]] | None = None):
    """The cache entry for ``key`` (made by ``produce(tmp) -> (artifact, meta)`` when missing and
    ``produce`` is given), and the pre-key -> key record. None when the entry is missing and
    nothing can produce it."""
    with cache.lock(key):
        entry = cache.get(key)
        if entry is None and produce is not None:
            tmp = cache.new_tmp(key)
            artifact, meta = produce(tmp)
            entry = cache.publish(key, tmp, artifact, meta)
    if entry is not None and pre_key:
        cache.put_pre(pre_key, key)
    return entry
