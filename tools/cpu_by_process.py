"""Where a command's CPU goes, by kind of process: samples every process's CPU time every 0.5 s until STOP_FILE
exists, then prints the seconds per kind (c++, vLLM, compile-pool and rank processes, CLI runs, Ray, ...) as JSON.
A process that lives under half a second is missed (its time is small by definition).

    .venv/bin/python tools/cpu_by_process.py /tmp/cpu.stop > cpu.json &
    make test; touch /tmp/cpu.stop
"""

import collections
import json
import os
import sys
import time

import psutil

KINDS = (  # (substring of the command line, kind): the first match wins
    ("cc1plus", "c++"), ("g++", "c++"), ("collect2", "c++"),
    ("vllm", "vllm"),
    ("ray", "ray"),
    ("moto", "moto (S3 server)"),
    ("spawn_main", "multiprocessing children (compile pools, ranks)"),
    ("exec(eval(sys.stdin", "pytest-xdist workers (in-process tests)"),
    ("bin/neffbuild", "neffbuild CLI processes"), ("neffbuild.cli.main", "neffbuild CLI processes"),
    ("smoke_child", "smoke-run children"),
)


def kind(proc: psutil.Process) -> str | None:
    try:
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return None
    if not cmd:
        return None
    for part, name in KINDS:
        if part in cmd:
            return name
    return "other: " + os.path.basename(cmd.split()[0])


def main(stop: str) -> None:
    seen: dict[tuple, list] = {}  # (pid, start time) -> [kind, cpu seconds so far]
    while not os.path.exists(stop):
        for proc in psutil.process_iter():
            try:
                key = (proc.pid, proc.create_time())
                t = proc.cpu_times()
            except psutil.Error:
                continue
            if key in seen:
                seen[key][1] = t.user + t.system
            elif (k := kind(proc)) is not None:
                seen[key] = [k, t.user + t.system]
        time.sleep(0.5)
    total = collections.Counter()
    for k, seconds in seen.values():
        total[k] += seconds
    print(json.dumps({k: round(v, 1) for k, v in total.most_common()}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
