"""Executors: run jobs on a pool of long-lived worker processes.

``LocalExecutor`` keeps ``jobs`` spawned workers warm for the whole build and never has
more jobs in flight than workers, so "submitted" means "running" and a per-target timeout
is exact. A worker that dies (OOM killer, signal) breaks the pool: its in-flight jobs are
reported as ``killed_or_oom`` and the pool is rebuilt for the rest. Ctrl-C kills the
workers and re-raises, so the caller can clean up. ``RayExecutor`` (ray_executor.py) runs
the same jobs on a Ray cluster behind the same ``run`` interface; ``make_executor`` picks one.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool

from neffbuild.compiler.worker import KILLED, TIMEOUT, Job, run_job, warm_up


class LocalExecutor:
    name = "local"

    def __init__(self, jobs: int, *, timeout_s: float | None = None, keep_warm: bool = False):
        self.jobs = max(1, int(jobs))
        self.timeout_s = timeout_s
        self.keep_warm = keep_warm  # keep the workers between runs (several builds in one process); close() ends them
        self.pool: ProcessPoolExecutor | None = None

    def _start(self) -> None:
        self.pool = ProcessPoolExecutor(max_workers=self.jobs, mp_context=multiprocessing.get_context("spawn"))
        for f in [self.pool.submit(warm_up) for _ in range(self.jobs)]:
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

    def run(self, jobs: Iterable[Job], on_start: Callable[[Job], None] | None = None) -> Iterator[dict]:
        """Yield one result dict per job, in completion order."""
        pending = list(jobs)
        pending.reverse()  # pop() takes them in the given order
        running: dict = {}
        done_ok = False
        try:
            if self.pool is None:
                self._start()
            while pending or running:
                while pending and len(running) < self.jobs:
                    job = pending.pop()
                    running[self.pool.submit(run_job, job)] = (job, time.monotonic())
                    if on_start:
                        on_start(job)
                done, _ = wait(list(running), timeout=1.0, return_when=FIRST_COMPLETED)
                broken = False
                for fut in done:
                    job, _t0 = running.pop(fut)
                    try:
                        yield fut.result()
                    except BrokenProcessPool:
                        broken = True
                        yield _failure(job, KILLED, "the worker process died (killed by a signal or out of memory)")
                timed_out = [f for f, (_, t0) in running.items()
                             if self.timeout_s and time.monotonic() - t0 > self.timeout_s]
                if broken or timed_out:
                    for fut in timed_out:
                        job, _ = running.pop(fut)
                        yield _failure(job, TIMEOUT, f"compile exceeded {self.timeout_s:.0f}s")
                    # Jobs caught in the same pool restart are retried on the new pool.
                    pending.extend(job for job, _ in running.values())
                    running.clear()
                    self._kill()
                    self._start()
            done_ok = True
            if not self.keep_warm:
                self.pool.shutdown(wait=True)
                self.pool = None
        finally:
            if not (done_ok and self.keep_warm):
                self._kill()

    def close(self) -> None:
        """End the workers (a ``keep_warm`` executor keeps them until then)."""
        self._kill()


class InlineExecutor:
    """Runs every job in the calling process, one after another (debugging, tests that patch a backend)."""

    jobs = 1
    name = "inline"

    def run(self, jobs: Iterable[Job], on_start: Callable[[Job], None] | None = None) -> Iterator[dict]:
        for job in jobs:
            if on_start:
                on_start(job)
            yield run_job(job)


EXECUTORS = ("local", "ray")


def make_executor(name: str, *, jobs: int, cache_root, timeout_s: float | None = None, address: str | None = None,
                  shared_cache: bool = False):
    """The executor called ``name``: the local pool of ``jobs`` workers, or Ray."""
    if name == "ray":
        from neffbuild.compiler.ray_executor import RayExecutor

        return RayExecutor(cache_root=cache_root, address=address, shared_cache=shared_cache, timeout_s=timeout_s)
    if name != "local":
        raise ValueError(f"unknown executor {name!r}")
    return LocalExecutor(jobs, timeout_s=timeout_s)


def _failure(job: Job, kind: str, message: str) -> dict:
    try:
        with open(job.log_path, "a") as log:
            log.write(f"\n== {kind}: {message}\n")
    except OSError:
        pass
    return {"label": job.label, "status": "failed", "kind": kind, "error": message, "hit": False, "log": job.log_path}
