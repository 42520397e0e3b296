"""Tiny grid: cold build vs warm-remote (empty local cache) vs warm-local, side by side in one run.

    .venv/bin/python benchmarks/remote_cache.py [WORKDIR]

Starts a moto S3 server on 127.0.0.1 (tests/s3_server.py, IAM enforced, read-write keys),
then runs the `neffbuild compile` CLI three times on recipes/gpt-oss-tiny.yaml with --jobs 2:
1. cold: empty local cache, empty remote prefix (compiles every target and pushes it);
2. warm remote: a new empty local cache, the same remote (fetches every entry, compiles none);
3. warm local: the cache of run 2 again (local hits only).
Prints one JSON document (wall seconds, counts, load average before and after).
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
sys.path.insert(0, str(ROOT))
TINY = ROOT / "recipes" / "gpt-oss-tiny.yaml"


def compile_(out: Path, cache: Path, url: str, env: dict) -> dict:
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "neffbuild.cli.main", "compile", str(TINY), "-o", str(out),
                          "--cache-dir", str(cache), "--cache-remote", url, "--jobs", "2", "--json"],
                         capture_output=True, text=True, check=False, env=env, cwd=ROOT)
    if res.returncode:
        raise SystemExit(res.stderr)
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    keys = ("built", "local_hits", "remote_hits", "pushes", "remote_errors")
    return {"wall_s": round(time.monotonic() - t0, 1), **{k: doc[k] for k in keys}}


def main() -> None:
    from tests.s3_server import start_server

    work = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="neffbuild-remote-bench-"))
    server = start_server()
    try:
        env, url = server.env("rw"), server.url("bench")
        report = {"machine": machine(), "load_before": os.getloadavg()}
        report["cold"] = compile_(work / "out-cold", work / "cache-cold", url, env)
        report["warm_remote"] = compile_(work / "out-remote", work / "cache-fresh", url, env)
        report["warm_local"] = compile_(work / "out-local", work / "cache-fresh", url, env)
        report["cold_over_warm_remote"] = round(report["cold"]["wall_s"] / report["warm_remote"]["wall_s"], 2)
        report["warm_remote_over_warm_local"] = round(report["warm_remote"]["wall_s"]
                                                      / report["warm_local"]["wall_s"], 2)
        report["load_after"] = os.getloadavg()
    finally:
        server.proc.kill()
        server.proc.wait()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
