"""Sharded bundles inside vLLM: the DP synchronisation's cost per step, and decode tokens/s at tp 2 and at dp 2 /
ep 2, the plugin against vLLM native, batch 1 and 4 per DP rank.

    .venv/bin/python benchmarks/vllm_parallel.py --checkpoint CKPT --tp2 TP2_BUNDLE --dp2 DP2_BUNDLE \
        [--new 200] [--rounds 3]

Needs the vLLM venv (tools/vllm_venv.sh) and bundles of tests/test_vllm_parallel.py's recipes (the vLLM tests'
model; batch bucket 4, context bucket 128, fallback 512). The numbers:

- ``sync_floor_us``: the runtime's DP all-reduce alone (``dp_sync.sync_step``, 5 int32, MAX) between 2 gloo
  processes, median of 2,000 (and ``lockstep_floor_us``: the lockstep count all-reduce, nobody prefilling);
- ``dp2_plan_us`` / ``dp2_lockstep_us``: the same inside ``vllm serve`` of the dp 2 / ep 2 bundle (six requests,
  then one alone), per step, from DP rank 0's plugin report: ``Stepper.plan`` (the all-reduce, waiting for the
  slower rank included) and ``Stepper.lockstep``, against the whole decode forward;
- ``tp2_tokens_per_s`` / ``dp2_tokens_per_s``: ``vllm serve`` of the bundle with its printed line against vLLM
  native on the checkpoint with the same parallel settings (at dp 2 / ep 2 with the test oracle's fill-ins: the two
  DP collectives vLLM 0.32's CPU communicator lacks, the expert map its CPU experts ignore:
  tests/vllm_scripts/dp_ep_collectives.py), both servers up
  at once; per round and batch, 1 or 4 requests per DP rank (100-token prompts, ``--new`` tokens each, greedy,
  request i to DP rank i % dp) sent at once to one server, then the other, who goes first alternating by round;
  new tokens over the seconds to the last one, prefill included; the median of ``--rounds``. Both sides' tokens
  must be identical in every round.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import machine  # noqa: E402

BATCHES = (1, 4)  # requests per DP rank (the bundles' batch bucket is 4)


def _floor(rank: int, world: int, repeat: int) -> dict:
    from neffbuild.runtime.step import dp_sync

    out = {}
    for name, call in (("sync_floor_us", lambda: dp_sync.sync_step(4, 129, None, spec_flags=(0, 0, 1))),
                       ("lockstep_floor_us", lambda: dp_sync.lockstep([], None))):
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
        out[name] = sorted(times)[len(times) // 2] * 1e6
    return out


def _batch(server, requests: list[dict], dp: int) -> tuple[float, list[list[int]]]:
    """The requests at once, request i to DP rank i % dp: (seconds to the last token, every request's tokens)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(requests)) as pool:
        start = time.perf_counter()
        tokens = list(pool.map(lambda ir: server.complete(ir[1]["prompt"], ir[1]["max_tokens"],
                                                          dp_rank=ir[0] % dp if dp > 1 else None),
                               enumerate(requests)))
        return time.perf_counter() - start, tokens


def served_tokens_per_s(checkpoint: Path, bundle: Path, name: str, new: int, rounds: int, work: Path) -> dict:
    """Decode tokens/s through ``vllm serve``, native and the plugin up side by side, rounds interleaved (who goes
    first alternates), at ``b`` requests per DP rank for b in BATCHES; the median round; tokens checked equal."""
    from statistics import median

    from tests import test_vllm_parallel as T

    dp = T._printed(bundle)["engine_args"]["data_parallel_size"]
    servers = {"native": T.native_server(work, checkpoint, bundle, f"native-{name}"),
               "plugin": T.plugin_server(work, bundle, f"plugin-{name}")}
    try:
        for server in servers.values():
            server.wait_ready()
        seconds: dict = {}
        for r in range(rounds):
            for b in BATCHES:
                rng = random.Random(b)
                requests = [{"prompt": [rng.randrange(512) for _ in range(100)], "max_tokens": new}
                            for _ in range(b * dp)]
                tokens = {}
                for side in (list(servers) if r % 2 == 0 else list(servers)[::-1]):
                    took, tokens[side] = _batch(servers[side], requests, dp)
                    seconds.setdefault((b, side), []).append(took)
                if tokens["native"] != tokens["plugin"]:
                    raise SystemExit(f"{name}, batch {b} per rank, round {r}: the plugin's tokens differ from native's")
        return {f"batch_{b}_per_rank": {side: round(b * dp * new / median(seconds[b, side]), 1) for side in servers}
                for b in BATCHES}
    finally:
        for server in servers.values():
            server.stop()


def dp2_sync(bundle: Path, work: Path) -> dict:
    from tests import test_vllm_parallel as T

    rng = random.Random(1)
    requests = [{"prompt": [rng.randrange(512) for _ in range(n)], "max_tokens": m} for n, m in [*T.SHAPES, T.ALONE]]
    _, _, reports, _ = T._serve(work, bundle, "dp2", requests)
    r = reports[0]
    f, sec = r["forwards"], r["seconds"]
    stepped = f.get("decode", 0) + f.get("mixed", 0)  # forwards that planned decode rows (Stepper.plan timed)
    return {"rank": r["rank"], "forwards": f, "dp2_plan_us": sec["plan"] / stepped * 1e6,
            "dp2_lockstep_us": sec.get("lockstep", 0.0) / sum(f.values()) * 1e6,
            "dp2_decode_forward_us": sec["forward"] / (stepped + f.get("prefill", 0)) * 1e6}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--tp2", type=Path, required=True)
    p.add_argument("--dp2", type=Path, required=True)
    p.add_argument("--new", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    from tests.dist_util import run_ranks

    doc = {"machine": machine(), "floor": run_ranks(_floor, 2, 2000)[0]}
    with tempfile.TemporaryDirectory(prefix="vllm-parallel-") as tmp:
        doc["dp2"] = dp2_sync(a.dp2, Path(tmp))
        for name, bundle in (("tp2", a.tp2), ("dp2", a.dp2)):
            doc[f"{name}_tokens_per_s"] = served_tokens_per_s(a.checkpoint, bundle, name, a.new, a.rounds, Path(tmp))
    print(json.dumps(doc), flush=True)


if __name__ == "__main__":
    main()
