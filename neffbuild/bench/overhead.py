"""Per-step and start-up overheads around the compiled step.

cold start   a fresh process: open the bundle, load one artifact, run one step; against a
             fresh process that exports and compiles the same graph (what a server that
             compiles at start-up pays before its first step).
plan+meta    ``plan_for`` + ``attn_metadata.build`` for the bench request, per step.
dp sync      ``dp_sync.sync_step`` over 2 gloo ranks on this host vs a bare gloo all-reduce
             of the same tensor: what the runtime adds to the one collective.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time

import torch

from neffbuild.ports import free_port

_COLD = """
import json, sys, time, torch
t0 = time.perf_counter()
from neffbuild.runtime.bundle.reader import open_bundle
from neffbuild.bench.steps import make_case
from neffbuild.runtime.kv.cache import allocate
t1 = time.perf_counter()
b = open_bundle(sys.argv[1])
case = make_case(b, int(sys.argv[2]), min(b.grid.num_seqs_buckets))
t2 = time.perf_counter()
fn = b.artifact(case.plan.label)  # imports torch's AOTInductor loader, dlopens the artifact, binds the weights
t3 = time.perf_counter()
out = fn(*case.inputs["bucketed"].as_args(allocate(b.kv_layout)))
t4 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "open_s": t2 - t1, "load_s": t3 - t2, "first_step_s": t4 - t3,
                  "open_and_first_step_s": t4 - t1}))
"""

_COMPILE = """
import json, sys, tempfile, time, torch
from pathlib import Path
from neffbuild.runtime.bundle.reader import open_bundle
from neffbuild.bench.steps import compile_graph, make_case
from neffbuild.runtime.kv.cache import allocate
b = open_bundle(sys.argv[1])
case = make_case(b, int(sys.argv[2]), min(b.grid.num_seqs_buckets))
t0 = time.perf_counter()
with tempfile.TemporaryDirectory() as tmp:
    s, fn = compile_graph(b, batch=case.plan.batch, ctx=case.plan.ctx, dynamic=False, workdir=Path(tmp))
    fn(*case.inputs["bucketed"].as_args(allocate(b.kv_layout)))
print(json.dumps({"compile_s": s, "compile_and_first_step_s": time.perf_counter() - t0}))
"""


def _probe(code: str, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([p for p in sys.path if p]))
    res = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, check=False)
    if res.returncode:
        raise RuntimeError(f"probe failed: {res.stderr[-2000:]}")
    return {k: round(v, 3) for k, v in json.loads(res.stdout.strip().splitlines()[-1]).items()}


def cold_start(bundle_path: str, context: int, *, compile_too: bool = True) -> dict:
    out = {"cold": _probe(_COLD, bundle_path, str(context))}
    if compile_too:
        out["compile_at_startup"] = _probe(_COMPILE, bundle_path, str(context))
    return out


def plan_and_metadata(bundle, context: int, repeat: int = 2000) -> dict:
    bs, mml = bundle.kv_layout.block_size, bundle.grid.max_model_len
    row = torch.arange(1, 1 + mml // bs)[None]
    computed, tokens = torch.tensor([context - 1]), torch.tensor([[1]])
    from neffbuild.runtime.step import attn_metadata
    from neffbuild.runtime.step.dispatch import plan_for

    def once():
        plan = plan_for(bundle.grid, batch_count=1, needed=context, num_reqs=1)
        attn_metadata.build(tokens, computed, row, row, batch=plan.batch, ctx=plan.ctx, block_size=bs,
                            num_swa=bundle.num_swa)

    return {"plan_plus_metadata_us": round(median_seconds(once, repeat) * 1e6, 2)}


def timed_seconds(fn, repeat: int, warmup: int = 20) -> list[float]:
    """Wall time of each of ``repeat`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return samples


def median_seconds(fn, repeat: int, warmup: int = 20) -> float:
    return statistics.median(timed_seconds(fn, repeat, warmup))


def _dp_rank(rank: int, port: int, repeat: int, queue) -> None:
    import torch.distributed as dist

    from neffbuild.runtime.step import dp_sync

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t = torch.tensor([4, 500], dtype=torch.int32)
    synced = median_seconds(lambda: dp_sync.sync_step(1, 500 + rank)[0], repeat)
    bare = median_seconds(lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX), repeat)
    if rank == 0:
        queue.put({"dp_sync_us": round(synced * 1e6, 1), "bare_allreduce_us": round(bare * 1e6, 1)})
    dist.destroy_process_group()


def dp_sync_cost(repeat: int = 500) -> dict:
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_dp_rank, args=(r, port, repeat, queue)) for r in range(2)]
    for p in procs:
        p.start()
    result = queue.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    return result
