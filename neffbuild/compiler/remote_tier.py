"""The builder's side of the remote cache tier and of sharded builds (few hooks in builder.py).

The driver (the ``compile`` process) resolves remote pre-key hits before any worker starts,
pushes every entry that compiled and passed its smoke run (and local hits the remote lacks),
and adds up what the workers report (remote hits and errors found while tracing). Shards are
deterministic slices of the build order: round-robin over largest-first, so each shard gets
a like share of the big graphs and every target lands in exactly one shard.
"""

from __future__ import annotations

import dataclasses

from neffbuild.compiler.jobs import Job, JobResult
from neffbuild.compiler.remote_cache import MODES, RemoteCache
from neffbuild.compiler.remote_meta import expected_meta
from neffbuild.errors import InvalidInput


def open_tier(url: str | None, mode: str = "auto", *, trusted: tuple[bytes, ...] = (),
              sign_key=None) -> RemoteCache | None:
    """The run's remote tier (None without a URL); a bad URL or mode is an InvalidInput before any work.

    ``trusted``: PEM public keys; only entries one of them signed are used (others are rebuilt). Without
    any, the run says once that the bucket is trusted as is. ``sign_key``: what this run pushes is signed."""
    if not url:
        return None
    if mode not in MODES:
        raise InvalidInput(f"--cache-remote-mode: got {mode!r}, must be one of {', '.join(MODES)}")
    tier = RemoteCache(url, mode, trusted=trusted, sign_key=sign_key)
    if not trusted:
        tier.warn(f"remote cache {tier.url}: no trusted keys (--cache-trust), so every entry in the bucket is "
                  "trusted as is: whoever can write it decides what this build runs (docs/remote-cache.md, Trust)")
    return tier


def parse_shard(value: str) -> tuple[int, int]:
    """``I/N`` with 1 <= I <= N; InvalidInput naming ``--shard`` otherwise."""
    try:
        i, n = (int(p) for p in value.split("/"))
    except ValueError:
        raise InvalidInput(f"--shard: got {value!r}, expected I/N (for example 1/4)") from None
    if not 1 <= i <= n:
        raise InvalidInput(f"--shard: got {value!r}, I must be between 1 and N")
    return i, n


def shard_slice(targets: list, i: int, n: int) -> list:
    """The I-th of N slices of ``targets`` (in build order): every n-th target starting at i-1."""
    return [t for j, t in enumerate(targets) if j % n == i - 1]


def cached_remote(tier: RemoteCache | None, cache, job: Job) -> JobResult | None:
    """A remote pre-key hit, fetched into the local cache and then served as a local pre-key hit."""
    if tier is None:
        return None
    from neffbuild.compiler.backends import get_backend
    from neffbuild.compiler.worker import cached_result, pre_key_for

    try:
        backend = get_backend(**job.backend)
        pre = pre_key_for(job.graph, backend)
    except Exception:
        return None
    from neffbuild.compiler.smoke_child import fetched_check

    before = tier.stats.hits
    if tier.fetch_pre(cache, pre, fetched_check(job), expected_meta(job, backend)) is None:
        return None
    res = cached_result(job)
    if res is not None and tier.stats.hits > before:
        res = res.replace(remote_hit=True)
    return res


def for_worker(tier: RemoteCache | None, job: Job) -> Job:
    """The job as a worker gets it: without the tier once it is down, and told which keys the driver
    already found corrupt on the remote (the worker does not fetch and count them again)."""
    if tier is None or not job.remote:
        return job
    if tier.down or tier.suspect:
        return dataclasses.replace(job, remote=None)
    return dataclasses.replace(job, remote_skip=tuple(sorted(tier.rejected)))


def after_result(tier: RemoteCache | None, cache, job: Job, res: JobResult) -> JobResult:
    """Fold a worker's remote report into the run's, then push what this run built (never a failure)."""
    if tier is None:
        return res
    report = res.remote or {}
    tier.stats.hits += report.get("hits", 0)
    tier.stats.errors += report.get("errors", 0)
    for w in report.get("warnings", []):
        tier.warn(w)
    if report.get("state") == "unreachable":
        tier.down = tier.down or "unreachable"
    if report.get("state") == "suspect":
        tier.suspect = True
    if report.get("hits"):
        res = res.replace(remote_hit=True)
    if not res.ok or res.remote_hit or not res.cache_key:
        return res
    entry = cache.get(res.cache_key, discard=False)
    if entry is None:  # Ray without a shared cache keeps artifacts elsewhere; nothing local to push
        return res
    from neffbuild.compiler.backends import get_backend
    from neffbuild.compiler.worker import pre_key_for

    return res.replace(push=tier.push(entry, pre_key_for(job.graph, get_backend(**job.backend))))


def summary(tier: RemoteCache | None, results: list[JobResult]) -> dict | None:
    """The run's remote summary: URL (no credential is ever part of it), mode, state and counts."""
    if tier is None:
        return None
    return {"url": str(tier.url), "mode": tier.mode, "state": tier.state, "hits": tier.stats.hits,
            "pushes": tier.stats.pushes, "errors": tier.stats.errors, "warnings": list(tier.stats.warnings),
            "pushed": sorted(r.label for r in results if r.push == "pushed")}
