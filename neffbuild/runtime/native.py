"""The native ops compiled CPU graphs call, as they call oneDNN's matmuls: ``neffbuild::mxfp4_dot`` (the packed
expert product) and ``neffbuild::bf16_linear`` (the bf16 linears: LM head, qkv and o projections; below).

``torch.ops.neffbuild.mxfp4_dot(x, blocks, scales, idx)``: x [N, 1 or k, in] times the rows of the experts
``idx`` [N, k] picked from MXFP4 weights (blocks [E, out, in/32, 16] uint8, scales [E, out, in/32] uint8) ->
[N, k, out] in x's dtype; the same product as ``packed_dot`` below, which stays the traced form for every other
backend and the eager reference, and is the op's fallback.

Inductor's CPU code decodes E2M1 with about ten float ops a weight (no register table lookup); the C kernel here
(``native_cpu.c``) decodes 16 codes with one byte shuffle. It is built on first use with the host's C compiler
(``settings.c_compiler``) and ``-march=native`` into the cache folder's ``kernels/`` (keyed by the source, the
compiler and the CPU), so a serving host runs code for its own CPU; without a compiler the op runs
``packed_dot`` (same values, slower) and says so once. The op lives in the runtime because every process that
runs an artifact must have it registered before the artifact's first call (``runtime.bundle.loaders`` imports
this module).

Whatever reaches the C code is checked first (dtypes, shapes, expert ids in range): a bad input is a
``ValueError`` naming the argument, never a read outside the weights.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from neffbuild import settings

SOURCE = Path(__file__).with_name("native_cpu.c")
SCALE_BIAS = 127
FALLBACK = "MXFP4 experts run the slower torch form and the bf16 linears oneDNN's matmul"


def _cpu_identity() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [ln for ln in text.splitlines() if ln.startswith(("flags", "model name", "Features", "CPU part"))]
    return "\n".join(dict.fromkeys(lines))  # one line of each kind (every core repeats them)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernel, loaded; None (with one line on stderr) where no C compiler builds it."""
    cc = settings.c_compiler()
    if not cc:
        print(f"neffbuild: no C compiler (cc/gcc, or $CC): {FALLBACK}", file=sys.stderr)
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    flags = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c11", "-fopenmp"]  # OpenMP: torch's thread count
    key = hashlib.sha256("\0".join([SOURCE.read_text(), version, _cpu_identity(), *flags]).encode()).hexdigest()
    path = settings.cache_dir() / "kernels" / key[:24] / "native_cpu.so"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # built aside, then renamed: never half-written
            staged = Path(tmp) / path.name
            try:
                run = subprocess.run([cc, *flags, "-o", str(staged), str(SOURCE), "-lm"], capture_output=True,
                                     text=True, timeout=120)
                why = run.stderr.strip()[:300] if run.returncode != 0 else None
            except (OSError, subprocess.SubprocessError) as exc:
                why = str(exc)[:300]
            if why is not None:
                print(f"neffbuild: {cc} could not build {SOURCE.name} ({why}): {FALLBACK}", file=sys.stderr)
                return None
            os.replace(staged, path)
    lib = ctypes.CDLL(str(path))
    lib.neffbuild_mxfp4_dot.restype = None
    lib.neffbuild_mxfp4_dot.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    lib.neffbuild_mxfp4_vectorised.restype = ctypes.c_int
    lib.neffbuild_bf16_linear.restype = ctypes.c_int
    lib.neffbuild_bf16_linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                          ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    lib.neffbuild_bf16_native.restype = ctypes.c_int
    return lib


@functools.cache
def eager_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype eager CPU matmuls of ``dtype`` operands run in: float32 for bfloat16 where oneDNN has no fast bf16
    kernel (``torch.ops.mkldnn._is_mkldnn_bf16_supported``; without AVX-512 torch's bf16 matmul ran at 10.7 GFLOP/s
    one core against float32's 80, docs/benchmarks.md "Real width"), else ``dtype``. Eager code only (prefill's MoE
    and attention): a compiled graph keeps its dtypes."""
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.float32
    return dtype


def check(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, idx: torch.Tensor) -> None:
    """Every fact the C loop trusts, checked: a ValueError naming the argument otherwise."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"mxfp4_dot: blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() != 4 or blocks.shape[-1] != 16 or tuple(scales.shape) != tuple(blocks.shape[:3]):
        raise ValueError(f"mxfp4_dot: blocks [E, out, G, 16] and scales [E, out, G] expected, got "
                         f"{tuple(blocks.shape)} and {tuple(scales.shape)}")
    groups = blocks.shape[2]
    if x.dim() != 3 or x.shape[-1] != groups * 32:
        raise ValueError(f"mxfp4_dot: x must be [N, 1 or k, {groups * 32}], got {tuple(x.shape)}")
    if idx.dim() != 2 or idx.shape[0] != x.shape[0] or x.shape[1] not in (1, idx.shape[1]):
        raise ValueError(f"mxfp4_dot: idx must be [N, k] with N = {x.shape[0]} and x's second dim 1 or k, got "
                         f"idx {tuple(idx.shape)}, x {tuple(x.shape)}")
    if idx.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"mxfp4_dot: idx must be an integer tensor, got {idx.dtype}")
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= blocks.shape[0]):
        raise ValueError(f"mxfp4_dot: expert ids must lie in [0, {blocks.shape[0]}), got "
                         f"[{int(idx.min())}, {int(idx.max())}]")


