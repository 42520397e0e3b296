"""Disaggregated serving in vLLM (issue 51): the KV transfer per 1,000 prompt tokens through the plugin's NIXL
connector against a DRAM copy of the same bytes, and time to first token / decode tokens/s through the pair
against one plugin instance on the same bundle.

    PYTHONPATH=. .venv/bin/python benchmarks/vllm_di.py [--workdir DIR] [--tls tcp,sm,self --tls tcp] [--rounds 3]
        [--delay-us 0 --delay-us 1000]

Needs the vLLM venv (tools/vllm_venv.sh); a timing benchmark, run by hand (not by `make test` or CI), alone on
the host. The model is the vLLM tests' (tests/vllm_helpers.py: 2 layers, one sliding, one full, fp32 KV, 2 KV
heads x 64, block 32); the bundle is compiled for 1,152 tokens (batch buckets 1 and 4, one context bucket) so a
1,000-token prompt fits. For each ``--tls`` (UCX_TLS of both instances) and ``--delay-us`` (the NIXL progress
thread's delay, ``kv_connector_extra_config.progress_delay_us``; default: the connector's own, 0 = NIXL's
spinning thread) a pair is started from neffbuild.vllm.di's pieces with a proxy, then one instance alone (no
connector). Per round, sequential
requests: a 1,000-token prompt with ``max_tokens`` 1 (time to first token: through the pair that is the
prefill leg, the pull and the decode instance's first one-token step) and the same prompt with ``max_tokens``
NEW, streamed (decode tokens/s = (NEW - 1) / the time from its first token's chunk to its end; the difference of
the two requests' times was swamped by the time to first token's noise under load); prompts differ per request
(no prefix cache).

The transfer: the decode instance's ``vllm:nixl_xfer_time_seconds`` and ``vllm:nixl_bytes_transferred``
(vLLM's NIXL telemetry, post to completion as the connector sees it: the engine loop notices a finished pull only
between its steps) per pull, scaled to 1,000 tokens; and the same bytes in one raw NIXL READ between two
processes with tight polling (benchmarks/vllm_di_nixl.py, in the vLLM venv): the transport alone. The DRAM
copy: the same bytes copied by torch in this process, hot (gathered from scattered 16 KiB blocks of one
source, which stays in the caches) and cold (a 512 MiB ring, over the last-level cache); medians of 200.
Ratio: copy time / transfer time (1.0 = DRAM speed). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import machine  # noqa: E402

PROMPT, NEW, MAX_LEN = 1000, 64, 1152
VLLM = ROOT / ".venv-vllm" / "bin" / "vllm"


def build(workdir: Path) -> Path:
    from neffbuild import recipe as recipe_mod
    from neffbuild.compiler.builder import compile_recipe
    from tests import vllm_helpers as vh

    checkpoint = workdir / "ckpt"
    if not (checkpoint / "config.json").is_file():
        vh.save_checkpoint(checkpoint)
    path = vh.write_recipe(workdir, checkpoint, name="gpt-oss-vllm-di", max_model_len=MAX_LEN,
                           num_seqs_buckets=(1, 4), ctx_buckets=(MAX_LEN,))
    cache = Path(os.environ.get("NEFFBUILD_CACHE_DIR") or workdir / "cache")
    res = compile_recipe(recipe_mod.load(path), workdir / "out", cache_root=cache)
    if res.failed:
        raise SystemExit(f"compile failed: {res.failed}")
    return res.bundle


def env(tls: str | None) -> dict:
    from tests.vllm_helpers import vllm_env

    out = vllm_env(VLLM_CPU_KVCACHE_SPACE=None)
    out.pop("UCX_TLS", None)
    if tls:
        out["UCX_TLS"] = tls
    return out


FAILED_WARMUPS: list[str] = []  # warm-up requests that failed (the first NIXL handshake timing out)


def timed(url: str, prompt: list[int], new: int) -> float:
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": new, "temperature": 0.0, "ignore_eos": True,
                       "return_token_ids": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        assert len(json.loads(r.read())["choices"][0]["token_ids"]) == new
    return time.perf_counter() - t


def streamed(url: str, prompt: list[int], new: int) -> float:
    """Decode tokens/s of one streamed request: its tokens after the first over the time from the first token's
    chunk to the end (the prefill leg, the pull and the first step are outside it)."""
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": new, "temperature": 0.0, "ignore_eos": True,
                       "stream": True, "return_token_ids": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    first, tokens = None, 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: {"):
                got = sum(len(c.get("token_ids") or []) for c in json.loads(line[6:])["choices"])
                if got and first is None:
                    first = time.perf_counter()
                tokens += got
    end = time.perf_counter()
    assert tokens == new and first is not None, (tokens, new)
    return (new - 1) / max(end - first, 1e-9)


def measure(url: str, rounds: int, rng: random.Random) -> dict:
    for attempt in range(3):  # warm-up: first-call costs, the handshake (which can fail once: docs/vllm.md)
        try:
            timed(url, [rng.randrange(512) for _ in range(PROMPT)], 2)
            break
        except urllib.error.HTTPError as exc:
            print(f"warm-up request {attempt + 1} failed ({exc}); the failed first handshakes are counted",
                  file=sys.stderr, flush=True)
            FAILED_WARMUPS.append(str(exc))
    ttft, decode = [], []
    for _ in range(rounds):
        ttft.append(timed(url, [rng.randrange(512) for _ in range(PROMPT)], 1))
        decode.append(streamed(url, [rng.randrange(512) for _ in range(PROMPT)], NEW))
    return {"ttft_ms": round(statistics.median(ttft) * 1e3, 1), "ttft_all_ms": [round(t * 1e3, 1) for t in ttft],
            "decode_tok_s": round(statistics.median(decode), 1), "decode_all_tok_s": [round(d, 1) for d in decode]}


def nixl_metrics(url: str) -> dict:
    from tests.vllm_helpers import prom_samples

    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    total = {k: sum(prom_samples(text, f"vllm:{k}").values()) for k in
             ("nixl_xfer_time_seconds_sum", "nixl_xfer_time_seconds_count", "nixl_bytes_transferred_sum",
              "nixl_num_descriptors_sum", "nixl_num_failed_transfers_total")}
    return total


def pair(settings: dict, tls: str | None, logs: Path, rounds: int, delay_us: int | None) -> dict:
    from neffbuild.vllm import di

    logs.mkdir(parents=True, exist_ok=True)
    connector = None if delay_us is None else dict(di.CONNECTOR, kv_connector_extra_config={
        "progress_delay_us": delay_us})
    parts = [di.start_instance(name, str(VLLM), settings, logs, env=env(tls), connector=connector)
             for name in ("prefill", "decode")]
    proxy = None
    try:
        di.wait_healthy(parts, 600)
        proxy = di.make_proxy(parts[0].url, parts[1].url, 0)
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        out = measure(f"http://127.0.0.1:{proxy.server_address[1]}", rounds, random.Random(1))
        m = nixl_metrics(parts[1].url)
    finally:
        if proxy is not None:
            proxy.shutdown()
        for p in parts:
            p.stop()
    pulls = m["nixl_xfer_time_seconds_count"]
    if not pulls:
        raise SystemExit(f"UCX_TLS={tls}: the decode instance recorded no NIXL transfer (logs {logs})")
    per_pull_s, per_pull_bytes = m["nixl_xfer_time_seconds_sum"] / pulls, m["nixl_bytes_transferred_sum"] / pulls
    return dict(out, pulls=int(pulls), failed=int(m["nixl_num_failed_transfers_total"]),
                bytes_per_pull=int(per_pull_bytes), descriptors_per_pull=m["nixl_num_descriptors_sum"] / pulls,
                xfer_ms_per_pull=round(per_pull_s * 1e3, 3))


def alone(settings: dict, logs: Path, rounds: int) -> dict:
    from tests.vllm_helpers import Server, free_port, serve_argv

    argv = serve_argv(settings["model"], settings["engine_args"], settings["additional_config"], free_port())
    server = Server(argv, logs / "alone.log", env(None))
    try:
        server.wait_ready(600)
        return measure(server.url, rounds, random.Random(1))
    finally:
        server.stop()


def dram_copy_ms(nbytes: int, block_bytes: int) -> dict:
    """torch copies of ``nbytes`` in this process, medians of 200, in ms: the blocks gathered from scattered places
    (as NIXL's descriptors are), hot (the same source each time: it stays in the caches, as a just-written
    prompt's KV may) and cold (a ring of sources and destinations of 512 MiB, over the last-level cache)."""
    import torch

    torch.set_num_threads(1)
    blocks = max(1, nbytes // block_bytes)
    src = torch.randn(4 * blocks, block_bytes // 4)
    dst = torch.empty(blocks, block_bytes // 4)
    idx = torch.randperm(4 * blocks)[:blocks]
    ring = max(2, (256 << 20) // nbytes)
    ring_src, ring_dst = torch.randn(ring, nbytes // 4), torch.ones(ring, nbytes // 4)  # pages touched: no faults
    turn = [0]

    def cold():
        i = turn[0] = (turn[0] + 1) % ring
        ring_dst[i].copy_(ring_src[i])

    def med(fn) -> float:
        for _ in range(20):
            fn()
        times = []
        for _ in range(200):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e3

    return {"hot_gather_ms": round(med(lambda: torch.index_select(src, 0, idx, out=dst)), 4),
            "cold_copy_ms": round(med(cold), 4)}


def raw_read(tls: str | None, nbytes: int, block: int, delay_us: int | None) -> dict:
    """benchmarks/vllm_di_nixl.py in the vLLM venv: one READ of the pull's bytes, tight polling."""
    import subprocess

    from neffbuild.vllm.nixl_progress import PROGRESS_DELAY_US

    delay = PROGRESS_DELAY_US if delay_us is None else delay_us
    res = subprocess.run([str(VLLM.parent / "python"), str(ROOT / "benchmarks" / "vllm_di_nixl.py"), "--bytes",
                          str(nbytes), "--block", str(block), "--delay-us", str(delay)],
                         env=dict(env(tls), PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=300)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {"error": res.stderr.strip().splitlines()[-1:]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", type=Path)
    p.add_argument("--tls", action="append", help="UCX_TLS of a pair (repeat; default: tcp,sm,self then tcp; "
                                                  "'unset': UCX's own choice)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--delay-us", type=int, action="append", help="the NIXL progress thread's delay in us of a pair "
                   "(repeat; default: the connector's own; 0: NIXL's spinning thread)")
    p.add_argument("--no-alone", action="store_true", help="skip the one-instance run")
    a = p.parse_args()
    if not VLLM.is_file():
        raise SystemExit(f"{VLLM} is absent: build the vLLM venv with tools/vllm_venv.sh")
    workdir = a.workdir or Path(tempfile.mkdtemp(prefix="vllm-di-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    bundle = build(workdir)
    from neffbuild.vllm import di

    settings = di.plugin_settings(str(bundle), str(Path(sys.executable).parent / "neffbuild"))
    load = [os.getloadavg()[0]]
    out = {"machine": machine(), "prompt": PROMPT, "new": NEW, "bundle": str(bundle), "pairs": {}}
    for tls, delay in [(t, d) for t in a.tls or ["tcp,sm,self", "tcp"] for d in a.delay_us or [None]]:
        key = tls if delay is None else f"{tls} delay {delay} us"
        try:
            row = pair(settings, None if tls == "unset" else tls, workdir / f"logs-{tls}-{delay}", a.rounds, delay)
        except SystemExit as e:  # a transport set NIXL cannot start with (e.g. sm,self: NIXL_ERR_BACKEND)
            out["pairs"][key] = {"error": str(e.code)}
            print(f"{key}: {e.code}", file=sys.stderr, flush=True)
            continue
        tokens = PROMPT - 1  # the pull: N - 1 tokens' KV (the sliding-window rule)
        row["xfer_ms_per_1000_tokens"] = round(row["xfer_ms_per_pull"] * 1000 / tokens, 3)
        block = 2 * 32 * 64 * 4  # the bundle's block_len: kv_heads * block_size * head_dim * 4 bytes
        copy = dram_copy_ms(row["bytes_per_pull"], block)
        row["dram_copy_ms_per_pull"] = copy
        row["raw_nixl_read"] = raw = raw_read(None if tls == "unset" else tls, row["bytes_per_pull"], block, delay)
        for name, ms in (("connector", row["xfer_ms_per_pull"]), ("raw_read", raw.get("median_ms"))):
            if ms:
                row[f"{name}_vs_dram_copy"] = {k: round(v / ms, 3) for k, v in copy.items()}
        out["pairs"][key] = row
        print(f"{key}: {json.dumps(row)}", file=sys.stderr, flush=True)
        load.append(os.getloadavg()[0])
    if not a.no_alone:
        out["alone"] = alone(settings, workdir, a.rounds)
        load.append(os.getloadavg()[0])
    out["failed_warmups"] = FAILED_WARMUPS
    out["load_1min"] = [round(x, 1) for x in load]  # at the start and after each pair and the lone instance
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
