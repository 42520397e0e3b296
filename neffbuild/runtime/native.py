"""The native ops compiled CPU graphs call, as they call oneDNN's matmuls: ``neffbuild::mxfp4_dot`` (the packed
expert product) and ``neffbuild::bf16_linear`` (the bf16 linears: LM head, qkv and o projections; below).

``torch.ops.neffbuild.mxfp4_dot(x, blocks, scales, idx)``: x [N, 1 or k, in] times the rows of the experts
``idx`` [N, k] picked from MXFP4 weights (blocks [E, out, in/32, 16] uint8, scales [E, out, in/32] uint8) ->
[N, k, out] in x's dtype; the same product as ``packed_dot`` below, which stays the traced form for every other
backend and the eager reference, and is the op's fallback.

Inductor's CPU code decodes E2M1 with about ten float ops a weight (no register table lookup); the C kernel here
(``native_cpu.c``) decodes 16 codes with one byte shuffle. It is built for the host's CPU (``-march=native``, or
``settings.native_cflags()``) when a bundle whose artifacts call the ops is opened (``prepare``, from
``open_bundle``), not in the first decode step, into the cache folder's ``kernels/`` by ``native_build.py``'s rules:
one build per key under a lock, checked on a known answer before it is published, its sha256 checked before it is
loaded, refused from a folder another user could write. Every failure to build or load (no compiler, a compile
error or timeout, a refused or unwritable folder that a private build cannot replace either) runs the torch forms
(``packed_dot``, the matmul: the same values, slower) and says so in one line on stderr, once a process. The op
lives in the runtime because every process that runs an artifact must have it registered before the artifact's
first call (``runtime.bundle.loaders`` imports this module).

Whatever reaches the C code is checked first (every tensor's device, dtype and shape, expert ids in range; the
fake kernels check the same shapes): a bad input is a ``ValueError`` naming the argument, never a read outside
the weights or of a tensor with no memory (the meta device).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import math
import sys
import threading

import torch

from neffbuild.runtime import native_build

SCALE_BIAS = 127
FALLBACK = "MXFP4 experts run the slower torch form and the bf16 linears oneDNN's matmul"
_LOCK = threading.Lock()


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.neffbuild_mxfp4_dot.restype = ctypes.c_int
    lib.neffbuild_mxfp4_dot.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    lib.neffbuild_mxfp4_dot_bf16.restype = ctypes.c_int
    lib.neffbuild_mxfp4_dot_bf16.argtypes = lib.neffbuild_mxfp4_dot.argtypes
    lib.neffbuild_mxfp4_decode_bf16.restype = None
    lib.neffbuild_mxfp4_decode_bf16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                                ctypes.c_void_p, ctypes.c_int]
    lib.neffbuild_mxfp4_vectorised.restype = ctypes.c_int
    lib.neffbuild_bf16_linear.restype = ctypes.c_int
    lib.neffbuild_bf16_linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                          ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    lib.neffbuild_bf16_native.restype = ctypes.c_int
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.neffbuild_mxfp4_q8_dot.restype = ctypes.c_int
    lib.neffbuild_mxfp4_q8_dot.argtypes = lib.neffbuild_mxfp4_dot.argtypes
    lib.neffbuild_q8_quantize.restype = None
    lib.neffbuild_q8_quantize.argtypes = [ptr, i64, i64, ptr, ptr]
    lib.neffbuild_q8_rows.restype = None
    lib.neffbuild_q8_rows.argtypes = [ptr, i64, i64, ptr, ptr, ctypes.c_int]
    lib.neffbuild_q8_linear.restype = ctypes.c_int
    lib.neffbuild_q8_linear.argtypes = [ptr, i64, ptr, ptr, i64, i64, ptr, ctypes.c_int]
    lib.neffbuild_q8_pick.restype = i64
    lib.neffbuild_q8_pick.argtypes = [ptr, i64, i64, ptr, ptr, ctypes.c_double, ptr, ptr, i64]
    lib.neffbuild_q8_head16.restype = ctypes.c_int
    lib.neffbuild_q8_head16.argtypes = [ptr, i64, ptr, ptr, i64, i64, ptr, ptr, ptr, ptr, ctypes.c_int]
    lib.neffbuild_q8_head16_qmax.restype = ctypes.c_int
    lib.neffbuild_q8_head16_qmax.argtypes = [i64]
    lib.neffbuild_bf16_linear_at.restype = ctypes.c_int
    lib.neffbuild_bf16_linear_at.argtypes = [ptr, i64, ptr, i64, i64, ptr, ptr, i64, ptr]
    lib.q8_path = int(lib.neffbuild_q8_path())  # 2: VNNI dpbusd, 1: AVX2 maddubs, 0: plain (native_q8.py)
    lib.q8_head16 = int(lib.neffbuild_q8_head16_path())  # native_q8.head16: 2 VNNI, 1 AVX2, 0 none
    lib.bf16_path = int(lib.neffbuild_bf16_native())  # 2: AVX-512 BF16, 1: AVX2 + FMA, 0: plain (the matmul runs)
    return lib


_LOADED: dict[tuple[str, ...] | None, ctypes.CDLL | None] = {}


def _obtain(flags: tuple[str, ...] | None) -> ctypes.CDLL | None:
    lib, note = native_build.obtain(flags)
    if note:
        print(f"neffbuild: native kernels: {note}" + ("" if lib else f": {FALLBACK}"), file=sys.stderr, flush=True)
    if lib is None:
        return None
    try:
        return _bind(lib)
    except AttributeError as exc:  # a library without a symbol this code calls: fall back, never fail a step
        print(f"neffbuild: native kernels: {exc}: {FALLBACK}", file=sys.stderr, flush=True)
        return None


def library(flags: tuple[str, ...] | None = None) -> ctypes.CDLL | None:
    """The built kernels, loaded (once a process for each ``flags``; default ``settings.native_cflags()``); None
    (with one line on stderr) where they cannot be built or loaded: the torch forms run then."""
    key = None if flags is None else tuple(flags)
    if key in _LOADED:  # every op call: no lock once loaded
        return _LOADED[key]
    with _LOCK:
        if key not in _LOADED:
            _LOADED[key] = _obtain(key)
        return _LOADED[key]


_EAGER_EXPERTS = contextvars.ContextVar("neffbuild_eager_native_experts", default=False)


@contextlib.contextmanager
def eager_experts():
    """Inside: eager MXFP4 expert products (a host engine's prefill, ``runtime.bundle.eager``) call ``mxfp4_dot``
    where the kernels are built (``eager_experts_on``). Only the runtime's prefill turns it on: eager decode (the
    reference compiled steps are checked against) and the models' own calls stay plain torch."""
    token = _EAGER_EXPERTS.set(True)
    try:
        yield
    finally:
        _EAGER_EXPERTS.reset(token)


