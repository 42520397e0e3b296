"""Bytes per decode step and step time in the serving dtypes: float32, bf16, bf16 + MXFP4 experts.

    /work/heavy .venv/bin/python benchmarks/serving_dtypes.py [--workdir DIR] [--repeat 200]

Builds recipes/gpt-oss-small.yaml (the benchmark shape: 8 layers, hidden 256, 8 experts, top 2)
three times at one batch bucket (b1: the weight-bound regime) and one context bucket (2048),
in each form: ``weights_dtype: float32`` (dense experts, float32 KV), ``bfloat16`` (bf16 KV) and
``bfloat16`` + ``experts: mxfp4``. One request at context 2000 then runs through the three
compiled artifacts, interleaved (one step of each per round, so drift on a shared host hits all
alike). Bytes per step: the weights the step must read (``neffbuild.bench.bytes``: one embedding
row, the router's top-k experts of each layer, every other weight) plus the KV of its blocks.
Prints a markdown table; part of ``make bench``, not CI.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RECIPE = ROOT / "recipes" / "gpt-oss-small.yaml"
CONTEXT, CTX_BUCKET = 2000, 2048
FORMS = {  # name -> (model keys, KV dtype)
    "float32": ({"weights_dtype": "float32", "experts": "dense"}, "float32"),
    "bf16": ({"weights_dtype": "bfloat16", "experts": "dense"}, "bfloat16"),
    "bf16 + MXFP4": ({"weights_dtype": "bfloat16", "experts": "mxfp4"}, "bfloat16"),
}


def build(name: str, model: dict, kv_dtype: str, work: Path, cache: Path) -> Path:
    from neffbuild import recipe
    from neffbuild.compiler.builder import compile_recipe

    raw = yaml.safe_load(RECIPE.read_text())
    raw["name"] = "small-" + name.replace(" + ", "-").lower()
    raw["model"].update(model)
    raw["serving"].update(max_model_len=CTX_BUCKET, max_num_seqs=1, num_blocks=509)
    raw["neuron_config"].update(num_seqs_buckets=[1], decode_context_length_buckets=[CTX_BUCKET], kv_dtype=kv_dtype)
    path = work / f"{raw['name']}.yaml"
    path.write_text(yaml.safe_dump(raw))
    res = compile_recipe(recipe.load(path), work / "out", jobs=1, cache_root=cache)
    if res.failed:
        raise SystemExit(f"{name}: build failed: {res.failed}")
    return res.bundle


def step_bytes(bundle) -> dict:
    from neffbuild.bench.bytes import EXPERT_WEIGHTS, kv_bytes, weight_bytes
    from neffbuild.models.gpt_oss.config import GptOssConfig

    cfg = GptOssConfig.from_hf_dict(bundle.graph_inputs.model_config)
    names = set(EXPERT_WEIGHTS) | {n + s for n in ("gate_up_w", "down_w") for s in ("_blocks", "_scales")}
    experts = {k: v for k, v in bundle.weights.items() if k in names}
    weights = weight_bytes({k: v for k, v in bundle.weights.items() if k not in names}, cfg, 1)
    routed = sum(t.numel() * t.element_size() for t in experts.values()) * cfg.num_experts_per_tok \
        // cfg.num_local_experts  # one token: its top-k experts of each layer
    kv = kv_bytes(cfg, bundle.kv_layout, batch=1, ctx=CTX_BUCKET, num_swa=bundle.num_swa)
    return {"experts": routed, "other_weights": weights, "kv": kv, "total": weights + routed + kv}


def main() -> None:
    from benchmarks._common import machine
    from neffbuild.runtime.bundle.reader import open_bundle
    from neffbuild.runtime.kv.cache import allocate
    from neffbuild.runtime.step import attn_metadata
    from neffbuild.runtime.step.dispatch import plan_for

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="serving-dtypes-"))
    work.mkdir(parents=True, exist_ok=True)
    runs = {}
    for name, (model, kv_dtype) in FORMS.items():
        t0 = time.perf_counter()
        bundle = open_bundle(build(name, model, kv_dtype, work, work / "cache"))
        plan = plan_for(bundle.grid, batch_count=1, needed=CONTEXT, num_reqs=1)
        bs = bundle.kv_layout.block_size
        row = torch.arange(1, 1 + CTX_BUCKET // bs)[None]
        inputs = attn_metadata.build(torch.tensor([[1]]), torch.tensor([CONTEXT - 1]), row, row, batch=1,
                                     ctx=plan.ctx, block_size=bs, num_swa=bundle.num_swa)
        kv = allocate(bundle.kv_layout)
        for buffer in kv:  # values, not zeros: the same arithmetic as serving
            buffer.normal_()
        runs[name] = {"fn": bundle.artifact(plan.label), "args": inputs.as_args(kv), "bytes": step_bytes(bundle),
                      "samples": [], "build_s": time.perf_counter() - t0, "label": plan.label}
    for rnd in range(10 + args.repeat):
        for r in runs.values():
            with torch.no_grad():
                t0 = time.perf_counter()
                r["fn"](*r["args"])
                dt = time.perf_counter() - t0
            if rnd >= 10:
                r["samples"].append(dt)
    base = statistics.median(runs["float32"]["samples"])
    print(f"machine: {machine()}; threads {torch.get_num_threads()}; {args.repeat} interleaved rounds; "
          f"recipes/gpt-oss-small.yaml at b1, context {CONTEXT} (bucket {CTX_BUCKET})\n")
    print("| form | expert bytes | other weights | KV | bytes per step | step (median) | p10-p90 | vs float32 |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in runs.items():
        s = sorted(r["samples"])
        med = statistics.median(s)
        p10, p90 = s[len(s) // 10], s[len(s) * 9 // 10]
        b = r["bytes"]
        print(f"| {name} | {b['experts'] / 2**20:.2f} MiB | {b['other_weights'] / 2**20:.2f} MiB | "
              f"{b['kv'] / 2**20:.2f} MiB | {b['total'] / 2**20:.2f} MiB | {med * 1e3:.3f} ms | "
              f"{p10 * 1e3:.3f}-{p90 * 1e3:.3f} ms | x{med / base:.2f} |")
    # What the CPU's FP4 decode costs: the step time MXFP4 adds over bf16, per routed expert weight it decodes.
    weights = runs["bf16 + MXFP4"]["bytes"]["experts"] * 32 // 17  # 17 bytes per 32 weights (blocks + scale)
    extra = statistics.median(runs["bf16 + MXFP4"]["samples"]) - statistics.median(runs["bf16"]["samples"])
    print(f"\nFP4 decode on this CPU: {extra * 1e3:+.3f} ms a step over bf16 for {weights / 1e6:.2f} M routed "
          f"weights: {extra / weights * 1e9:.2f} ns a weight")


if __name__ == "__main__":
    main()
