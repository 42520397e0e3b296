"""Run a function in N gloo processes (real torch.distributed, no mocks) and collect results."""

from __future__ import annotations

import os
import pickle
import tempfile
from pathlib import Path

from neffbuild.serve import procs


def _entry(rank: int, world: int, init_file: str, out_dir: str, fn, args) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"{rank}.pkl").write_bytes(pickle.dumps(result))


# What every rank imports, loaded once by the test process's fork server: a spawned rank paid about 1.7 CPU-seconds
# importing torch and the test module before its first line, and the suite starts a few hundred ranks.
PRELOAD = [*procs.PRELOAD, "tests.dist_util"]  # the product's own ranks' list (neffbuild/serve/procs.py), and this


def forkserver():
    """The product's fork-server context (neffbuild/serve/procs.py) preloading PRELOAD, for the tests that start
    their own rank processes: ``torch.multiprocessing.start_processes(..., start_method=procs.START_METHOD)`` or
    this context's Process. One fork server a process: whichever of this and the product's rank starts comes
    first sets its preload."""
    return procs.context(PRELOAD)


def run_ranks(fn, world: int, *args) -> list:
    """fn(rank, world, *args) in ``world`` fresh processes; their return values, by rank.

    Forked from multiprocessing's fork server (a clean process, not this one: no threads, no gloo, no OpenMP
    pool inherited), which imported PRELOAD once. A rank sees the environment the fork server started with:
    the tests that use this set nothing in the environment for their ranks (arguments carry everything)."""
    import torch.multiprocessing as mp

    forkserver()
    with tempfile.TemporaryDirectory(prefix="neffbuild-ranks-") as tmp:
        mp.start_processes(_entry, args=(world, os.path.join(tmp, "rdv"), tmp, fn, args), nprocs=world, join=True,
                           start_method=procs.START_METHOD)
        return [pickle.loads(Path(tmp, f"{r}.pkl").read_bytes()) for r in range(world)]