def eager_experts_on() -> bool:
    """True inside ``eager_experts`` where the C kernels load (never builds them: ``prepare`` did, or the torch
    forms run)."""
    return _EAGER_EXPERTS.get() and _LOADED.get(None) is not None


def prepare() -> bool:
    """Build (or find) and load the kernels now, so that no decode step compiles: ``open_bundle`` calls it (through
    ``loaders.prepare_native``) for a bundle whose artifacts call the ops. True when the C kernels will run."""
    return library() is not None


# asked once, at import: a call of the op inside a trace (torch.jit.trace, the Neuron compiler's) would be recorded
_FAST_BF16_MATMUL = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def matmul_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype CPU matmuls of ``dtype`` operands run in: float32 for bfloat16 where oneDNN has no fast bf16
    kernel (``torch.ops.mkldnn._is_mkldnn_bf16_supported``; without AVX-512 torch's bf16 matmul ran at 10.7 GFLOP/s
    one core against float32's 80, docs/benchmarks.md "Real width", and a decode step's attention, 64 small batched
    matmuls a layer, 12 ms against 0.7 in float32 at a 1,024-token context), else ``dtype``. Eager code (prefill's
    MoE and attention) and the decode graph's attention over its gathered KV ask it when they run or are traced:
    a graph compiled on such a host keeps float32 there."""
    if dtype == torch.bfloat16 and not _FAST_BF16_MATMUL:
        return torch.float32
    return dtype


def _one_device(op: str, **tensors: torch.Tensor) -> None:
    """Every tensor on the first one's device (a weight left on the meta device while x is on the CPU would
    otherwise reach the CPU kernel)."""
    (first, x), *rest = tensors.items()
    for name, t in rest:
        if t.device != x.device:
            raise ValueError(f"{op}: {name} is on {t.device} and {first} on {x.device}; put them on one device")


def _no_meta(op: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device.type == "meta":
            raise ValueError(f"{op}: {name} is on the meta device (no memory to read); load the weights first")


def check_shapes(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, idx: torch.Tensor) -> None:
    """The facts that need no values (dtypes, shapes, one device): the real kernel and the fake one alike."""
    if not x.dtype.is_floating_point:
        raise ValueError(f"mxfp4_dot: x must be a float tensor, got {x.dtype}")
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
    _one_device("mxfp4_dot", x=x, blocks=blocks, scales=scales, idx=idx)


def check(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, idx: torch.Tensor) -> None:
    """Every fact the C loop trusts, checked: a ValueError naming the argument otherwise."""
    check_shapes(x, blocks, scales, idx)
    _no_meta("mxfp4_dot", x=x, blocks=blocks, scales=scales, idx=idx)
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= blocks.shape[0]):
        raise ValueError(f"mxfp4_dot: expert ids must lie in [0, {blocks.shape[0]}), got "
                         f"[{int(idx.min())}, {int(idx.max())}]")


def _pointer(op: str, name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple) -> int:
    """``t``'s address for C, after the copies: on the CPU, of ``dtype`` and ``shape``, contiguous."""
    if t.device.type != "cpu" or t.dtype != dtype or tuple(t.shape) != tuple(shape) or not t.is_contiguous():
        raise ValueError(f"{op}: {name} reached the C call as {t.dtype} {tuple(t.shape)} on {t.device} "
                         f"(contiguous: {t.is_contiguous()}); {dtype} {tuple(shape)} contiguous on the CPU expected")
    return t.data_ptr()


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
    TorchScript, the neuron backend's tracer, cannot record); byte 255 is NaN, as the OCP MX spec defines E8M0's
    0xFF (2^128 would be inf in float32), and as the C kernel has it."""
    return torch.where(scales == 255, torch.nan, torch.exp2(scales.float() - SCALE_BIAS))


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
    return mxfp4_native(lib, x, blocks, scales, idx).to(x.dtype)


def mxfp4_native(lib: ctypes.CDLL, x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
                 idx: torch.Tensor) -> torch.Tensor:
    """The C loop of ``lib`` on checked inputs (``check``): float32 [N, k, out]. bf16 x on a build with AVX-512 BF16
    runs the bf16 loop (x as it is, one dot-product instruction a group); any other x is widened to float32. The
    torch form when the C side could not allocate its scratch."""
    blocks, scales = blocks.contiguous(), scales.contiguous()
    ids = idx.to(torch.int64).contiguous()
    (n, k), (E, out, groups, _) = ids.shape, blocks.shape
    y = torch.empty(n, k, out, dtype=torch.float32, device="cpu")
    op = "mxfp4_dot"
    rest = (_pointer(op, "blocks", blocks, torch.uint8, (E, out, groups, 16)),
            _pointer(op, "scales", scales, torch.uint8, (E, out, groups)),
            _pointer(op, "idx", ids, torch.int64, (n, k)), n, k, out, groups,
            _pointer(op, "out", y, torch.float32, (n, k, out)), torch.get_num_threads())
    if x.dtype == torch.bfloat16 and lib.bf16_path == 2:
        xb = x.contiguous()
        status = lib.neffbuild_mxfp4_dot_bf16(_pointer(op, "x", xb, torch.bfloat16, x.shape), xb.shape[1], *rest)
    else:
        xf = x.to(torch.float32).contiguous()
        status = lib.neffbuild_mxfp4_dot(_pointer(op, "x", xf, torch.float32, x.shape), xf.shape[1], *rest)
    return y if status == 0 else packed_dot(x, (blocks, scales), idx).float()


def decode_bf16(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor | None:
    """MXFP4 rows (blocks uint8 [..., G, 16], scales uint8 [..., G]) decoded to bfloat16 [..., G * 32] by the C
    loop: the values ``e2m1`` times ``e8m0`` rounded to bfloat16 give, about 10x the torch gather's speed (eager
    prefill decodes each routed expert once). None where the kernels are not built or the tensors are not plain
    CPU uint8 of matching shapes (the caller decodes in torch then)."""
    lib = library() if blocks.device.type == "cpu" and scales.device.type == "cpu" else None
    if lib is None or blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() < 2 \
            or blocks.shape[-1] != 16 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        return None
    *lead, groups, _ = blocks.shape
    rows = math.prod(lead)
    b, s = blocks.contiguous(), scales.contiguous()
    out = torch.empty(*lead, groups * 32, dtype=torch.bfloat16)
    op = "mxfp4_decode"
    lib.neffbuild_mxfp4_decode_bf16(_pointer(op, "blocks", b, torch.uint8, tuple(blocks.shape)),
                                    _pointer(op, "scales", s, torch.uint8, tuple(scales.shape)), rows, groups,
                                    _pointer(op, "out", out, torch.bfloat16, tuple(out.shape)),
                                    torch.get_num_threads())
    return out


@mxfp4_dot.register_fake
def _(x, blocks, scales, idx):
    check_shapes(x, blocks, scales, idx)
    return x.new_empty(idx.shape[0], idx.shape[1], blocks.shape[1])


def _check_linear(x: torch.Tensor, w: torch.Tensor) -> None:
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or x.dim() != 2 or w.dim() != 2 \
            or x.shape[1] != w.shape[1]:
        raise ValueError(f"bf16_linear: x [M, K] and w [N, K] in bfloat16 expected, got {x.dtype} "
                         f"{tuple(x.shape)} and {w.dtype} {tuple(w.shape)}")
    _one_device("bf16_linear", x=x, w=w)


@torch.library.custom_op("neffbuild::bf16_linear", mutates_args=())
def bf16_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w[N, K].T in bfloat16 (float32 sums, the result rounded to bfloat16 as a bf16 matmul's is): the
    LM head over the vocabulary, where oneDNN's bf16 GEMV reads at about two thirds of the copy bandwidth and, on
    CPUs without AVX-512 BF16, torch's bf16 matmul of a few rows runs at about 10 GFLOP/s (docs/benchmarks.md "Real
    width"). The C loop takes it with AVX-512 BF16 (one dot-product instruction per 32 weights) or AVX2 + FMA (the
    weights widened by a shift, float32 FMAs); elsewhere the matmul."""
    _check_linear(x, w)
    _no_meta("bf16_linear", x=x, w=w)
    lib = library() if x.device.type == "cpu" else None
    if lib is None or not lib.bf16_path:
        return x @ w.t()
    return bf16_native(lib, x, w).to(torch.bfloat16)


def bf16_native(lib: ctypes.CDLL, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The C loop of ``lib`` (any of its paths, the plain one included) on checked inputs: float32 [M, N]."""
    xc, wc = x.contiguous(), w.contiguous()
    (m, k), n = x.shape, w.shape[0]
    y = torch.empty(m, n, dtype=torch.float32, device="cpu")
    if lib.neffbuild_bf16_linear(_pointer("bf16_linear", "x", xc, torch.bfloat16, (m, k)), m,
                                 _pointer("bf16_linear", "w", wc, torch.bfloat16, (n, k)), n, k,
                                 _pointer("bf16_linear", "out", y, torch.float32, (m, n)), torch.get_num_threads()):
        raise MemoryError(f"bf16_linear: no memory for a float32 copy of x {tuple(x.shape)}")
    return y


@bf16_linear.register_fake
def _(x, w):
    _check_linear(x, w)
    return x.new_empty(x.shape[0], w.shape[0])


