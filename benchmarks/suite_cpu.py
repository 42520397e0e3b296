"""Where a run's CPU goes, by kind of process: every process on the host sampled each 0.5 s until COMMAND ends.

    .venv/bin/python benchmarks/suite_cpu.py [--json OUT] -- make test

tests/cpu_account.py counts the CPU of each test module from inside pytest (a floor: it misses orphans and Ray's
workers); this counts every process of the host by what it is: the compile pool's workers (lowering, tracing,
smoke runs), g++ (``cc1plus``, ``ld``, ``as``), vLLM's processes (``vllm serve``, its engine core and workers, any
script in the vLLM venv), the xdist workers' own test bodies, CLI subprocesses, Ray, moto. A process gets the kind
of its first sight; its CPU is the growth of its counters between samples, so a process that lives under 0.5 s is
missed (the host's /proc/stat total is printed beside the sum for that). Processes already running when it starts
count only from then.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections import Counter

import psutil

GXX = {"cc1plus", "cc1", "g++", "gcc", "c++", "ld", "ld.bfd", "ld.gold", "collect2", "as"}


def kind(proc: psutil.Process) -> str:
    try:
        name, cmd = proc.name(), proc.cmdline()
    except psutil.Error:
        return "gone"
    line = " ".join(cmd)
    if name in GXX:
        return "g++ (" + name + ")"
    if "VLLM" in name or "vllm" in line:
        return "vLLM (" + ("serve" if " serve " in line else name if "VLLM" in name else "other") + ")"
    if "raylet" in line or "gcs_server" in line or name.startswith("ray::") or "ray/_private" in line:
        return "Ray"
    if "moto" in line:
        return "moto"
    if "spawn_main" in line or "forkserver" in line:
        return "python: multiprocessing children (compile pool, ranks, workers)"
    if "execnet" in line or "import sys;exec(" in line:
        return "python: xdist workers (test bodies)"
    if "pytest" in line and "-c" not in cmd[:2]:
        return "python: pytest controller, or a process given a test's tmp path"
    if name.startswith("python") or (cmd and "python" in os.path.basename(cmd[0])):
        return "python: other (CLI subprocesses, scripts)"
    return "other: " + name


def busy_s() -> float:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields[:3]) + sum(fields[5:8])) / os.sysconf("SC_CLK_TCK")  # user nice system irq softirq steal


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the totals here too")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command to run (after --)")
    a = ap.parse_args()
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        ap.error("give the command to run after --")
    me = os.getpid()
    seen, kinds, totals = {}, {}, Counter()
    for p in psutil.process_iter():  # what runs already counts from now on
        with contextlib.suppress(psutil.Error):
            seen[(p.pid, p.create_time())] = sum(p.cpu_times()[:2])
    t0, b0 = time.time(), busy_s()
    child = subprocess.Popen(command)
    while child.poll() is None:
        for p in psutil.process_iter():
            if p.pid == me:
                continue
            try:
                key, cpu = (p.pid, p.create_time()), sum(p.cpu_times()[:2])
            except psutil.Error:
                continue
            if key not in kinds:
                kinds[key] = kind(p)
            totals[kinds[key]] += cpu - seen.get(key, 0.0)
            seen[key] = cpu
        time.sleep(0.5)
    wall, busy = time.time() - t0, busy_s() - b0
    print(f"\n{' '.join(command)}: exit {child.returncode}, {wall:.0f} s, host busy {busy:.0f} CPU-s "
          f"({os.cpu_count()} cores: {100 * busy / wall / os.cpu_count():.1f} %); sampled {sum(totals.values()):.0f}")
    for k, v in totals.most_common():
        if v >= 1:
            print(f"{v:9.1f}  {k}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": command, "exit": child.returncode, "wall_s": wall, "busy_cpu_s": busy,
                       "by_kind": dict(totals.most_common())}, f, indent=1)
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
