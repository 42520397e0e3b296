"""Run a function in N gloo processes (real torch.distributed, no mocks) and collect results."""

from __future__ import annotations

import os
import pickle
import tempfile
from pathlib import Path


def _entry(rank: int, world: int, init_file: str, out_dir: str, fn, args) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"{rank}.pkl").write_bytes(pickle.dumps(result))


def run_ranks(fn, world: int, *args) -> list:
    """fn(rank, world, *args) in ``world`` spawned processes; their return values, by rank."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="neffbuild-ranks-") as tmp:
        mp.spawn(_entry, args=(world, os.path.join(tmp, "rdv"), tmp, fn, args), nprocs=world, join=True)
        return [pickle.loads(Path(tmp, f"{r}.pkl").read_bytes()) for r in range(world)]
