"""Paged attention, old kernels against new, each compiled alone with AOTInductor, timed interleaved.

    nice -n -5 .venv/bin/python benchmarks/attention_kernels.py [--old-ref main] [--repeat 60]

The old kernels are ``kernels/`` of git ref ``--old-ref`` (default main), extracted into a
temp folder and imported beside this tree's; both read the same cache, table and queries, and
their outputs are compared. One thread. Prints a markdown table (median ms per call).
Shapes: the kv-dominant full layer (B1, 8 heads x 64, T 2048), a GQA-8 layer (gpt-oss's
group, 16/2 heads x 64, T 1024) and the tiny model's (B4, H4/h2, d16, T512) at query length 1
(decode) and 4 (target_spec), fp32, bf16 and packed FP8 K (FP8 V).
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# name, B, q, H, h, d, T, cache dtype ("fp8" = packed FP8 K and FP8 V bytes)
CASES = [
    ("kv-dominant full, B1 q1 8x64, T2048, fp32", 1, 1, 8, 8, 64, 2048, torch.float32),
    ("kv-dominant full, B1 q1 8x64, T8192, fp32", 1, 1, 8, 8, 64, 8192, torch.float32),
    ("kv-dominant full, B1 q1 8x64, T16384, fp32", 1, 1, 8, 8, 64, 16384, torch.float32),
    ("tiny B4 q1 H4/h2 d16 T512, fp32", 4, 1, 4, 2, 16, 512, torch.float32),
    ("tiny B4 q1, bf16", 4, 1, 4, 2, 16, 512, torch.bfloat16),
    ("tiny B4 q1, packed FP8 K", 4, 1, 4, 2, 16, 512, "fp8"),
    ("GQA 4 (vs_transformers' shape), B4 q1 H8/h2 d32 T512, fp32", 4, 1, 8, 2, 32, 512, torch.float32),
    ("GQA 8, B1 q1 H16/h2 d64 T1024, fp32", 1, 1, 16, 2, 64, 1024, torch.float32),
    ("GQA 8, B1 q1, packed FP8 K", 1, 1, 16, 2, 64, 1024, "fp8"),
    ("tiny B4 q4 (target_spec), fp32", 4, 4, 4, 2, 16, 512, torch.float32),
    ("tiny B4 q4, bf16", 4, 4, 4, 2, 16, 512, torch.bfloat16),
    ("tiny B4 q4, packed FP8 K", 4, 4, 4, 2, 16, 512, "fp8"),
]
BLOCK = 16
POOL = 1031  # prime, more blocks than any table names (T 16384 at block 16: 1024)


def load_kernels(tree: Path):
    """paged_attention of the kernel package under ``tree`` (a folder ``kernels/`` whose modules import each
    other as ``kernels.*``), imported as its own module objects, kept alive."""
    for name in [m for m in sys.modules if m == "kernels" or m.startswith("kernels.")]:
        del sys.modules[name]
    sys.path.insert(0, str(tree))
    try:
        return importlib.import_module("kernels.attention").paged_attention
    finally:
        sys.path.remove(str(tree))
        for name in [m for m in sys.modules if m == "kernels" or m.startswith("kernels.")]:
            del sys.modules[name]


def kernel_tree(dest: Path, ref: str | None) -> Path:
    """The kernels of git ``ref`` (None: this checkout) as a standalone ``kernels`` package under ``dest``.
    They live at ``neffbuild/kernels`` (older refs: a top-level ``kernels/``); imports are rewritten to match."""
    dest.mkdir(parents=True)
    if ref is None:
        shutil.copytree(ROOT / "neffbuild" / "kernels", dest / "kernels")
    else:
        for folder in ("neffbuild/kernels", "kernels"):
            res = subprocess.run(["git", "-C", str(ROOT), "archive", ref, folder], capture_output=True)
            if res.returncode == 0:
                subprocess.run(["tar", "-x", "-C", str(dest)], input=res.stdout, check=True)
                if folder != "kernels":
                    (dest / folder).rename(dest / "kernels")
                break
        else:
            raise SystemExit(f"--old-ref {ref}: no kernels folder in that ref")
    for f in (dest / "kernels").rglob("*.py"):
        f.write_text(f.read_text().replace("neffbuild.kernels", "kernels"))
    return dest


class Attn(nn.Module):
    def __init__(self, fn, packed: bool):
        super().__init__()
        self.fn, self.packed = fn, packed

    def forward(self, q, cache, table, q_pos, offset, sinks):
        return self.fn(q, cache, table, q_pos, offset, sinks, 0.125, None, self.packed)


def inputs(B, S, H, h, d, T, dtype):
    g = torch.Generator().manual_seed(0)
    W = T // BLOCK
    qdt = torch.float32 if dtype == "fp8" else dtype
    q = torch.randn(B, S, H, d, generator=g).to(qdt)
    cache = torch.randn(2, POOL, h, BLOCK, d, generator=g)
    # FP8: the packed layout's bytes (any FP8 bytes are valid K/V values)
    cache = cache.to(torch.float8_e4m3fn).view(torch.uint8) if dtype == "fp8" else cache.to(dtype)
    table = torch.stack([torch.randperm(POOL - 1, generator=g)[:W] + 1 for _ in range(B)])  # distinct blocks
    q_pos = (T - S + torch.arange(S))[None].expand(B, S).contiguous()
    return q, cache, table, q_pos, torch.zeros(B, dtype=torch.long), torch.randn(H, generator=g)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old-ref", default="main", help="git ref whose kernels/ is the 'old' side (default main)")
    ap.add_argument("--repeat", type=int, default=60, help="interleaved rounds (default 60)")
    ap.add_argument("--only", default="", help="run only the cases whose name contains this text")
    args = ap.parse_args()
    from benchmarks._common import machine
    from neffbuild.compiler.backends.inductor import InductorBackend
    from neffbuild.runtime.bundle.loaders import load_inductor

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="attn-bench-"))
    fns = {"old": load_kernels(kernel_tree(work / "old", args.old_ref)),
           "new": load_kernels(kernel_tree(work / "new", None))}
    backend = InductorBackend()
    print(f"{machine()}; load average at start {os.getloadavg()[0]:.2f}; old = {args.old_ref}, one thread\n")
    print("| case | old (ms) | new (ms) | new/old | max abs diff |")
    print("|---|---|---|---|---|")
    for i, (name, B, S, H, h, d, T, dtype) in enumerate(CASES):
        if args.only not in name:
            continue
        x = inputs(B, S, H, h, d, T, dtype)
        runners, outs = {}, {}
        for side, fn in fns.items():
            mod = Attn(fn, dtype == "fp8")
            out_dir = work / f"{side}-{i}"
            out_dir.mkdir()
            pt2 = backend.compile(backend.export(mod, x), out_dir)
            runners[side] = load_inductor(pt2, {}, {})
            outs[side] = runners[side](*x)[0]
        diff = (outs["new"].float() - outs["old"].float()).abs().max().item()
        samples = {side: [] for side in runners}
        for _ in range(args.repeat + 3):
            for side, r in runners.items():
                t0 = time.perf_counter()
                for _ in range(5):
                    r(*x)
                samples[side].append((time.perf_counter() - t0) / 5 * 1e3)
        old, new = (statistics.median(samples[s][3:]) for s in ("old", "new"))
        print(f"| {name} | {old:.3f} | {new:.3f} | {new / old:.2f} | {diff:.1e} |", flush=True)
    print(f"\nload average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
