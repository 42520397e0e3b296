"""The serving engine's own cost per step, and continuous batching vs a static batch.

    PYTHONPATH=. .venv/bin/python benchmarks/engine.py BUNDLE [--repeat 3]

BUNDLE: an unsharded bundle (e.g. the tests' recipe, recipes/gpt-oss-tiny.yaml with
num_seqs_buckets [1, 4] and context buckets [128, 256]). In this process, artifacts
preloaded, two workloads of the same 12 prompts and per-request ``max_new_tokens``:

* ``requests``: staggered arrivals (every 3 steps a request), as ``generate --requests``;
* ``static``: every prompt at step 0, as ``generate --prompt-ids`` (the batch fills to the
  largest bucket, the rest queue and join as others leave).

Per run: tokens/s (steps after the first, see serve/result.py), the step time, and the
engine's own work (admission, scheduling, block tables, acceptance: ``EngineStats.engine_seconds``)
as a fraction of the decode time, split into ``scheduling`` (admission, scheduling, tables, finish)
and ``accept`` (the greedy argmax and acceptance: ``EngineStats.accept_seconds``); ``check_*``: the
Stepper's input check (runtime/step/checks.py) timed where the loop calls it, per step. Runs
alternate; medians over ``--repeat``. Each run is a fresh engine (a server's first 120 steps).
``--cold-cache-demo`` also prints what one block-manager call costs after the CPU touched N MB;
``--ahead 0`` runs the engine without look-ahead (what a pool at the recipe's formula minimum gets).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import machine

from neffbuild.runtime.bundle.reader import open_bundle
from neffbuild.serve.engine import Engine
from neffbuild.serve.parts import LocalPrefill, Request
from neffbuild.serve.rank import open_rank

LENGTHS = [(20, 40), (150, 30), (8, 60), (60, 20), (200, 50), (5, 45), (90, 25), (33, 35), (12, 55), (120, 40),
           (44, 15), (70, 30)]  # (prompt tokens, max_new_tokens)


def workload(stagger: int) -> list[Request]:
    return [Request(str(k), [(7 * i + 3 * n) % 250 + 1 for i in range(n)], new, k * stagger, index=k)
            for k, (n, new) in enumerate(LENGTHS)]


def run(session, reqs, ahead: int | None = None) -> dict:
    engine = Engine(session.stepper, session.block_manager(), LocalPrefill(session.prefill, session.stepper.kv_caches),
                    ahead=ahead)
    with _timed_checks() as checks:
        engine.run(reqs)
    st = engine.stats
    secs, later_s, later = sum(st.step_seconds), sum(st.step_seconds[1:]), sum(st.step_tokens[1:])
    return {"steps": len(st.step_seconds), "tokens_per_second": later / later_s,
            "step_us": secs / len(st.step_seconds) * 1e6, "engine_fraction": st.engine_seconds / secs,
            "engine_us_per_step": st.engine_seconds / len(st.step_seconds) * 1e6,
            "scheduling_fraction": (st.engine_seconds - st.accept_seconds) / secs,
            "scheduling_us_per_step": (st.engine_seconds - st.accept_seconds) / len(st.step_seconds) * 1e6,
            "accept_us_per_step": st.accept_seconds / len(st.step_seconds) * 1e6,
            "run_fraction": st.run_seconds / secs, "plan_fraction": st.plan_seconds / secs,
            "check_us_per_step": checks[0] / len(st.step_seconds) * 1e6, "check_fraction": checks[0] / secs,
            "ahead": engine.scheduler.ahead}


@contextlib.contextmanager
def _timed_checks():
    """Time the Stepper's input check (runtime/step_checks: ``step_ok``, and ``step_problem`` where that says
    no) where the engine's loop calls it: yields [seconds]; the wrappers' own calls are outside the timed span."""
    from neffbuild.runtime.step import checks as step_checks

    real, total = (step_checks.step_ok, step_checks.step_problem), [0.0]

    def timer(fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            total[0] += time.perf_counter() - t0
            return out
        return timed

    step_checks.step_ok, step_checks.step_problem = map(timer, real)
    try:
        yield total
    finally:
        step_checks.step_ok, step_checks.step_problem = real


def cold_cache_demo() -> dict:
    """us per no-op BlockManager.reserve and per argmax of [4, 1, 256] logits, with N MB read in between
    (what the artifact does to the caches between two engine phases)."""
    import torch

    from neffbuild.runtime.kv.blocks import BlockManager, kv_groups

    mgr = BlockManager(509, 16, kv_groups(128))
    mgr.reserve("a", 100, 100)
    logits = torch.randn(4, 1, 256)
    out = {}
    for mb in (0, 4, 16, 64):
        big = torch.randn(max(1, mb * 2**20 // 4))
        tr = ta = 0.0
        for _ in range(200):
            big.sum()
            t0 = time.perf_counter()
            mgr.reserve("a", 101, 100)
            t1 = time.perf_counter()
            big.sum()
            t2 = time.perf_counter()
            logits.argmax(-1).tolist()
            ta += time.perf_counter() - t2
            tr += t1 - t0
        out[f"{mb}MB"] = {"reserve_us": round(tr / 200 * 1e6, 2), "argmax_tolist_us": round(ta / 200 * 1e6, 2)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cold-cache-demo", action="store_true", help="also time one call after N MB were read")
    ap.add_argument("--ahead", type=int, default=None,
                    help="the engine's look-ahead in tokens (default: what the pool spares, Scheduler.ahead; 0: a pool "
                         "at the recipe's formula minimum, where a request's tables change at every block boundary)")
    args = ap.parse_args()
    session = open_rank(open_bundle(args.bundle, preload=True))
    run(session, workload(0), args.ahead)  # warm-up: first calls of every artifact
    rows = {"requests": [], "static": []}
    for _ in range(args.repeat):
        rows["requests"].append(run(session, workload(3), args.ahead))
        rows["static"].append(run(session, workload(0), args.ahead))
    out = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in rows.items()}
    if args.cold_cache_demo:
        out["cold_cache_demo"] = cold_cache_demo()
    out["machine"] = machine()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
