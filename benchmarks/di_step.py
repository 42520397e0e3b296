"""A DI decode step against a plain decode step, side by side on `generate`'s own path (issue 19).

    PYTHONPATH=. .venv/bin/python benchmarks/di_step.py BUNDLE [--rounds 8] [--threads N]

Rounds alternate: ``generate`` (``serve.world.run_ranks``, local prefill) then
``generate --di`` (a ``PrefillGroup``, then ``run_ranks`` with the NIXL source), same
bundle, same prompts (4 x 40 tokens, 48 new). Each run is a process of its own, as each
``generate`` is: a plain run never loads NIXL/UCX (whose memory hooks stay installed in
a process once an agent was made), a DI run does.
Per step: ``EngineStats.step_seconds`` (no loading, prefill or transfer in it). Each
run's first step is left out (first-call costs); the median is over every other step of
every round, per mode. ``--threads``: OMP_NUM_THREADS of every run, for both
modes (default: torch's own, the cores). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import machine

PROMPT_LENGTHS, NEW = [40, 40, 40, 40], 48


def one(bundle: str, mode: str) -> dict:
    """One ``generate`` run in this process: the rank's step seconds and tokens."""
    from neffbuild.serve.parts import Request
    from neffbuild.serve.prefill_worker import PrefillGroup
    from neffbuild.serve.run import Options
    from neffbuild.serve.world import run_ranks

    prompts = [[(7 * i + 3 * n) % 250 + 1 for i in range(n)] for n in PROMPT_LENGTHS]
    reqs = [Request(str(k), list(p), NEW, index=k) for k, p in enumerate(prompts)]
    if mode == "plain":
        (rank,) = run_ranks(bundle, reqs, Options())
    else:
        with PrefillGroup(bundle) as group:
            (rank,) = run_ranks(bundle, reqs, Options(di=True), group)
    import torch

    return {"step_seconds": rank["step_seconds"], "tokens": [q["tokens"] for q in rank["requests"]],
            "torch_threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--one", choices=["plain", "di"], help=argparse.SUPPRESS)  # one run, in this process
    args = ap.parse_args()
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    if args.one:
        print(json.dumps(one(args.bundle, args.one)))
        return

    steps: dict[str, list[float]] = {"plain": [], "di": []}
    rounds: dict[str, list[float]] = {"plain": [], "di": []}
    tokens: dict[str, list] = {}
    threads = set()
    loads = [os.getloadavg()[0]]
    for _ in range(args.rounds):
        for mode in ("plain", "di"):
            out = subprocess.run([sys.executable, __file__, args.bundle, "--one", mode], env=env, check=True,
                                 capture_output=True, text=True).stdout
            res = json.loads(out.strip().splitlines()[-1])
            later = res["step_seconds"][1:]
            steps[mode] += later
            rounds[mode].append(statistics.median(later))
            tokens[mode] = res["tokens"]
            threads.add(res["torch_threads"])
        loads.append(os.getloadavg()[0])
    if tokens["plain"] != tokens["di"]:
        raise SystemExit("plain and DI tokens differ")
    med = {m: statistics.median(v) * 1e3 for m, v in steps.items()}
    out = {"machine": machine(), "torch_threads": sorted(threads), "rounds": args.rounds,
           "steps_per_mode": {m: len(v) for m, v in steps.items()},
           "plain_step_ms": round(med["plain"], 4), "di_step_ms": round(med["di"], 4),
           "ratio": round(med["di"] / med["plain"], 3),
           "round_medians_ms": {m: [round(x * 1e3, 3) for x in v] for m, v in rounds.items()},
           "load_average": [round(x, 2) for x in loads]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
