"""RayExecutor: the same jobs as LocalExecutor, run as Ray tasks on a cluster.

Each target is one task with ``num_cpus`` and a ``memory`` reservation estimated from the
target (its weights and KV pool, or 1.25x the peak memory a past compile of the same graph
recorded in the cache), so Ray packs compiles by memory, not by a fixed count. Ray reuses
its worker processes, so torch and the compiler stay imported between targets (warm).

Artifacts come back one of two ways:
- object store (default): the task compiles in a scratch folder on its node and returns
  the artifact's bytes; the driver publishes them into its own cache under the same key.
  Tasks get the driver's cache index (key -> meta), so a target the driver already has
  is a hit without compiling or moving bytes;
- ``shared_cache=True``: every node mounts the cache folder at the same path, tasks use it
  directly (flock per key, atomic publish) and return only metadata.

Either way the driver receives the same result dicts as from LocalExecutor, appends each
task's log to the bundle's log file and adds ``node`` (where it was built). A task killed
for memory (or lost with its node) is retried once with twice the memory; a second loss
is ``killed_or_oom``. The per-target timeout is counted from submission; at most as many
tasks as the cluster has CPU slots are in flight, so submitted is (nearly) running.
Ctrl-C (or any error in the driver) cancels every task before it propagates.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from neffbuild.compiler.executor import _failure
from neffbuild.compiler.worker import COMPILER_ERROR, ENVIRONMENT, KILLED, TIMEOUT, Job, graph_summary
from neffbuild.errors import NeffbuildError

GIB = 1 << 30
BASE_MEMORY = 2 * GIB  # one compile worker: torch + compiler imported, tracing and codegen of a small graph
GRAPH_FACTOR = 3  # trace + export + compile each hold a copy of the graph's tensors at some point
HISTORY_MARGIN = 1.25
LOG_LIMIT = 8 << 20  # bytes of a task's log shipped back


def import_ray():
    try:
        import ray
    except ImportError as exc:
        raise NeffbuildError(f"--executor ray needs Ray, which is not installed here ({exc}); "
                             "install the extra: pip install 'neffbuild[ray]'") from None
    return ray


def graph_bytes(job: Job) -> int:
    """Bytes the traced graph holds: weights (bf16), the KV pool, fp32 attention scores of every layer."""
    from neffbuild import registry

    g, cfg = job.graph, job.graph.config
    shapes = registry.arch(g.arch).get("placeholder_shapes")(cfg)
    weights = sum(2 * math.prod(s) for s in shapes.values())
    kv = g.kv_layout()
    scores = 4 * g.batch * g.query_len * g.ctx * cfg.num_attention_heads * cfg.num_hidden_layers
    return weights + kv.num_buffers * math.prod(kv.buffer_shape) * (1 if kv.fp8 else 2) + scores


def estimate_memory(job: Job, history: list[dict]) -> int:
    """Memory to reserve for one compile: from past compiles of the same graph, else from its size."""
    summary = graph_summary(job.graph)
    past = [m["peak_rss_bytes"] for m in history
            if m.get("peak_rss_bytes") and m.get("graph") == summary and m.get("label") == job.label]
    if past:
        return int(max(past) * HISTORY_MARGIN)
    return BASE_MEMORY + GRAPH_FACTOR * graph_bytes(job)


def build_remote(job: Job, shared: bool, index: dict) -> dict:
    """Runs in a Ray worker: one job, its log text and (object-store mode) the artifact's bytes."""
    import tempfile

    from neffbuild.compiler.cache import Cache
    from neffbuild.compiler.worker import run_job

    with tempfile.TemporaryDirectory(prefix="neffbuild-ray-") as scratch:
        log = os.path.join(scratch, "target.log")
        cache_root = job.cache_root if shared else os.path.join(scratch, "cache")
        local = dataclasses.replace(job, log_path=log, cache_root=cache_root)
        result = run_job(local, None if shared else index.get)
        out = {"result": result, "node": socket.gethostname()}
        with open(log, "rb") as f:
            out["log"] = f.read()[-LOG_LIMIT:].decode(errors="replace")
        if not shared and result["status"] == "ok" and not result["hit"]:
            entry = Cache(local.cache_root).get(result["cache_key"])
            out["artifact_bytes"], out["meta"] = entry.path.read_bytes(), entry.meta
        return out


class RayExecutor:
    name = "ray"

    def __init__(self, *, cache_root: str | Path, address: str | None = None, shared_cache: bool = False,
                 timeout_s: float | None = None, num_cpus: float = 1):
        self.ray = import_ray()
        self.cache_root, self.address, self.shared = Path(cache_root), address, shared_cache
        self.timeout_s, self.num_cpus = timeout_s, num_cpus

    def run(self, jobs: Iterable[Job], on_start: Callable[[Job], None] | None = None) -> Iterator[dict]:
        """Yield one result dict per job, in completion order (LocalExecutor's contract)."""
        started_here = self._connect()
        try:
            yield from _Run(self, list(jobs), on_start).results()
        finally:
            if started_here:
                self.ray.shutdown()

    def _connect(self) -> bool:
        """Join the given cluster (or the one already initialised); else start one on this machine."""
        ray = self.ray
        if ray.is_initialized():
            return False
        kwargs = {"include_dashboard": False, "log_to_driver": False}
        if self.address:  # nodes of a real cluster may not have this checkout: ship the packages
            import kernels
            import neffbuild

            pkgs = [str(Path(m.__file__).parent) for m in (neffbuild, kernels)]
            # The build's C++ compiler choice (CXX, read by inductor) is the driver's, as for local workers.
            env = {k: os.environ[k] for k in ("CXX",) if k in os.environ}
            ray.init(address=self.address, runtime_env={"py_modules": pkgs, **({"env_vars": env} if env else {})},
                     **kwargs)
        else:  # Ray lowers its workers' priority by default; compiles are the build's work, not background work
            ray.init(_system_config={"worker_niceness": 0}, **kwargs)
        return True


