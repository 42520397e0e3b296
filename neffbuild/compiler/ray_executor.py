"""RayExecutor: the same jobs as LocalExecutor, run as Ray tasks on a cluster.

Each target is one task with ``num_cpus`` and a ``memory`` reservation estimated from the
target (compiler/memory_plan.py: its weights and KV pool, or 1.25x the peak memory a past
compile of the same graph recorded in the cache), so Ray packs compiles by memory, not by a fixed count. Ray reuses
its worker processes, so torch and the compiler stay imported between targets (warm).

Artifacts come back one of two ways:
- object store (default): the task compiles in a scratch folder on its node and returns
  the artifact's bytes; the driver publishes them into its own cache under the same key.
  Tasks get the driver's cache index (key -> meta), so a target the driver already has
  is a hit without compiling or moving bytes;
- ``shared_cache=True``: every node mounts the cache folder at the same path, tasks use it
  directly (flock per key, atomic publish) and return only metadata.

Either way the driver receives the same ``JobResult``s as from LocalExecutor, appends each
task's log to the bundle's log file, adds ``node`` (where it was built) and publishes through
the one ``jobs.publish`` (entry and pre-key), so a warm Ray rebuild traces nothing. A task killed
for memory (or lost with its node) is retried once with twice the memory; a second loss
is ``killed_or_oom``. The per-target timeout is counted from submission; at most as many
tasks as the cluster has CPU slots are in flight, so submitted is (nearly) running.
Ctrl-C (or any error in the driver) cancels every task before it propagates.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import neffbuild
from neffbuild.compiler import memory_plan
from neffbuild.compiler.cache import Cache
from neffbuild.compiler.jobs import COMPILER_ERROR, ENVIRONMENT, KILLED, TIMEOUT, Job, JobResult, failure, publish
from neffbuild.compiler.memory_plan import BASE_MEMORY, GIB  # noqa: F401  (re-exported)
from neffbuild.compiler.worker import run_job
from neffbuild.errors import InvalidInput, NeffbuildError

LOG_LIMIT = 8 << 20  # bytes of a task's log shipped back


def import_ray():
    try:
        import ray
    except ImportError as exc:
        raise NeffbuildError(f"--executor ray needs Ray, which is not installed here ({exc}); "
                             "install the extra: pip install 'neffbuild[ray]'") from None
    return ray


def graph_bytes(job: Job) -> int:
    """Bytes the traced graph holds (compiler/memory_plan.py)."""
    return memory_plan.graph_bytes(job.graph)


def estimate_memory(job: Job, history: list[dict]) -> int:
    """Memory to reserve for one compile: from past compiles of the same graph, else from its size."""
    return memory_plan.estimate_rss(job.graph, job.label, history)[0]


def build_remote(job: Job, shared: bool, index: dict) -> dict:
    """Runs in a Ray worker: one job, its log text and (object-store mode) the artifact's bytes."""
    with tempfile.TemporaryDirectory(prefix="neffbuild-ray-") as scratch:
        log = os.path.join(scratch, "target.log")
        cache_root = job.cache_root if shared else os.path.join(scratch, "cache")
        local = dataclasses.replace(job, log_path=log, cache_root=cache_root)
        result = run_job(local, None if shared else index.get, own_process=True)
        out = {"result": result, "node": socket.gethostname()}
        with open(log, "rb") as f:
            out["log"] = f.read()[-LOG_LIMIT:].decode(errors="replace")
        if not shared and result.ok and not result.hit:
            entry = Cache(local.cache_root).get(result.cache_key)
            out["artifact_bytes"], out["meta"] = entry.path.read_bytes(), entry.meta
        return out


class RayExecutor:
    name = "ray"

    def __init__(self, *, cache_root: str | Path, address: str | None = None, shared_cache: bool = False,
                 timeout_s: float | None = None, num_cpus: float = 1):
        why = address_problem(address)  # now: a build whose targets are all cached would never connect
        if why:
            raise InvalidInput(why)
        self.ray = import_ray()
        self.cache_root, self.address, self.shared = Path(cache_root), address, shared_cache
        self.timeout_s, self.num_cpus = timeout_s, num_cpus

    def run(self, jobs: Iterable[Job], on_start: Callable[[Job], None] | None = None) -> Iterator[JobResult]:
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
            pkgs = [str(Path(neffbuild.__file__).parent)]  # everything the build imports lives under it
            # The build's C++ compiler choice (CXX, read by inductor) is the driver's, as for local workers.
            env = {k: os.environ[k] for k in ("CXX",) if k in os.environ}
            ray.init(address=self.address, runtime_env={"py_modules": pkgs, **({"env_vars": env} if env else {})},
                     **kwargs)
        else:  # Ray lowers its workers' priority by default; compiles are the build's work, not background work
            ray.init(_system_config={"worker_niceness": 0}, **kwargs)
        return True


def address_problem(address: str | None, timeout_s: float = 5.0) -> str | None:
    """Why ``--address`` names no reachable cluster (a TCP connect to its host and port), or None."""
    if not address or address == "auto":
        return None
    hostport = address.removeprefix("ray://")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return f"--address {address!r}: expected auto, HOST:PORT or ray://HOST:PORT"
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        return f"--address {address}: no Ray cluster answers there ({exc.strerror or type(exc).__name__})"
    return None


class _Run:
    """One build's task bookkeeping: submit, wait, retry, time out, cancel."""

    def __init__(self, ex: RayExecutor, jobs: list[Job], on_start):
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

    def results(self) -> Iterator[JobResult]:
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

    def _collect(self, ref) -> JobResult | None:
        """The job's result, or None when it was resubmitted."""
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
            return failure(job, KILLED, why)
        except exc_mod.RayError as exc:  # run_job never raises: this is the cluster, not the compiler
            return failure(job, ENVIRONMENT, f"Ray task failed: {type(exc).__name__}: {str(exc)[:500]}")
        return self._finish(job, out)

    def _finish(self, job: Job, out: dict) -> JobResult:
        """The task's result in the driver's terms: its log appended here, its artifact (bytes shipped
        back, or the driver's own entry on a driver hit) published with its pre-key (compiler/jobs.py)."""
        res = out["result"].replace(log=job.log_path, node=out["node"])
        _note(job, out["log"])
        if not res.ok or self.ex.shared:
            return res  # shared cache: the task published the entry and its pre-key itself

        def produce(tmp: Path):
            path = tmp / Path(out["meta"]["file"]).name
            path.write_bytes(out["artifact_bytes"])
            drop = ("key", "file", "bytes", "sha256", "created")  # the cache writes these itself
            return path, {k: v for k, v in out["meta"].items() if k not in drop}

        entry = publish(self.cache, res.cache_key, res.pre_key, produce if "artifact_bytes" in out else None)
        if entry is None:
            return failure(job, COMPILER_ERROR,
                           f"cache entry {res.cache_key} vanished from the driver's cache during the build")
        return res.replace(artifact=str(entry.path))

    def _timeouts(self) -> Iterator[JobResult]:
        if not self.ex.timeout_s:
            return
        now = time.monotonic()
        for ref, (job, t0, _) in list(self.running.items()):
            if now - t0 > self.ex.timeout_s:
                self.ray.cancel(ref, force=True)
                del self.running[ref]
                yield failure(job, TIMEOUT, f"compile exceeded {self.ex.timeout_s:.0f}s")


def _note(job: Job, text: str) -> None:
    Path(job.log_path).parent.mkdir(parents=True, exist_ok=True)
    with open(job.log_path, "a") as log:
        log.write(text if text.endswith("\n") else text + "\n")
