"""Decode tokens/s: vLLM's native GPT-OSS against vLLM serving a bundle through neffbuild's plugin.

    benchmarks/vs_vllm.py [--workdir DIR] [--repeat 2] [--rounds 2] [--pool]

Needs the vLLM venv (tools/vllm_venv.sh). The checkpoint is the vLLM tests' model (tests/vllm_helpers.py:
2 layers, hidden 256, 8 experts top 2, head_dim 64), saved by transformers; one bundle is compiled from it
(batch buckets 1 and 4, context bucket 640, fallback 1024, block 32, pool 160). Both sides get the same vLLM
engine arguments (fp32, --enforce-eager, the bundle's max_model_len / block size / pool), one compute thread
(OMP_NUM_THREADS=1), 400-token prompts, 200 new tokens, greedy. Decode only: each side's 1-token generation
(prefill + first token) is subtracted from its 200-token one. Engines alternate, each in a fresh process
(native, bundle, native, bundle, ...); medians. The tokens must be identical (exit 1 if not).

The bundle side also reports where its decode step goes (bundle_step_split): vLLM's whole step (decode
seconds / 199), the plugin's decode forward, and the Stepper's run (inputs + the artifact) inside it.

--pool: also the bundle recompiled with a 4x pool (640 blocks), served the same way; its decode step time at
batch 4 over the 160-block bundle's is the pool ratio (the performance contract: the pool must not matter).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import machine  # noqa: E402

PROMPT, NEW, BATCHES, POOL = 400, 200, (1, 4), 160
WORKER = ROOT / "benchmarks" / "vs_vllm_worker.py"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def build(workdir: Path, checkpoint: Path, pool: int) -> Path:
    from neffbuild import recipe as recipe_mod
    from neffbuild.compiler.builder import compile_recipe
    from tests import vllm_helpers as vh

    path = vh.write_recipe(workdir, checkpoint, name=f"gpt-oss-vs-vllm-{pool}", num_blocks=pool, max_model_len=1024,
                           num_seqs_buckets=BATCHES, ctx_buckets=(640,))
    raw = recipe_mod.load(path)
    res = compile_recipe(raw, workdir / f"out{pool}", cache_root=workdir / "cache")
    if res.failed:
        raise SystemExit(f"compile failed: {res.failed}")
    return res.bundle


def engine_args(bundle: Path) -> dict:
    from neffbuild.bundle import handoff

    manifest = json.loads((bundle / "manifest.json").read_text())
    return handoff.plugin_config(bundle, manifest, {})["engine_args"]


def side(checkpoint: Path, args: dict, bundle: Path | None, rounds: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_CPU_KVCACHE_SPACE="1",
               HF_HUB_OFFLINE="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1", PYTHONPATH=str(ROOT),
               VLLM_LOGGING_LEVEL="WARNING")
    if bundle is None:  # vLLM native reads the checkpoint: not the plugin's bundle-only settings
        args = {k: v for k, v in args.items() if k not in ("load_format", "kv_cache_memory_bytes")}
    argv = [str(VLLM_PYTHON), str(WORKER), "--model", str(checkpoint if bundle is None else bundle),
            "--engine-args", json.dumps(args),
            "--prompt-len", str(PROMPT), "--new", str(NEW), "--batches", ",".join(map(str, BATCHES)),
            "--rounds", str(rounds)]
    if bundle is None:
        env["VLLM_PLUGINS"] = ""  # no plugin loaded at all: vLLM's own GPT-OSS
    else:
        argv += ["--bundle", str(bundle)]
    res = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=ROOT)
    if res.returncode:
        causes = [line for line in res.stderr.splitlines() if "Error" in line or "neffbuild" in line]
        raise SystemExit(f"vLLM worker failed ({'bundle' if bundle else 'native'}):\n" + "\n".join(causes[-20:]))
    return json.loads([line for line in res.stdout.splitlines() if line.startswith("{")][-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", type=Path)
    p.add_argument("--repeat", type=int, default=2, help="engine processes per side (alternating)")
    p.add_argument("--rounds", type=int, default=2, help="timed generations per batch size in each process")
    p.add_argument("--pool", action="store_true", help="also measure a bundle with a 4x pool")
    a = p.parse_args()
    if not VLLM_PYTHON.is_file():
        raise SystemExit(f"{VLLM_PYTHON} is absent: build the vLLM venv with tools/vllm_venv.sh")
    workdir = a.workdir or Path(tempfile.mkdtemp(prefix="vs-vllm-"))
    workdir.mkdir(parents=True, exist_ok=True)
    from tests import vllm_helpers as vh

    checkpoint = workdir / "ckpt"
    if not (checkpoint / "config.json").is_file():
        vh.save_checkpoint(checkpoint)
    bundle = build(workdir, checkpoint, POOL)
    args = engine_args(bundle)
    runs: dict[str, list[dict]] = {"native": [], "bundle": []}
    for _ in range(a.repeat):
        runs["native"].append(side(checkpoint, args, None, a.rounds))
        runs["bundle"].append(side(checkpoint, args, bundle, a.rounds))
    same = all(r["batches"][str(b)]["tokens"] == runs["native"][0]["batches"][str(b)]["tokens"]
               for rs in runs.values() for r in rs for b in BATCHES)
    out = {"machine": machine(), "prompt": PROMPT, "new": NEW, "tokens_identical": same, "batches": {}}
    for b in BATCHES:
        row = {}
        for name, rs in runs.items():
            secs = statistics.median(s for r in rs for s in r["batches"][str(b)]["decode_s"])
            row[name] = {"decode_s": round(secs, 4), "tokens_per_s": round(b * (NEW - 1) / secs, 1)}
        row["bundle_over_native"] = round(row["bundle"]["tokens_per_s"] / row["native"]["tokens_per_s"], 3)
        out["batches"][str(b)] = row
    out["bundle_steps"] = runs["bundle"][-1]["report"]["steps"]
    if a.pool:
        big = build(workdir, checkpoint, 4 * POOL)
        step = {}
        for name, path in (("pool", bundle), ("pool_x4", big)):
            r = side(checkpoint, engine_args(path), path, a.rounds)
            step[name] = statistics.median(r["batches"]["4"]["decode_s"]) / (NEW - 1)
        out["pool"] = {"step_ms": {k: round(v * 1e3, 3) for k, v in step.items()},
                       "ratio": round(step["pool_x4"] / step["pool"], 3)}
    split = {}
    for b in BATCHES:  # where the bundle's decode step goes: vLLM's whole step, the plugin's forward, Stepper.run
        parts = [r["batches"][str(b)]["plugin"] for r in runs["bundle"]]
        steps = sum(p["steps"] for p in parts)
        split[str(b)] = {"vllm_step_ms": round(out["batches"][str(b)]["bundle"]["decode_s"] / (NEW - 1) * 1e3, 3),
                         "plugin_forward_ms": round(sum(p["forward"] for p in parts) / steps * 1e3, 3),
                         "stepper_run_ms": round(sum(p["run"] for p in parts) / steps * 1e3, 3)}
    out["bundle_step_split"] = split
    print(json.dumps(out, indent=1))
    for b, row in out["batches"].items():
        print(f"batch {b}: native {row['native']['tokens_per_s']} tok/s, bundle {row['bundle']['tokens_per_s']} "
              f"tok/s (x{row['bundle_over_native']})", file=sys.stderr)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