class _Run:
    """One build's task bookkeeping: submit, wait, retry, time out, cancel."""

    def __init__(self, ex: RayExecutor, jobs: list[Job], on_start):
        from neffbuild.compiler.cache import Cache

        self.ex, self.ray, self.on_start = ex, ex.ray, on_start
        self.cache = Cache(ex.cache_root).ensure()
        history = self.cache.list()
        self.memory = {j.label: estimate_memory(j, history) for j in jobs}
        index = {} if ex.shared else {m["key"]: {k: m[k] for k in ("sha256", "bytes", "compile_seconds", "ext")}
                                       for m in history}
        self.index_ref = self.ray.put(index)
        self.task = self.ray.remote(build_remote)
        self.pending = list(reversed(jobs))
        self.running: dict = {}  # ref -> (job, submitted at, attempt)
        slots = self.ray.cluster_resources().get("CPU", 1) / ex.num_cpus
        self.capacity = max(1, int(slots))
        # A reservation above every node's memory would wait forever: cap it at the largest node.
        self.largest = max((n["Resources"].get("memory", 0) for n in self.ray.nodes() if n.get("Alive")), default=0)

    def results(self) -> Iterator[dict]:
        try:
            while self.pending or self.running:
                while self.pending and len(self.running) < self.capacity:
                    self._submit(self.pending.pop(), attempt=0)
                ready, _ = self.ray.wait(list(self.running), num_returns=1, timeout=1.0)
                for ref in ready:
                    res = self._collect(ref)
                    if res is not None:
                        yield res
                yield from self._timeouts()
        finally:
            for ref in self.running:  # Ctrl-C or a driver error: stop every compile still running
                self.ray.cancel(ref, force=True)

    def _submit(self, job: Job, attempt: int) -> None:
        mem = self.memory[job.label] * (2 ** attempt)
        mem = int(min(mem, self.largest)) if self.largest else mem
        opts = {"num_cpus": self.ex.num_cpus, "memory": mem, "max_retries": 0}
        ref = self.task.options(**opts).remote(job, self.ex.shared, self.index_ref)
        self.running[ref] = (job, time.monotonic(), attempt)
        if self.on_start and attempt == 0:
            self.on_start(job)

    def _collect(self, ref) -> dict | None:
        """The job's result dict, or None when it was resubmitted."""
        exc_mod = self.ray.exceptions
        job, _, attempt = self.running.pop(ref)
        try:
            out = self.ray.get(ref)
        except (exc_mod.OutOfMemoryError, exc_mod.WorkerCrashedError, exc_mod.NodeDiedError) as exc:
            if attempt == 0:
                more = 2 * self.memory[job.label] / GIB
                _note(job, f"== ray: {type(exc).__name__}; retrying once with {more:.1f} GiB")
                self._submit(job, attempt=1)
                return None
            why = f"the Ray task died twice (last: {type(exc).__name__}: killed or out of memory)"
            return _failure(job, KILLED, why)
        except exc_mod.RayError as exc:  # run_job never raises: this is the cluster, not the compiler
            return _failure(job, ENVIRONMENT, f"Ray task failed: {type(exc).__name__}: {str(exc)[:500]}")
        return self._finish(job, out)

    def _finish(self, job: Job, out: dict) -> dict:
        res = dict(out["result"], log=job.log_path, node=out["node"])
        _note(job, out["log"])
        if res["status"] != "ok" or self.ex.shared:
            return res
        key = res["cache_key"]
        with self.cache.lock(key):
            entry = self.cache.get(key)
            if entry is None and "artifact_bytes" in out:
                tmp = self.cache.new_tmp(key)
                path = tmp / Path(out["meta"]["file"]).name
                path.write_bytes(out["artifact_bytes"])
                meta = {k: v for k, v in out["meta"].items() if k not in ("key", "file", "bytes", "sha256", "created")}
                entry = self.cache.publish(key, tmp, path, meta)
        if entry is None:
            return _failure(job, COMPILER_ERROR, f"cache entry {key} vanished from the driver's cache during the build")
        return dict(res, artifact=str(entry.path))

    def _timeouts(self) -> Iterator[dict]:
        if not self.ex.timeout_s:
            return
        now = time.monotonic()
        for ref, (job, t0, _) in list(self.running.items()):
            if now - t0 > self.ex.timeout_s:
                self.ray.cancel(ref, force=True)
                del self.running[ref]
                yield _failure(job, TIMEOUT, f"compile exceeded {self.ex.timeout_s:.0f}s")


def _note(job: Job, text: str) -> None:
    Path(job.log_path).parent.mkdir(parents=True, exist_ok=True)
    with open(job.log_path, "a") as log:
        log.write(text if text.endswith("\n") else text + "\n")
