"""How neffbuild's own engine starts its rank processes (the world's tp x dp ranks, the DI prefill group).

Forked from multiprocessing's fork server, which imported PRELOAD once: a spawned rank paid about 1.7
CPU-seconds importing torch and the serving code before its first line, per rank and per start (a process
that starts worlds again and again, a test session or a supervisor, paid it every time). The fork server is
a clean process (no threads, no gloo group, no OpenMP pool of the caller's), started at the first use in a
process and kept for its life, so it holds the environment of that first use: each rank adopts the caller's
environment of its own start (``adopt_environment``), as a spawned rank had it.
"""

from __future__ import annotations

import multiprocessing
import os

PRELOAD = ["torch", "torch.distributed", "neffbuild.serve.run"]
START_METHOD = "forkserver"


def context(preload: list[str] = PRELOAD):
    """multiprocessing's fork-server context, its server to preload ``preload`` (effective before the server's first
    start in this process: one server a process, so the first caller's list is the one it keeps)."""
    ctx = multiprocessing.get_context(START_METHOD)
    ctx.set_forkserver_preload(preload)
    return ctx


def caller_environment() -> dict[str, str]:
    """What a rank is handed at its start (``adopt_environment``'s argument)."""
    return dict(os.environ)


def adopt_environment(env: dict[str, str]) -> None:
    """In a rank, first: the caller's environment, and torch's thread count from its OMP_NUM_THREADS as a fresh
    import would have it (OpenMP read the variable when the fork server imported torch)."""
    import torch

    os.environ.clear()
    os.environ.update(env)
    threads = env.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else len(os.sched_getaffinity(0)))
