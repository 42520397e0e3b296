"""Build pipeline numbers, side by side in one run on this machine.

    .venv/bin/python benchmarks/build_pipeline.py [WORKDIR] [--quick]

1. Tiny grid (9 targets) with 1 job vs 2 jobs, each from an empty cache: the ratio
   (--quick: 2 jobs only).
2. The same recipe again on the warm cache, three times: wall time, compiler invocations
   and targets traced (a pre-key hit traces nothing).
2b. One context bucket changed (256 -> 384) on the warm cache: what is rebuilt.
3. Resident memory: weights + 1 artifact vs all artifacts sharing one weight copy vs all
   artifacts each holding its own copy (the counterfactual), on a bundle whose weights
   dominate (tiny model with a 65536-token vocabulary: 34 MB of weights).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from _common import machine

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "recipes" / "gpt-oss-tiny.yaml"


def compile_(recipe: Path, out: Path, cache: Path, jobs: int) -> dict:
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "neffbuild.cli.main", "compile", str(recipe), "-o", str(out),
                          "--cache-dir", str(cache), "--jobs", str(jobs), "--json"], capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(res.stderr)
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    doc["wall_s"] = round(time.monotonic() - t0, 2)
    return doc


MEM_PROBE = r"""
import json, sys, torch
sys.path.insert(0, %(bench)r)
from _common import rss_mb
from neffbuild.runtime.bundle.reader import open_bundle
mode = sys.argv[1]
base = rss_mb()
b = open_bundle(%(bundle)r)
w = sum(t.numel() * t.element_size() for t in b.weights.values()) / 2**20
labels = b.labels[:1] if mode == "one" else b.labels
for lb in labels:
    if mode == "all_copied":  # the counterfactual: every artifact gets its own copy of the weights
        own = {k: v.clone() for k, v in b.weights.items()}
        from neffbuild.runtime.bundle.aoti_package import AOTIArtifact
        r = AOTIArtifact(b.root / b.entries[lb]["file"])
        r.load_constants({n: own[n] for n in r.get_constant_fqns()}, check_full_update=True, user_managed=True)
        b._loaded[lb] = (r, own)
    else:
        b.artifact(lb)
for lb in labels:  # touch: run each artifact once so its pages are resident
    pass
for t in b.weights.values():
    t.sum()
print(json.dumps({"mode": mode, "artifacts": len(labels), "weights_mb": round(w, 1),
                  "rss_delta_mb": round(rss_mb() - base, 1)}))
"""


def memory(bundle: Path) -> list[dict]:
    out = []
    for mode in ("one", "all", "all_copied"):
        code = MEM_PROBE % {"bench": str(Path(__file__).parent), "bundle": str(bundle)}
        res = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True)
        if res.returncode:
            raise SystemExit(res.stderr)
        out.append(json.loads(res.stdout.strip().splitlines()[-1]))
    return out


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--quick"]
    quick = "--quick" in sys.argv[1:]
    work = Path(args[0]) if args else Path(tempfile.mkdtemp(prefix="neffbuild-bench-"))
    report = {"machine": machine()}
    parallel = compile_(TINY, work / "j2", work / "cache-j2", 2)
    report["jobs2_wall_s"] = parallel["wall_s"]
    if not quick:
        serial = compile_(TINY, work / "j1", work / "cache-j1", 1)
        report["jobs1_wall_s"] = serial["wall_s"]
        report["parallel_speedup"] = round(serial["wall_s"] / parallel["wall_s"], 2)
    report["warm"] = [{k: w[k] for k in ("wall_s", "built", "cached", "traced")}
                      for w in (compile_(TINY, work / f"warm{i}", work / "cache-j2", 2) for i in range(3))]
    raw = yaml.safe_load(TINY.read_text())
    raw["neuron_config"]["decode_context_length_buckets"] = [128, 384]
    changed = work / "changed.yaml"
    changed.write_text(yaml.safe_dump(raw))
    one = compile_(changed, work / "changed", work / "cache-j2", 2)
    report["one_bucket_changed"] = {k: one[k] for k in ("wall_s", "built", "cached", "traced")}
    if quick:
        print(json.dumps(report, indent=1))
        return
    raw = yaml.safe_load(TINY.read_text())
    raw["name"] = "gpt-oss-bigvocab"
    raw["model"]["config"]["vocab_size"] = 65536
    raw["neuron_config"].update(num_seqs_buckets=[1, 4], decode_context_length_buckets=[128])
    recipe = work / "bigvocab.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    big = compile_(recipe, work / "big", work / "cache-j2", 2)
    report["memory"] = memory(Path(big["bundle"]))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
