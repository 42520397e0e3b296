"""Collective time per decode step vs the step time, for a sharded bundle, on this machine.

    .venv/bin/python benchmarks/collectives.py BUNDLE [--steps 30]

Starts the bundle's tp x dp ranks as gloo processes. Each rank runs its compiled artifact
for every label at the bucket's last position, under the CPU profiler: the in-graph
collectives' time (``gloo:*`` events run from enqueue to completion, so they include
waiting for the slower rank; ``c10d::*`` is the calling thread's share) against the wall
time of the same steps. ``replay_ms``: the same collectives (count, shapes, groups)
replayed eagerly, without the graph. Best of 3 rounds of ``--steps`` steps each (the
machine is shared). Prints one JSON line per (rank, label).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import machine

COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "wait_tensor", "allreduce", "allgather")


def step_inputs(bundle, entry):
    """A full decode step at the label's shape: every row at the bucket's last position."""
    from neffbuild.runtime.step import attn_metadata
    from neffbuild.runtime.step.buckets import table_width

    B, ctx, bs = entry["batch"], entry["ctx"], bundle.kv_layout.block_size
    width = table_width(bundle.grid.max_model_len, bs)
    rows = torch.stack([torch.arange(1, width + 1) + r * width for r in range(B)]) % bundle.kv_layout.num_blocks
    rows = rows.clamp(min=1)
    return attn_metadata.build(torch.ones(B, 1, dtype=torch.long), torch.full((B,), ctx - 1), rows, rows.clone(),
                               batch=B, ctx=ctx, block_size=bs, num_swa=bundle.num_swa)


def replay(bundle, entry, steps: int) -> float:
    """Seconds per step of the step's collectives alone, replayed eagerly at the same shapes and groups."""
    import torch.distributed as dist

    from neffbuild.kernels.collectives import all_gather_rows, all_reduce_sum, reduce_scatter_rows
    from neffbuild.runtime.parallel import EP_GROUP, TP_GROUP

    par, B = bundle.parallel, entry["batch"] * entry["query_len"]
    H, L = bundle.weights["embed"].shape[1], bundle.weights["ln_attn"].shape[0]
    x = torch.ones(B, H)

    def one_step():
        for _ in range(L):
            if par.tp > 1:
                all_reduce_sum(x, TP_GROUP)
            if par.ep > 1 and par.ep_gathers:
                reduce_scatter_rows(all_gather_rows(x, par.ep, EP_GROUP), par.ep, EP_GROUP)
            elif par.ep > 1:
                all_reduce_sum(x, EP_GROUP)

    for _ in range(3):
        one_step()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        one_step()
    return (time.perf_counter() - t0) / steps


ROUNDS = 3


def profiled(art, args, steps: int) -> tuple[float, dict]:
    """(seconds per step, {collective op: (calls, total ms, self ms) per step}) over ``steps`` steps."""
    import torch.distributed as dist

    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            art(*args)
        wall = (time.perf_counter() - t0) / steps
    ops = {e.key: (e.count // steps, round(e.cpu_time_total / 1e3 / steps, 3),
                   round(e.self_cpu_time_total / 1e3 / steps, 3))
           for e in prof.key_averages() if any(op in e.key for op in COLLECTIVE_OPS)}
    return wall, ops


def measure(rank: int, bundle_path: str, steps: int) -> list[dict]:

    from neffbuild.runtime.bundle.reader import open_bundle
    from neffbuild.runtime.kv.cache import allocate

    bundle = open_bundle(bundle_path)
    kv = allocate(bundle.kv_layout)
    out = []
    for label in bundle.labels:
        entry = bundle.entries[label]
        args = step_inputs(bundle, entry).as_args(kv)  # the bundle binds the rank id
        art = bundle.artifact(label)
        for _ in range(3):
            art(*args)
        wall, ops = min(profiled(art, args, steps) for _ in range(ROUNDS))  # the least disturbed round
        out.append({"rank": rank, "label": label, "step_ms": round(wall * 1e3, 3), "ops(count,total_ms,self_ms)": ops,
                    "replay_ms": round(min(replay(bundle, entry, steps) for _ in range(ROUNDS)) * 1e3, 3)})
    return out


def _worker(rank, world, init, bundle_path, steps, out_dir):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        res = measure(rank, bundle_path, steps)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"{rank}.json").write_text(json.dumps(res))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    import torch.multiprocessing as mp

    from neffbuild.runtime.bundle.reader import read_manifest

    world = read_manifest(Path(a.bundle))["parallel"]["world_size"]
    print(f"# {machine()}; {world} gloo ranks, 1 thread each", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, os.path.join(tmp, "rdv"), a.bundle, a.steps, tmp), nprocs=world, join=True)
        for r in range(world):
            for row in json.loads(Path(tmp, f"{r}.json").read_text()):
                print(json.dumps(row))


if __name__ == "__main__":
    main()
