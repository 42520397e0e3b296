"""The native ops alone at GPT-OSS-20B's width: exact (float) forms against the int8 forms, per ISA path.

    nice -n -5 .venv/bin/python benchmarks/int8_kernels.py [--isas native,avx2,plain] [--vocab 201088] [--repeat 20]
        [--batches 1,4] [--no-head] [--no-experts]

Experts: gate_up (5,760 x 2,880) and down (2,880 x 2,880) of 32 MXFP4 experts, top 4, batch 1 and 4 (random
routing, the same for both forms; x in bf16 as a bf16 bundle passes it); ``neffbuild::mxfp4_dot`` against
``mxfp4_q8_dot``. Head: the vocabulary's bf16 GEMV (``bf16_linear``) against ``q8_head`` (int8 rows, the exact
re-scoring included), batch 1 and 4. Attention: the qkv (5,120 x 2,880) and o (2,880 x 4,096) projections,
``bf16_linear``'s C loop against ``q8_linear``'s (its cache lookup included, the dispatcher's call not), over
``--layers`` distinct weights in turn. Bytes
are what each form reads of its weights in its own encoding (MXFP4: 17 bytes a 32-value group of each picked
expert once; bf16 head and projections 2 bytes a weight, int8 rows 1 plus 4 a row), over the median time, beside
the copy bandwidth (a 256 MiB ``copy_`` into a buffer allocated once: bytes read / s). One thread. Prints a markdown
table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from neffbuild.runtime import native, native_q8  # noqa: E402

ISAS = {"native": ("-march=native",), "vnni": ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"),
        "avx2": ("-march=x86-64-v3",), "plain": ("-march=x86-64",)}
H, INTER, E, TOP_K = 2880, 2880, 32, 4
QKV, HEADS_D = 5120, 4096  # (64 query + 2 x 8 KV heads) x 64, and 64 x 64: GPT-OSS-20B's attention


def median_s(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(repeat: int) -> float:
    src = torch.ones(256 * 2**20, dtype=torch.uint8)
    dst = torch.empty_like(src)  # allocated once: the copy, not the page faults of a new buffer
    return src.numel() / median_s(lambda: dst.copy_(src), repeat)


def expert_rows(lib, batch: int, repeat: int) -> list[tuple]:
    g = torch.Generator().manual_seed(0)
    out = []
    for name, n_out, n_in in (("gate_up", 2 * INTER, H), ("down", H, INTER)):
        G = n_in // 32
        blocks = torch.randint(0, 256, (E, n_out, G, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(118, 130, (E, n_out, G), dtype=torch.uint8, generator=g)
        idx = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(batch)])
        # bf16, as a bf16 bundle's graph passes it: the exact form then runs its bf16 loop (AVX-512 BF16)
        x = torch.randn(batch, 1 if name == "gate_up" else TOP_K, n_in, generator=g).bfloat16()
        nbytes = len(set(idx.flatten().tolist())) * n_out * G * 17
        exact = median_s(lambda: native.mxfp4_native(lib, x, blocks, scales, idx), repeat)  # noqa: B023
        int8 = median_s(lambda: native_q8.mxfp4_q8_native(lib, x, blocks, scales, idx), repeat)  # noqa: B023
        out.append((f"{name} b{batch}", nbytes, exact, nbytes, int8))
    return out


def head_rows(lib, vocab: int, batch: int, repeat: int) -> list[tuple]:
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(vocab, H, generator=g) * 0.02).bfloat16()
    x = torch.randn(batch, H, generator=g).bfloat16()
    torch.ops.neffbuild.q8_head(x, w)  # quantizes the head once (kept)
    exact = median_s(lambda: native.bf16_native(lib, x, w), repeat)
    int8 = median_s(lambda: torch.ops.neffbuild.q8_head(x, w), repeat)
    return [(f"head V{vocab} b{batch}", vocab * H * 2, exact, vocab * (H + 4), int8)]


def attn_rows(lib, batch: int, repeat: int, layers: int) -> list[tuple]:
    """Each projection of ``layers`` layers in turn (one sweep timed, per layer reported): one layer's weights (24-30
    MB) would stay in a large L3 between calls, as a step's 24 layers' do not."""
    g = torch.Generator().manual_seed(2)
    out = []
    for name, n_out, n_in in (("qkv", QKV, H), ("o", H, HEADS_D)):
        ws = [(torch.randn(n_out, n_in, generator=g) * 0.02).bfloat16() for _ in range(layers)]
        x = torch.randn(batch, n_in, generator=g).bfloat16()

        def int8(ws=ws, x=x):
            for w in ws:
                q, s, _ = native_q8._quantized(lib, w, "q8_linear")
                native_q8.rows_matmul(lib, x, q, s, "q8_linear")[0].to(torch.bfloat16)

        def exact(ws=ws, x=x):
            for w in ws:
                native.bf16_native(lib, x, w).to(torch.bfloat16)

        out.append((f"{name} b{batch}", n_out * n_in * 2, median_s(exact, repeat) / layers, n_out * (n_in + 4),
                    median_s(int8, repeat) / layers))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--isas", default="native,avx2,plain", help=f"comma-separated, of: {', '.join(ISAS)}")
    ap.add_argument("--vocab", type=int, default=201088)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--no-head", action="store_true")
    ap.add_argument("--no-experts", action="store_true")
    ap.add_argument("--layers", type=int, default=8, help="distinct attention weights swept per timing")
    args = ap.parse_args()
    torch.set_num_threads(1)
    copy = copy_bandwidth(args.repeat)
    print(f"copy bandwidth (copy_, one thread): {copy / 1e9:.1f} GB/s read\n")
    print("| ISA path | op | exact ms | exact GB/s (% copy) | int8 ms | int8 GB/s (% copy) | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for isa in args.isas.split(","):
        lib = native.library(ISAS[isa])
        if lib is None:
            print(f"| {isa} | (no library) | | | | | |")
            continue
        label = f"{isa} (q8 {lib.q8_path}, bf16 {lib.bf16_path})"
        for b in (int(s) for s in args.batches.split(",")):
            rows = [] if args.no_experts else expert_rows(lib, b, args.repeat)
            if not args.no_head and lib.bf16_path:
                rows += head_rows(lib, args.vocab, b, args.repeat)
            if lib.bf16_path:
                rows += attn_rows(lib, b, args.repeat, args.layers)
            for name, eb, es, ib, is_ in rows:
                print(f"| {label} | {name} | {es * 1e3:.2f} | {eb / es / 1e9:.1f} ({100 * eb / es / copy:.0f}%) | "
                      f"{is_ * 1e3:.2f} | {ib / is_ / 1e9:.1f} ({100 * ib / is_ / copy:.0f}%) | x{es / is_:.2f} |",
                      flush=True)


if __name__ == "__main__":
    main()
