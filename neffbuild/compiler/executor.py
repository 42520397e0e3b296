"""Executors: run jobs on a pool of long-lived worker processes.

``LocalExecutor`` keeps ``jobs`` spawned workers warm for the whole build and never has
more jobs in flight than workers, so "submitted" means "running" and a per-target timeout
is exact. It starts no more compiles at once than the host's free memory holds
(compiler/memory_plan.py: the estimates of the running ones plus the next; always at least
one), says so in ``memory_note``, and never kills a compile for memory. A worker that dies
(OOM killer, signal) breaks the pool: its in-flight jobs are reported as ``killed_or_oom``
and the pool is rebuilt for the rest. Ctrl-C kills the workers and re-raises, so the caller
can clean up. ``RayExecutor`` (ray_executor.py) runs the same jobs on a Ray cluster behind
the same ``run`` interface; ``make_executor`` picks one."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool

from neffbuild.compiler import memory_plan
from neffbuild.compiler.jobs import KILLED, TIMEOUT, Job, JobResult, failure
from neffbuild.compiler.ray_executor import RayExecutor
from neffbuild.compiler.worker import run_job, warm_up


class LocalExecutor:
    name = "local"

    def __init__(self, jobs: int, *, timeout_s: float | None = None, keep_warm: bool = False):
        self.jobs = max(1, int(jobs))
        self.timeout_s = timeout_s
        self.keep_warm = keep_warm  # keep the workers between runs (several builds in one process); close() ends them
        self.pool: ProcessPoolExecutor | None = None
        self.workers = self.jobs
        self.admission = None  # memory_plan.Admission of the last run
        self.memory_note: str | None = None  # set when host memory held the pool below ``jobs``

    def _start(self) -> None:
        self.pool = ProcessPoolExecutor(max_workers=self.workers, mp_context=multiprocessing.get_context("spawn"))
        for f in [self.pool.submit(warm_up) for _ in range(self.workers)]:
            f.result()

    def _kill(self) -> None:
        if self.pool is None:
            return
        procs = list(getattr(self.pool, "_processes", {}).values())
        for p in procs:
            with contextlib.suppress(ProcessLookupError, AttributeError):
                os.kill(p.pid, signal.SIGKILL)
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.pool = None

    def run(self, jobs: Iterable[Job], on_start: Callable[[Job], None] | None = None) -> Iterator[JobResult]:
        """Yield one result per job, in completion order."""
        pending = list(jobs)
        pending.reverse()  # pop() takes them in the given order
        gate = self.admission = memory_plan.admission_for(pending, self.jobs)
        # A pool for one run starts no more workers than it has jobs (each pays a torch + inductor import); a kept
        # pool is sized for the builds to come.
        self.workers = gate.workers() if self.keep_warm else max(1, min(gate.workers(), len(pending)))
        running: dict = {}
        done_ok = False
        try:
            if self.pool is None:
                self._start()
            while pending or running:
                while pending and len(running) < self.workers and gate.may_start(pending[-1].label):
                    job = pending.pop()
                    gate.started(job.label)
                    running[self.pool.submit(run_job, job)] = (job, time.monotonic())
                    if on_start:
                        on_start(job)
                done, _ = wait(list(running), timeout=1.0, return_when=FIRST_COMPLETED)
                broken = False
                for fut in done:
                    job, _t0 = running.pop(fut)
                    gate.finished(job.label)
                    try:
                        yield fut.result()
                    except BrokenProcessPool:
                        broken = True
                        yield failure(job, KILLED, "the worker process died (killed by a signal or out of memory)")
                timed_out = [f for f, (_, t0) in running.items()
                             if self.timeout_s and time.monotonic() - t0 > self.timeout_s]
                if broken or timed_out:
                    for fut in timed_out:
                        job, _ = running.pop(fut)
                        gate.finished(job.label)
                        yield failure(job, TIMEOUT, f"compile exceeded {self.timeout_s:.0f}s")
                    # Jobs caught in the same pool restart are retried on the new pool.
                    pending.extend(job for job, _ in running.values())
                    for job, _ in running.values():
                        gate.finished(job.label)
                    running.clear()
                    self._kill()
                    self._start()
            done_ok = True
            if not self.keep_warm:
                self.pool.shutdown(wait=True)
                self.pool = None
        finally:
            self.memory_note = gate.note()
            if not (done_ok and self.keep_warm):
                self._kill()

    def close(self) -> None:
        """End the workers (a ``keep_warm`` executor keeps them until then)."""
        self._kill()


class InlineExecutor:
    """Runs every job in the calling process, one after another (debugging, tests that patch a backend)."""

    jobs = 1
    name = "inline"

    def run(self, jobs: Iterable[Job], on_start: Callable[[Job], None] | None = None) -> Iterator[JobResult]:
        for job in jobs:
            if on_start:
                on_start(job)
            yield run_job(job)


EXECUTORS = ("local", "ray")


def make_executor(name: str, *, jobs: int, cache_root, timeout_s: float | None = None, address: str | None = None,
                  shared_cache: bool = False):
    """The executor called ``name``: the local pool of ``jobs`` workers, or Ray."""
    if name == "ray":  # Ray itself is imported when a RayExecutor is made (an optional extra)
        return RayExecutor(cache_root=cache_root, address=address, shared_cache=shared_cache, timeout_s=timeout_s)
    if name != "local":
        raise ValueError(f"unknown executor {name!r}")
    return LocalExecutor(jobs, timeout_s=timeout_s)
