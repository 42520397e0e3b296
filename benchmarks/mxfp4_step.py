"""The compiled decode step at GPT-OSS-20B width with MXFP4 experts: the native CPU ops beside the plain traced
graph, side by side, batch 1 and 4, one thread; bytes per step and the fraction of the copy bandwidth.

    .venv/bin/python benchmarks/mxfp4_step.py --workdir /tmp/rw [--layers 2] [--ctx 1024] [--context 500]
        [--repeat 5] [--rounds 2]

Writes the random MXFP4 checkpoint of benchmarks/real_width.py into WORKDIR/ckpt (kept for a rerun), then
compiles real_width.py's ``bundle-mxfp4`` recipe (bf16 weights, MXFP4 experts, bf16 KV; batch buckets 1 and 4,
one context bucket) twice in this process, into two caches: as the product compiles it (the picked experts
through ``neffbuild::mxfp4_dot`` and the LM head through ``neffbuild::bf16_linear``, neffbuild/runtime/native.py)
and with those ops off (``packed_dot``'s arithmetic traced into the graph and oneDNN's matmul for the head, what
the graph was before). Each artifact is then timed at ``--context`` (median
of ``--repeat`` steps), the two forms alternating for ``--rounds`` rounds. Bytes per step follow real_width.py's
rule (the weights a step must read, the experts the router can pick, the KV at that context); "of copy" divides
the bytes read per second by ``neffbuild.bench.bytes.copy_bandwidth()``. The load average is printed with the
table: a number taken on a busy host says so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def compile_bundle(recipe: Path, out: Path, cache: Path, native: bool) -> Path:
    from neffbuild import recipe as R
    from neffbuild.compiler.backends import inductor
    from neffbuild.compiler.builder import compile_recipe
    from neffbuild.compiler.executor import InlineExecutor

    saved = inductor.native_cpu_ops
    if not native:
        inductor.native_cpu_ops = contextlib.nullcontext  # export traces packed_dot and the matmul instead
    try:
        res = compile_recipe(R.load(recipe), out, cache_root=cache, executor=InlineExecutor())
    finally:
        inductor.native_cpu_ops = saved
    if res.failed:
        raise SystemExit(f"compile failed: {res.failed}")
    return res.bundle


def uses_op(bundle: Path) -> bool:
    import zipfile

    with zipfile.ZipFile(next((bundle / "artifacts").glob("*.pt2"))) as z:
        return any(n.endswith(".wrapper.json") and b"neffbuild::mxfp4_dot" in z.read(n) for n in z.namelist())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=1024, help="max_model_len and the bundle's one context bucket")
    ap.add_argument("--context", type=int, default=500, help="the decode context the steps are timed at")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(1)
    from benchmarks._common import machine
    from benchmarks.real_width import ENGINES, recipe_for, step_bytes
    from benchmarks.real_width_profile import _median, step_args
    from neffbuild.bench.bytes import copy_bandwidth
    from neffbuild.models.gpt_oss.config import GptOssConfig
    from neffbuild.runtime.bundle.reader import open_bundle
    from neffbuild.runtime.kv.cache import allocate

    work = a.workdir
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "ckpt" / "mxfp4"
    if not (ckpt / "config.json").is_file():
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "real_width_ckpt.py"), str(work / "ckpt"),
                        "--layers", str(a.layers)], check=True)
    recipe = recipe_for("bundle-mxfp4", ckpt, work, [1, 4], a.ctx)
    bundles = {}
    for form, native in (("native ops", True), ("traced torch form", False)):
        tag = "native" if native else "torch"
        bundles[form] = compile_bundle(recipe, work / f"out-{tag}", work / f"cache-{tag}", native)
        assert uses_op(bundles[form]) == native, form
    opened = {form: open_bundle(path, preload=True) for form, path in bundles.items()}
    first = next(iter(opened.values()))
    cfg = GptOssConfig.from_hf_dict(first.graph_inputs.model_config)
    kv = allocate(first.kv_layout)
    for buffer in kv:
        buffer.normal_()
    bw = copy_bandwidth()
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(a.rounds):
        for b in (1, 4):
            for form, bundle in opened.items():
                plan, args = step_args(bundle, b, a.context, kv)
                fn = bundle.artifact(plan.label)
                with torch.no_grad():
                    times.setdefault((form, b), []).append(_median(lambda fn=fn, args=args: fn(*args), a.repeat))
    load = os.getloadavg()[0]
    print(f"machine: {machine()}; one thread; copy bandwidth {bw / 1e9:.2f} GB/s; {a.layers} layers at GPT-OSS-20B "
          f"width, MXFP4 experts, bf16 weights and KV; context {a.context}; medians of {a.repeat} steps, "
          f"{a.rounds} rounds alternating; load average {load:.2f}\n")
    print("| form | batch | step | tokens/s | bytes per step | GB/s read | of copy bandwidth |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for (form, b), ts in times.items():
        step = statistics.median(ts)
        nbytes = step_bytes(cfg, ENGINES["bundle-mxfp4"][2], b, a.context)
        rows.append({"form": form, "batch": b, "step_s": step, "rounds_s": ts, "bytes": nbytes})
        print(f"| {form} | {b} | {step * 1e3:.1f} ms | {b / step:.2f} | {nbytes / 1e9:.3f} GB | "
              f"{nbytes / step / 1e9:.2f} | {nbytes / step / bw:.0%} |")
    for b in (1, 4):
        ratio = statistics.median(times[("traced torch form", b)]) / statistics.median(times[("native ops", b)])
        print(f"batch {b}: the native ops' step is x{ratio:.2f} the speed of the traced form's")
    (work / "mxfp4_step.json").write_text(json.dumps({"rows": rows, "copy_bandwidth": bw, "load": load}, indent=1))


if __name__ == "__main__":
    main()
