"""Sharded bundles inside vLLM: the DP synchronisation's cost per step, and tp 2 decode tokens/s, plugin vs native.

    .venv/bin/python benchmarks/vllm_parallel.py --checkpoint CKPT --tp2 TP2_BUNDLE --dp2 DP2_BUNDLE [--new 200]

Needs the vLLM venv (tools/vllm_venv.sh) and bundles of tests/test_vllm_parallel.py's recipes (the vLLM tests'
model; batch bucket 4, context bucket 128, fallback 512). Three numbers:

- ``sync_floor_us``: the runtime's DP all-reduce alone (``dp_sync.sync_step``, 5 int32, MAX) between 2 gloo
  processes, median of 2,000 (and ``lockstep_floor_us``: the lockstep count all-reduce, nobody prefilling);
- ``dp2_plan_us`` / ``dp2_lockstep_us``: the same inside ``vllm serve`` of the dp 2 / ep 2 bundle (six requests,
  then one alone), per step, from DP rank 0's plugin report: ``Stepper.plan`` (the all-reduce, waiting for the
  slower rank included) and ``Stepper.lockstep``, against the whole decode forward;
- ``tp2_tokens_per_s``: one request (100-token prompt, ``--new`` tokens, greedy) through ``vllm.LLM`` at tp 2,
  the plugin on the tp 2 bundle and vLLM native on the checkpoint, fresh processes; best of 2 rounds; the
  prompt's prefill included. The tokens must be identical.
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


def tp2_tokens_per_s(checkpoint: Path, bundle: Path, new: int, work: Path) -> dict:
    from neffbuild.bundle.handoff import cpu_binding
    from tests.vllm_helpers import python_json, run_vllm_script

    rng = random.Random(3)
    requests = work / "one.json"
    requests.write_text(json.dumps([{"prompt": [rng.randrange(512) for _ in range(100)], "max_tokens": new}]))
    out = {}
    for side, extra, env in (("native", [], {"VLLM_PLUGINS": ""}), ("plugin", ["--bundle", str(bundle)], {})):
        res = run_vllm_script("tests/vllm_scripts/generate.py",
                              ["--model", str(checkpoint), "--requests", str(requests), "--rounds", "2",
                               "--tensor-parallel-size", "2", *extra],
                              VLLM_CPU_OMP_THREADS_BIND=cpu_binding(2), VLLM_ALLOW_INSECURE_SERIALIZATION="1", **env)
        if res.returncode:
            raise SystemExit(f"{side}: {res.stderr[-3000:]}")
        doc = python_json(res.stdout)
        out[side] = {"tokens": doc["tokens"][0], "tokens_per_s": new / min(doc["generate_s"])}
    if out["native"]["tokens"] != out["plugin"]["tokens"]:
        raise SystemExit("tp 2: the plugin's tokens differ from native's")
    return {side: round(v["tokens_per_s"], 1) for side, v in out.items()}


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
    a = p.parse_args()
    from tests.dist_util import run_ranks

    doc = {"machine": machine(), "floor": run_ranks(_floor, 2, 2000)[0]}
    with tempfile.TemporaryDirectory(prefix="vllm-parallel-") as tmp:
        doc["dp2"] = dp2_sync(a.dp2, Path(tmp))
        doc["tp2_tokens_per_s"] = tp2_tokens_per_s(a.checkpoint, a.tp2, a.new, Path(tmp))
    print(json.dumps(doc), flush=True)


if __name__ == "__main__":
    main()
