"""One NIXL READ between two processes, as vLLM's connector posts it (benchmarks/vllm_di.py runs this in the vLLM
venv): the bytes of one pull in its descriptors, timed from post to completion with tight polling.

    .venv-vllm/bin/python benchmarks/vllm_di_nixl.py --bytes 1146880 --block 16384 [--repeat 200] [--delay-us N]

The target (a child process) registers a DRAM buffer of 4x the bytes and publishes its agent metadata on stdout;
this process registers its own, reads ``bytes / block`` blocks scattered over the target's buffer into
consecutive blocks here (both agents with NIXL's progress thread, as vLLM's; ``--delay-us``: the thread's wait
for a UCX event before it polls anyway, as the plugin's connector sets it, neffbuild/vllm/nixl_progress.py; 0,
NIXL's own, spins), and prints one JSON line: the median and best post-to-completion time, and UCX_TLS as the
process saw it. Exits 1 if the bytes differ.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import subprocess
import sys
import time


def agent(name: str, delay_us: int):
    from nixl._api import nixl_agent, nixl_agent_config

    from neffbuild.vllm.nixl_progress import delayed_progress

    with delayed_progress(delay_us):
        return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def target(nbytes: int, delay_us: int) -> None:
    import torch

    a = agent("target", delay_us)
    buf = torch.arange(nbytes // 4, dtype=torch.float32)
    a.register_memory(a.get_reg_descs(buf))
    print(json.dumps({"meta": base64.b64encode(a.get_agent_metadata()).decode(), "addr": buf.data_ptr()}),
          flush=True)
    sys.stdin.readline()  # until the reader is done


def reader(nbytes: int, block: int, repeat: int, delay_us: int) -> dict:
    import torch

    blocks = nbytes // block
    child = subprocess.Popen([sys.executable, __file__, "--target", "--bytes", str(4 * blocks * block),
                              "--delay-us", str(delay_us)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        while line and not line.startswith("{"):  # NIXL's own INFO lines come first
            line = child.stdout.readline()
        peer = json.loads(line)
        a = agent("reader", delay_us)
        dst = torch.zeros(blocks * block // 4, dtype=torch.float32)
        a.register_memory(a.get_reg_descs(dst))
        remote = a.add_remote_agent(base64.b64decode(peer["meta"]))
        picks = torch.randperm(4 * blocks)[:blocks].tolist()  # scattered source blocks, as a pool's are
        there = a.get_xfer_descs([(peer["addr"] + b * block, block, 0) for b in picks], "DRAM")
        here = a.get_xfer_descs([(dst.data_ptr() + i * block, block, 0) for i in range(blocks)], "DRAM")
        handle = a.initialize_xfer("READ", here, there, remote)
        times = []
        for i in range(repeat + 10):
            start = time.perf_counter()
            state = a.transfer(handle)
            while state == "PROC":
                state = a.check_xfer_state(handle)
            if state != "DONE":
                raise SystemExit(f"NIXL READ failed: {state}")
            if i >= 10:  # the first posts connect the endpoints
                times.append(time.perf_counter() - start)
        src = torch.arange(4 * blocks * block // 4, dtype=torch.float32).view(4 * blocks, -1)
        ok = torch.equal(dst.view(blocks, -1), src[picks])
        a.release_xfer_handle(handle)
    finally:
        child.stdin.write("done\n")
        child.stdin.close()
        child.wait(timeout=30)
    return {"ucx_tls": os.environ.get("UCX_TLS", "(unset)"), "bytes": blocks * block, "descriptors": blocks,
            "delay_us": delay_us, "median_ms": round(statistics.median(times) * 1e3, 4),
            "best_ms": round(min(times) * 1e3, 4), "bytes_equal": ok}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bytes", type=int, required=True)
    p.add_argument("--block", type=int, default=16384)
    p.add_argument("--repeat", type=int, default=200)
    p.add_argument("--delay-us", type=int, default=0, help="the progress thread's delay between polls (0: NIXL's)")
    p.add_argument("--target", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.target:
        target(a.bytes, a.delay_us)
        return 0
    out = reader(a.bytes, a.block, a.repeat, a.delay_us)
    print(json.dumps(out))
    return 0 if out["bytes_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
