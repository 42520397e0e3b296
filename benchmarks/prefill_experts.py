"""One MoE layer of eager prefill at GPT-OSS-20B's width: the two forms a host engine's prefill can take.

    .venv/bin/python benchmarks/prefill_experts.py [--tokens 16,64,128,256] [--repeat 3]

32 MXFP4 experts (gate_up 5,760 x 2,880, down 2,880 x 2,880, random bytes and scales near 2^0), top 4, random
routing from a random router, x in bf16 as a bf16 bundle's prefill passes it, one thread. ``grouped``: the eager
reference's form (``kernels.moe._grouped``: each routed expert decoded whole, ``decode_eager``, and two matmuls
over its tokens, in ``matmul_dtype``); ``native``: the same ``moe`` inside ``native.eager_experts`` (what
runtime/bundle/eager.py's prefill sets: the picked rows through the C loop ``mxfp4_dot``, token by token). Prints
one line a token count: the median seconds of each, their ratio and the relative difference of the outputs,
with the host's ISA flags.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._common import machine  # noqa: E402
from benchmarks.int8_kernels import median_s  # noqa: E402
from neffbuild.kernels.moe import EAGER_NATIVE_ROWS, Mxfp4, moe  # noqa: E402
from neffbuild.runtime import native  # noqa: E402

E, H, INTER, TOP_K = 32, 2880, 2880, 4


def isa() -> str:
    flags = set(Path("/proc/cpuinfo").read_text().split())
    return " ".join(f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni") if f in flags)


def layer(seed: int = 0):
    g = torch.Generator().manual_seed(seed)

    def mx(out, n_in):
        return Mxfp4(torch.randint(0, 256, (E, out, n_in // 32, 16), dtype=torch.uint8, generator=g),
                     torch.randint(118, 124, (E, out, n_in // 32), dtype=torch.uint8, generator=g))

    bf16 = torch.bfloat16
    return ((torch.randn(E, H, generator=g) * 0.05).to(bf16), torch.zeros(E, dtype=bf16), mx(2 * INTER, H),
            (torch.randn(E, 2 * INTER, generator=g) * 0.01).to(bf16), mx(H, INTER),
            (torch.randn(E, H, generator=g) * 0.01).to(bf16), TOP_K, 1.702, 7.0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="16,64,128,256", help="prompt tokens in one prefill chunk (comma-separated)")
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    try:
        counts = [int(t) for t in a.tokens.split(",")]
    except ValueError:
        print(f"--tokens: {a.tokens!r} is not a comma-separated list of integers", file=sys.stderr)
        return 2
    if not counts or min(counts) < 1 or a.repeat < 1:
        print("--tokens: give counts of 1 or more; --repeat: 1 or more", file=sys.stderr)
        return 2
    if not native.prepare():
        print("the native kernels could not be built here: nothing to compare", file=sys.stderr)
        return 1
    torch.set_num_threads(1)
    args = layer()
    print(f"{machine()}; ISA: {isa()}; one thread; EAGER_NATIVE_ROWS {EAGER_NATIVE_ROWS}")
    for n in counts:
        x = (torch.randn(n, H, generator=torch.Generator().manual_seed(n)) * 0.5).to(torch.bfloat16)
        grouped = moe(x, *args)
        with native.eager_experts():
            fast = moe(x, *args)
            t_native = median_s(lambda x=x: moe(x, *args), a.repeat)
        t_grouped = median_s(lambda x=x: moe(x, *args), a.repeat)
        diff = float((fast.float() - grouped.float()).norm() / grouped.float().norm())
        note = "" if n * TOP_K <= EAGER_NATIVE_ROWS else " (above EAGER_NATIVE_ROWS: both grouped)"
        print(f"{n:5d} tokens: grouped {t_grouped:.3f} s, native {t_native:.3f} s a layer, x{t_grouped / t_native:.2f};"
              f" relative difference {diff:.1e}{note}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
