"""Tiny grid on the local pool vs on Ray, side by side on the same cores, from empty caches.

    .venv/bin/python benchmarks/ray_vs_local.py [WORKDIR]

Both runs are the `neffbuild compile` CLI as a user runs it: `--jobs 2` on the local pool;
`--executor ray` with no address, which starts a Ray instance on this machine with one CPU
slot per core (2 here), so Ray's start-up is part of its wall time. Then each again on its
warm cache. Prints one JSON document.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import machine

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "recipes" / "gpt-oss-tiny.yaml"


def compile_(out: Path, cache: Path, *extra: str) -> dict:
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "neffbuild.cli.main", "compile", str(TINY), "-o", str(out),
                          "--cache-dir", str(cache), "--json", *extra], capture_output=True, text=True, check=False)
    if res.returncode:
        raise SystemExit(res.stderr)
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    return {"wall_s": round(time.monotonic() - t0, 1), "built": doc["built"], "cached": doc["cached"]}


def main() -> None:
    work = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="neffbuild-ray-bench-"))
    report = {"machine": machine(), "load_before": os.getloadavg()}
    for name, extra in (("local_jobs2", ("--jobs", "2")), ("ray_2cpu", ("--executor", "ray"))):
        cache = work / f"cache-{name}"
        report[name] = compile_(work / f"out-{name}", cache, *extra)
        report[name + "_warm"] = compile_(work / f"out-{name}-warm", cache, *extra)
    report["ray_over_local"] = round(report["ray_2cpu"]["wall_s"] / report["local_jobs2"]["wall_s"], 2)
    report["load_after"] = os.getloadavg()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
