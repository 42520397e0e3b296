"""A streaming load through ``vllm serve`` at GPT-OSS-20B's width: vLLM native against vLLM with the plugin.

    .venv/bin/python benchmarks/vllm_streaming.py --workdir DIR [--requests 16] [--gap 1.0] [--rounds 2]

Uses benchmarks/real_width.py's work folder (run it first with the same ``--workdir``: the checkpoints and the
``bundle-mxfp4`` bundle are there). Engines, one ``vllm serve`` each on 127.0.0.1, interleaved rounds:

  vllm-plugin-mxfp4  the bf16 + MXFP4 bundle, started with exactly the command ``neffbuild inspect BUNDLE
                     --vllm-config --json`` prints (its max_num_seqs: the bundle's largest batch bucket)
  vllm-bf16          vLLM native on the dense bf16 checkpoint (what vLLM CPU serves on a host without AMX), the
                     same max_model_len, max_num_seqs, block size and KV bytes

Requests arrive every ``--gap`` seconds (token-id prompts of 60-900 tokens, so long ones are chunked by
vLLM's token budget; 32-64 new tokens, greedy, streamed). Per request: time to first token, and time per output
token = (last token - first token) / (tokens - 1); per run: requests/s (requests over the time from the first send
to the last token), output tokens/s, the p50/p90 of both, and the peak RSS of the server's process tree. One thread
per engine (OMP_NUM_THREADS=1). Prints a markdown table; the load average with every number.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from neffbuild import engine_flags  # noqa: E402
from neffbuild.vllm import di  # noqa: E402

VLLM = Path(os.environ.get("VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python")).with_name("vllm")
BUNDLE = "out/real-width-bundle-mxfp4-0.1.0"
LENGTHS, NEW = (60, 450, 200, 900, 120, 700), (48, 32, 64)
START_TIMEOUT_S = 600.0


def server_env(plugin: bool) -> dict:
    """One thread; vLLM native loads no plugin; the plugin takes its KV memory from the printed settings."""
    out = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1",
               VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_LOGGING_LEVEL="WARNING")
    out.pop("VLLM_CPU_KVCACHE_SPACE", None)
    if not plugin:
        out["VLLM_PLUGINS"] = ""
    return out


def plugin_argv(work: Path) -> tuple[list[str], dict]:
    """``vllm serve`` as ``inspect --vllm-config --json`` prints it, and the settings (for the native twin)."""
    doc = json.loads(subprocess.run([sys.executable, "-m", "neffbuild.cli.main", "inspect", str(work / BUNDLE),
                                     "--vllm-config", "--json"], capture_output=True, text=True, check=True,
                                    env=dict(os.environ, PYTHONPATH=str(ROOT))).stdout)
    argv = [str(VLLM), "serve", doc["model"], *engine_flags.argv(doc["engine_args"]),
            "--additional-config", json.dumps(doc["additional_config"])]
    return argv, doc["engine_args"]


def native_argv(work: Path, args: dict) -> list[str]:
    keep = ("dtype", "max_model_len", "max_num_seqs", "block_size", "kv_cache_memory_bytes", "enforce_eager",
            "skip_tokenizer_init")
    return [str(VLLM), "serve", str(work / "ckpt" / "bf16"), *engine_flags.argv({k: args[k] for k in keep})]


def tree_peak_rss_gib(pid: int) -> float:
    """VmHWM summed over the server and its descendants (vLLM's engine core is a child process)."""
    pids, total = [pid], 0
    while pids:
        p = pids.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        total += next((int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("VmHWM")), 0)
        pids += [int(c) for c in children]
    return total / 2**20


def wait_ready(port: int, proc: subprocess.Popen, log: Path) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < START_TIMEOUT_S:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited {proc.returncode}: see {log}")
        if di.healthy(f"http://127.0.0.1:{port}"):
            return
        time.sleep(1)
    raise RuntimeError(f"vllm serve did not answer /health in {START_TIMEOUT_S:.0f} s: see {log}")


def stream_one(port: int, model: str, prompt: list[int], new: int, out: dict) -> None:
    """One streamed completion: the send time and every token's arrival time (out['times'])."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": new, "min_tokens": new, "temperature": 0.0,
                       "ignore_eos": True, "stream": True, "return_token_ids": True})
    out["sent"], out["times"], out["tokens"] = time.perf_counter(), [], []
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        out["error"] = f"HTTP {resp.status}: {resp.read()[:200]!r}"
        return
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        ids = json.loads(line[5:])["choices"][0].get("token_ids") or []
        out["tokens"] += ids
        out["times"] += [time.perf_counter()] * len(ids)


def run_load(port: int, model: str, n: int, gap: float, vocab: int) -> list[dict]:
    outs, threads = [{} for _ in range(n)], []
    t0 = time.perf_counter()
    for i in range(n):
        length, new = LENGTHS[i % len(LENGTHS)], NEW[i % len(NEW)]
        prompt = [(7 * t + 31 * i + 3) % (vocab - 1) + 1 for t in range(length)]
        time.sleep(max(0.0, t0 + i * gap - time.perf_counter()))
        th = threading.Thread(target=stream_one, args=(port, model, prompt, new, outs[i]))
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    return outs


def summarize(outs: list[dict]) -> dict:
    bad = [o.get("error", "no tokens") for o in outs if o.get("error") or len(o.get("times", [])) < 2]
    if bad:
        raise RuntimeError(f"{len(bad)} request(s) failed: {bad[0]}")
    ttft = [o["times"][0] - o["sent"] for o in outs]
    tpot = [(o["times"][-1] - o["times"][0]) / (len(o["times"]) - 1) for o in outs]
    span = max(o["times"][-1] for o in outs) - min(o["sent"] for o in outs)
    tokens = sum(len(o["times"]) for o in outs)

    def pct(v, q):
        return statistics.quantiles(v, n=10)[int(q * 10) - 1] if q != 0.5 else statistics.median(v)

    return {"req_per_s": len(outs) / span, "out_tok_per_s": tokens / span, "ttft_p50": pct(ttft, 0.5),
            "ttft_p90": pct(ttft, 0.9), "tpot_p50": pct(tpot, 0.5), "tpot_p90": pct(tpot, 0.9), "tokens": tokens}


def run_engine(name: str, work: Path, a) -> dict:
    argv, args = plugin_argv(work)
    if name == "vllm-bf16":
        argv = native_argv(work, args)
    port, log = di.free_port(), work / f"stream-{name}.log"
    with open(log, "a") as err:
        proc = subprocess.Popen([*argv, "--port", str(port), "--host", "127.0.0.1", "--seed", "0"], stdout=err,
                                stderr=err, env=server_env(name != "vllm-bf16"), start_new_session=True)
    try:
        wait_ready(port, proc, log)
        model = argv[2]
        before = os.getloadavg()[0]
        run_load(port, model, 2, 0.0, a.vocab)  # warm-up: the first prefill and decode of each shape
        doc = summarize(run_load(port, model, a.requests, a.gap, a.vocab))
        doc.update(peak_rss_gib=tree_peak_rss_gib(proc.pid), load=f"{before:.1f}-{os.getloadavg()[0]:.1f}")
        return doc
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, required=True, help="benchmarks/real_width.py's --workdir")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--gap", type=float, default=1.0, help="seconds between arrivals")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--engines", default="vllm-plugin-mxfp4,vllm-bf16")
    ap.add_argument("--vocab", type=int, default=201088)
    a = ap.parse_args()
    if not (a.workdir / BUNDLE).is_dir() or not (a.workdir / "ckpt" / "bf16").is_dir():
        print(f"--workdir {a.workdir}: no {BUNDLE} or ckpt/bf16; run benchmarks/real_width.py --workdir "
              f"{a.workdir} --engines bundle-mxfp4 first", file=sys.stderr)
        raise SystemExit(2)
    from benchmarks._common import machine

    names = [n for n in a.engines.split(",") if n]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for rnd in range(a.rounds):
        for n in names:
            runs[n].append(run_engine(n, a.workdir, a))
            print(f"round {rnd}: {n}: {json.dumps(runs[n][-1])}", flush=True)
    print(f"\nmachine: {machine()}; {a.requests} requests every {a.gap} s; medians of {a.rounds} rounds\n")
    print("| engine | requests/s | output tokens/s | TTFT p50 / p90 | time per output token p50 / p90 | "
          "peak RSS | load average |")
    print("|---|---|---|---|---|---|---|")
    for n, docs in runs.items():
        med = {k: statistics.median(d[k] for d in docs) for k in docs[0] if k != "load"}
        print(f"| {n} | {med['req_per_s']:.3f} | {med['out_tok_per_s']:.2f} | {med['ttft_p50']:.2f} / "
              f"{med['ttft_p90']:.2f} s | {med['tpot_p50'] * 1e3:.0f} / {med['tpot_p90'] * 1e3:.0f} ms | "
              f"{med['peak_rss_gib']:.1f} GiB | {', '.join(d['load'] for d in docs)} |")
    (a.workdir / "streaming.json").write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