def e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 nibbles (int32, 0..15) -> float32 values: the 16-entry table (0, 0.5, 1, 1.5, 2, 3, 4, 6, then the
    negatives) as exact float arithmetic, so a compiled graph needs no table constant and vectorises the decode.

    On the 3 magnitude bits f (0..7) the table is piecewise linear: f / 2 up to 4, slope 1 from 4 to 6, slope 2
    from 6 to 7; bit 3 is the sign (code 8 is -0.0). Float ops, not a bit cast: inductor's CPU code turns an
    int32 -> float32 bit cast into a scalar store-and-reload per vector, which cost 20-30 % of the decode."""
    f = (codes & 7).float()
    mag = 0.5 * f + 0.5 * torch.relu(f - 4) + torch.relu(f - 6)
    return mag * (1 - ((codes >> 2) & 2).float())


def e8m0(scales: torch.Tensor) -> torch.Tensor:
    """Scale bytes -> float32 2^(s - 127), exact (exp2 of an integer is a power of two; no dtype bit cast, which
    TorchScript, the neuron backend's tracer, cannot record)."""
    return torch.exp2(scales.float() - SCALE_BIAS)


def packed_dot(x: torch.Tensor, w, idx: torch.Tensor) -> torch.Tensor:
    """x [N, 1 or k, in] times the rows of the experts ``idx`` [N, k] picked from ``w`` (blocks, scales): [N, k, out]
    in x's dtype, in torch ops (the traced form, and the op's fallback and oracle), decoding each picked byte once.

    A byte holds two neighbouring values (low nibble first), so x is split once into its even and odd values
    (a cat: one small buffer) and each byte meets one of each; the group's scale multiplies its 32-value partial
    sum, not every value. Products and sums run in float32 (x times an E2M1 code is exact there)."""
    blocks, scales = w
    *lead, n_in = x.shape
    pairs = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1).float()  # [N, k', in]: even values, then odd
    pairs = pairs.view(*lead, 1, 2, n_in // 32, 16)  # [N, k', 1, 2, G, 16]
    b = blocks[idx].to(torch.int32)  # [N, k, out, G, 16]: the picked experts' bytes only
    part = (pairs[..., 0, :, :] * e2m1(b & 0x0F) + pairs[..., 1, :, :] * e2m1(b >> 4)).sum(-1)  # [N, k, out, G]
    return (part * e8m0(scales[idx])).sum(-1).to(x.dtype)


@torch.library.custom_op("neffbuild::mxfp4_dot", mutates_args=())
def mxfp4_dot(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    check(x, blocks, scales, idx)
    lib = library() if x.device.type == "cpu" else None
    if lib is None:
        return packed_dot(x, (blocks, scales), idx)
    xf = x.to(torch.float32).contiguous()
    blocks, scales = blocks.contiguous(), scales.contiguous()
    ids = idx.to(torch.int64).contiguous()
    n, k = ids.shape
    out = torch.empty(n, k, blocks.shape[1], dtype=torch.float32)
    lib.neffbuild_mxfp4_dot(xf.data_ptr(), xf.shape[1], blocks.data_ptr(), scales.data_ptr(), ids.data_ptr(), n, k,
                            blocks.shape[1], blocks.shape[2], out.data_ptr(), torch.get_num_threads())
    return out.to(x.dtype)


@mxfp4_dot.register_fake
def _(x, blocks, scales, idx):
    return x.new_empty(idx.shape[0], idx.shape[1], blocks.shape[1])


@torch.library.custom_op("neffbuild::bf16_linear", mutates_args=())
def bf16_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w[N, K].T in bfloat16 (float32 sums, the result rounded to bfloat16 as a bf16 matmul's is): the
    LM head over the vocabulary, where oneDNN's bf16 GEMV reads at about two thirds of the copy bandwidth and, on
    CPUs without AVX-512 BF16, torch's bf16 matmul of a few rows runs at about 10 GFLOP/s (docs/benchmarks.md "Real
    width"). The C loop takes it with AVX-512 BF16 (one dot-product instruction per 32 weights) or AVX2 + FMA (the
    weights widened by a shift, float32 FMAs); elsewhere the matmul."""
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or x.dim() != 2 or w.dim() != 2 \
            or x.shape[1] != w.shape[1]:
        raise ValueError(f"bf16_linear: x [M, K] and w [N, K] in bfloat16 expected, got {x.dtype} "
                         f"{tuple(x.shape)} and {w.dtype} {tuple(w.shape)}")
    lib = library() if x.device.type == "cpu" else None
    if lib is None or not lib.neffbuild_bf16_native():
        return x @ w.t()
    xc, wc = x.contiguous(), w.contiguous()
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
    if lib.neffbuild_bf16_linear(xc.data_ptr(), xc.shape[0], wc.data_ptr(), wc.shape[0], wc.shape[1], out.data_ptr(),
                                 torch.get_num_threads()):
        raise MemoryError(f"bf16_linear: no memory for a float32 copy of x {tuple(x.shape)}")
    return out.to(torch.bfloat16)


@bf16_linear.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[0])
