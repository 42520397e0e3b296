"""What `verify`'s weight finiteness pass costs next to the sha256 pass it already makes over the same bytes.

    .venv/bin/python benchmarks/weights_finite.py [--gib 1] [--rounds 3]

Writes a safetensors file of ``--gib`` GiB of float32 tensors (the bundle stores fp32 weights, MXFP4 experts
dequantised), then times, interleaved over ``--rounds`` rounds, ``fsutil.sha256_file`` (what `verify` does
to every file) and ``weights_file.nonfinite`` (the finiteness pass). The file is read once first, so both run
from the page cache. The result scales linearly with the weight bytes: ``per_gib_s`` times a bundle's weights
(``neffbuild plan`` prints them per rank) is what the pass adds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _common import machine
from safetensors.torch import save_file

from neffbuild.fsutil import sha256_file
from neffbuild.runtime.bundle.weights_file import nonfinite


def main(gib: float, rounds: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "w.safetensors"
        n = int(gib * (1 << 30) / 4 / 8)
        save_file({f"t{i}": torch.randn(n) for i in range(8)}, str(path))
        sha256_file(path)  # warm the page cache
        sha, fin = [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            sha256_file(path)
            t1 = time.perf_counter()
            assert nonfinite(path) == []
            t2 = time.perf_counter()
            sha.append(t1 - t0)
            fin.append(t2 - t1)
        size = path.stat().st_size / (1 << 30)
    s, f = statistics.median(sha), statistics.median(fin)
    return {"machine": machine(), "torch_threads": torch.get_num_threads(), "gib": round(size, 3),
            "sha256_s": round(s, 3), "finite_s": round(f, 3), "finite_per_gib_s": round(f / size, 3),
            "finite_over_sha256": round(f / s, 3)}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    print(json.dumps(main(a.gib, a.rounds), indent=1))
