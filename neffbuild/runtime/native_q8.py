"""The integer forms of the native CPU ops, opt-in recipe options (``model.expert_kernel: int8``,
``model.head_kernel: int8``, ``model.attn_kernel: int8``; recipe/dtype_rules.py) because they change the numbers;
the float forms in ``native.py`` stay the default. C loops in ``native_cpu.c``; every input checked here before a
pointer reaches C.

``torch.ops.neffbuild.mxfp4_q8_dot(x, blocks, scales, idx)``: ``mxfp4_dot``'s arguments and result, computed as
llama.cpp's CPU MXFP4 kernels do: x quantized per 32-value block to int8 with one float scale (``quantize_q8``),
E2M1 codes looked up doubled (integers) with a byte shuffle, an exact integer dot product a block (AVX512-VNNI
``vpdpbusd`` on two blocks a 512-bit register, AVX2 ``vpmaddubsw`` + ``vpmaddwd``, or a plain loop) and the
block's scales in float; at
batch > 1 each expert's block is decoded once for every token routed to it. The torch form ``q8_packed_dot`` (the
same integer sums) is its fallback and oracle. Error against the exact form: each block's activations move by at
most half a quantization step (max|x_block| / 254 a value).

``torch.ops.neffbuild.q8_head(x, w)``: the bf16 LM head read as int8 with one float scale a row (8 bits and 4 bytes
a row: fewer than Q8_0's 8.5 bits a weight), greedy-exact; see ``q8_head``.

``torch.ops.neffbuild.q8_linear(x, w)``: ``bf16_linear`` with w read as int8 the same way (the attention
projections), lossy; the quantized weights of both ops are made once and kept (``_quantized``).
"""

from __future__ import annotations

import collections
import ctypes
import threading
from typing import NamedTuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from neffbuild.runtime import native

TWICE_E2M1 = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.float32)


def quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x float32 [..., G * 32] -> (q int8 [..., G * 32] in x's order, d float32 [..., G]): d = max|block| / 127,
    q = round-half-even(x * (127 / max|block|)), as the C loop computes them (the same float32 operations); a block
    with a non-finite value has d NaN and q 0, an all-zero block d 0."""
    blocks = x.float().unflatten(-1, (-1, 32))
    amax = blocks.abs().amax(-1)
    finite = blocks.isfinite().all(-1)
    inv = torch.where(finite & (amax > 0), torch.full_like(amax, 127.0) / amax, 0.0)  # (127 / t is 127 * (1 / t))
    q = torch.where(finite[..., None], torch.round(blocks * inv[..., None]), 0.0).to(torch.int8)
    d = torch.where(finite, amax / 127.0, torch.nan)
    return q.flatten(-2), d


def q8_packed_dot(x: torch.Tensor, w, idx: torch.Tensor) -> torch.Tensor:
    """The integer form in torch ops: x [N, 1 or k, in], the experts ``idx`` [N, k] of ``w`` (blocks, scales) ->
    [N, k, out] in x's dtype. Each block's sum of q times twice-E2M1 is an integer below 2^16, exact in float32."""
    blocks, scales = w
    q, d = quantize_q8(x)  # [N, k', in], [N, k', G]
    b = blocks[idx].long()  # [N, k, out, G, 16]
    codes = torch.stack([TWICE_E2M1[b & 0x0F], TWICE_E2M1[b >> 4]], dim=-1).flatten(-2)  # [N, k, out, G, 32]
    qb = q.float().unflatten(-1, (-1, 32))[:, :, None]  # [N, k', 1, G, 32]
    isum = (codes * qb).sum(-1)  # [N, k, out, G]: exact integers
    half = torch.where(scales[idx] == 255, torch.nan, torch.exp2(scales[idx].float() - native.SCALE_BIAS - 1))
    return (isum * (half * d[:, :, None])).sum(-1).to(x.dtype)


@torch.library.custom_op("neffbuild::mxfp4_q8_dot", mutates_args=())
def mxfp4_q8_dot(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    native.check(x, blocks, scales, idx)
    lib = native.library() if x.device.type == "cpu" else None
    if lib is None:
        return q8_packed_dot(x, (blocks, scales), idx)
    return mxfp4_q8_native(lib, x, blocks, scales, idx).to(x.dtype)


@mxfp4_q8_dot.register_fake
def _(x, blocks, scales, idx):
    native.check_shapes(x, blocks, scales, idx)
    return x.new_empty(idx.shape[0], idx.shape[1], blocks.shape[1])


def mxfp4_q8_native(lib: ctypes.CDLL, x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
                    idx: torch.Tensor) -> torch.Tensor:
    """The C loop of ``lib`` (any of its paths) on checked inputs (``native.check``): float32 [N, k, out]."""
    xf = x.to(torch.float32).contiguous()
    blocks, scales = blocks.contiguous(), scales.contiguous()
    ids = idx.to(torch.int64).contiguous()
    (n, k), (E, out, groups, _) = ids.shape, blocks.shape
    y = torch.empty(n, k, out, dtype=torch.float32)
    op, p = "mxfp4_q8_dot", native._pointer
    if lib.neffbuild_mxfp4_q8_dot(p(op, "x", xf, torch.float32, x.shape), xf.shape[1],
                                  p(op, "blocks", blocks, torch.uint8, (E, out, groups, 16)),
                                  p(op, "scales", scales, torch.uint8, (E, out, groups)),
                                  p(op, "idx", ids, torch.int64, (n, k)), n, k, out, groups,
                                  p(op, "out", y, torch.float32, (n, k, out)), torch.get_num_threads()):
        raise MemoryError(f"{op}: no memory for the quantized copy of x {tuple(x.shape)}")
    return y


def quantize_native(lib: ctypes.CDLL, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The C quantizer on float32 [rows, G * 32]: (q int8 in the C layout, each block's even values then its odd
    ones; d [rows, G])."""
    xf = x.to(torch.float32).contiguous()
    rows, n_in = xf.shape
    if n_in % 32:
        raise ValueError(f"quantize_native: x's width must be whole 32-value blocks, got {n_in}")
    q, d = torch.empty(rows, n_in, dtype=torch.int8), torch.empty(rows, n_in // 32, dtype=torch.float32)
    op, p = "quantize_native", native._pointer
    lib.neffbuild_q8_quantize(p(op, "x", xf, torch.float32, (rows, n_in)), rows, n_in // 32,
                              p(op, "q", q, torch.int8, (rows, n_in)), p(op, "d", d, torch.float32, d.shape))
    return q, d


# ---- weights read as int8 rows: the LM head (q8_head) and the attention projections (q8_linear) ----

_ROWS_CACHE = 1024  # quantized weights kept: per open bundle an LM head and two projections a layer (49 at 24 layers)
_ROWS: collections.OrderedDict = collections.OrderedDict()
_ROWS_LOCK = threading.Lock()


class _Rows(NamedTuple):
    q: torch.Tensor
    s: torch.Tensor
    finite: bool
    probe: torch.Tensor  # 16 of the weight's rows as int16 bits (a NaN weight compares equal to itself)
    storage: StorageWeakRef  # the weight's memory: expired once it is freed (its address may then be reused)


def _check_rows(op: str, x: torch.Tensor, w: torch.Tensor) -> None:
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or x.dim() != 2 or w.dim() != 2 \
            or x.shape[1] != w.shape[1]:
        raise ValueError(f"{op}: x [M, K] and w [N, K] in bfloat16 expected, got {x.dtype} {tuple(x.shape)} "
                         f"and {w.dtype} {tuple(w.shape)}")
    native._one_device(op, x=x, w=w)


def quantize_rows(lib: ctypes.CDLL, w: torch.Tensor, op: str = "quantize_rows") -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 [V, K] -> (q int8 [V, K], s float32 [V]): s = max|row| / 127, q = round-half-even(w * 127 / max|row|);
    a row with a non-finite weight has s NaN."""
    wc = w.contiguous()
    (V, K), p = wc.shape, native._pointer
    q, s = torch.empty(V, K, dtype=torch.int8), torch.empty(V, dtype=torch.float32)
    lib.neffbuild_q8_rows(p(op, "w", wc, torch.bfloat16, (V, K)), V, K, p(op, "q", q, torch.int8, (V, K)),
                          p(op, "s", s, torch.float32, (V,)), torch.get_num_threads())
    return q, s


def _quantized(lib: ctypes.CDLL, w: torch.Tensor, op: str):
    """(q, s, finite) of the weight ``w``, quantized once and kept (an artifact passes the same constants every step,
    as new views of the same memory): keyed by address, shape and strides, every (rows / 16)-th row compared each
    call (a weight rebound in place is quantized again; a strided view, one op: 49 calls a 24-layer step). An entry
    holds a weak reference to the weight's memory, not the weight: a closed bundle's weights are freed, and their
    entries dropped at the next miss."""
    key = (w.data_ptr(), tuple(w.shape), tuple(w.stride()))
    probe = w[:: max(1, w.shape[0] // 16)].view(torch.int16)
    with _ROWS_LOCK:
        hit = _ROWS.get(key)
        if hit is not None and not hit.storage.expired() and torch.equal(probe, hit.probe):
            _ROWS.move_to_end(key)
            return hit.q, hit.s, hit.finite
        for gone in [k for k, entry in _ROWS.items() if entry.storage.expired()]:
            del _ROWS[gone]
        q, s = quantize_rows(lib, w, op)
        _ROWS[key] = _Rows(q, s, bool(s.isfinite().all()), probe.clone(),
                           StorageWeakRef(w.untyped_storage()))
        while len(_ROWS) > _ROWS_CACHE:
            _ROWS.popitem(last=False)
        return q, s, _ROWS[key].finite


def _int8_rows(op: str, x: torch.Tensor, w: torch.Tensor, rescores: bool = False):
    """What ``q8_linear`` and ``q8_head`` do first: check x and w, then (lib, q, s) of w quantized, or None where the
    exact form (``native.bf16_linear``) runs instead: no C kernels, a weight not finite, or (``rescores``) no C loop
    of the exact form to re-score with (oneDNN's matmul is the exact form there)."""
    _check_rows(op, x, w)
    native._no_meta(op, x=x, w=w)
    lib = native.library() if x.device.type == "cpu" else None
    if lib is None or (rescores and not lib.bf16_path):
        return None
    q, s, finite = _quantized(lib, w, op)
    return (lib, q, s) if finite else None


def q8_matmul(lib: ctypes.CDLL, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, op: str = "q8_matmul"):
    """a [M, N] float32 = s * (q @ x), float sums (C, any of its paths; tiled at M > 1), on checked inputs."""
    xc = x.contiguous()
    (m, k), n, p = xc.shape, q.shape[0], native._pointer
    y = torch.empty(m, n, dtype=torch.float32)
    if lib.neffbuild_q8_linear(p(op, "x", xc, torch.bfloat16, (m, k)), m, p(op, "q", q, torch.int8, (n, k)),
                               p(op, "s", s, torch.float32, (n,)), n, k, p(op, "out", y, torch.float32, (m, n)),
                               torch.get_num_threads()):
        raise MemoryError(f"{op}: no memory for a float32 copy of x {tuple(x.shape)}")
    return y


@torch.library.custom_op("neffbuild::q8_linear", mutates_args=())
def q8_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K].T with w read as int8 and one float32 scale a row (``model.attn_kernel: int8``: the
    attention projections), 1 byte a weight and 4 a row where ``neffbuild::bf16_linear`` reads 2 a weight: float32
    sums of s * (q x), rounded to bfloat16 as bf16_linear's result is (with AVX512-VNNI or AVX2 exact integer sums
    of q and x rounded to int16, ``head16``). Lossy, with no re-scoring: each weight moves by at most half a step,
    max|w_row| / 254 (``q8_head``'s bound without its re-scoring). The exact op runs where the C kernels are not
    built or a weight is not finite."""
    quantized = _int8_rows("q8_linear", x, w)
    if quantized is None:
        return native.bf16_linear(x, w)
    lib, q, s = quantized
    return rows_matmul(lib, x, q, s, "q8_linear")[0].to(torch.bfloat16)


@q8_linear.register_fake
def _(x, w):
    _check_rows("q8_linear", x, w)
    return x.new_empty(x.shape[0], w.shape[0])


# ---- the int8 head: greedy-exact by re-scoring ----

def bound_factor(n_in: int) -> float:
    """c(K) of the head's error bound (``q8_head``) for rows of K = ``n_in`` weights."""
    u = 2.0 ** -24
    gamma = n_in * u / (1 - n_in * u)
    return 0.5 + 2.0 ** -12 + 256 * gamma


def bound_terms(x: torch.Tensor, ex: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """(x1c [M] float64, tiny) of the head's bound e = (s x1c + tiny) (1 + 2^-30) (``q8_head``'s proof):
    x1c = |x|_1 c(K) + K 2^-117, tiny = K 2^-120 + 2^-126 max |x|_1 over the rows of x. With ``ex`` [M] (the
    integer form, ``head16``: sum |x - d qx| of each row's int16 rounding), x1c also takes
    ex (127 (1 + 2^-18) + 2^-16)."""
    n_in = x.shape[-1]
    x1 = x.double().abs().sum(-1)  # [M]
    x1c = x1 * bound_factor(n_in) + n_in * 2.0 ** -117
    if ex is not None:
        x1c = x1c + ex.double() * (127 * (1 + 2.0 ** -18) + 2.0 ** -16)
    return x1c, n_in * 2.0 ** -120 + 2.0 ** -126 * float(x1.max())


def head_bound(s: torch.Tensor, x: torch.Tensor, ex: torch.Tensor | None = None) -> torch.Tensor:
    """e [M, V] float64: |exact-form float32 logit - int8 logit| <= e for every row (``q8_head``'s proof); ``ex``:
    the integer form's (``head16``)."""
    x1c, tiny = bound_terms(x, ex)
    return (s.double()[None, :] * x1c[:, None] + tiny) * (1 + 2.0 ** -30)


def head16(lib: ctypes.CDLL, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, op: str = "q8_head"):
    """The int8 head in integers (``neffbuild_q8_head16``: x rows quantized to int16, one scale a row; the weights
    widened to int16 once and one multiply-add of pairs a row of x, AVX512-VNNI ``vpdpwssd`` 32 weights or AVX2
    ``vpmaddwd`` 16, where the float forms convert them in two to five instructions; four weight rows at a time
    from the four quarters of the head, four read streams): (a [M, N] float32, ex [M] float64, qx int16 [M, K],
    d float32 [M]) on checked inputs, or None where it does not run (neither: the float forms)."""
    if not lib.q8_head16:
        return None
    xc = x.contiguous()
    (m, k), n, p = xc.shape, q.shape[0], native._pointer
    y, qx = torch.empty(m, n), torch.empty(m, k, dtype=torch.int16)
    d, ex = torch.empty(m), torch.empty(m, dtype=torch.float64)
    status = lib.neffbuild_q8_head16(p(op, "x", xc, torch.bfloat16, (m, k)), m, p(op, "q", q, torch.int8, (n, k)),
                                     p(op, "s", s, torch.float32, (n,)), n, k, p(op, "out", y, torch.float32, (m, n)),
                                     p(op, "qx", qx, torch.int16, (m, k)), p(op, "d", d, torch.float32, (m,)),
                                     p(op, "ex", ex, torch.float64, (m,)), torch.get_num_threads())
    if status == 1:
        raise MemoryError(f"{op}: no memory for the quantized copy of x {tuple(x.shape)}")
    return (y, ex, qx, d) if status == 0 else None


def rows_matmul(lib: ctypes.CDLL, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, op: str):
    """(a [M, N] float32, ex [M] float64 or None): ``head16``'s integer form where it runs (x rounded to int16 first,
    ex = sum |x - x^| a row), else ``q8_matmul``'s float sums (ex None)."""
    wide = head16(lib, x, q, s, op)
    return (wide[0], wide[1]) if wide is not None else (q8_matmul(lib, x, q, s, op), None)


@torch.library.custom_op("neffbuild::q8_head", mutates_args=())
def q8_head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [V, K].T as ``neffbuild::bf16_linear`` gives it where it counts for greedy decoding: the argmax
    of every row of the result (first index on ties), and the values of the rows near it, are bit for bit the
    exact form's; the other values are the int8 logits (each within ``head_bound`` of the exact one, and strictly
    below the row's maximum). For greedy serving (and greedy speculative verification); a sampler sees approximate
    logits outside the top rows.

    The bound. Row r is quantized with s = max|w_r| / 127, q_t = round(w_t / s), so |w_t - s q_t| <= s (1/2 + 2^-15)
    (the float32 reciprocal moves w / s by at most 3 ulps of 127) and |w_t| <= 127 s (1 + 2^-24). The int8 logit
    a = fl(s * fl(sum_t q_t x_t)) has exact products (7 by 8 significant bits) and at most K roundings in the sum:
    |a - s sum q x| <= s 127 |x|_1 (gamma_K + 2^-24), gamma_K = K 2^-24 / (1 - K 2^-24); where the sums run on
    AVX-512 BF16 dot products (batch > 1), each of the K FMAs may also read a subnormal x as zero and flush a
    subnormal input or result (under 127 2^-126 + 2 2^-126 < 2^-118 each): s K 2^-118 (1 + 2^-24) more. The exact
    form's float32 sum f of products w x (exact: 8 by 8 bits) has |f - sum w x| <= gamma_K sum |w| |x| <=
    128 s gamma_K |x|_1, plus, where AVX-512 BF16 reads subnormal inputs as zero and flushes subnormal results, at
    most 2^-126 |x|_1 (subnormal weights), s K 2^-119 (subnormal x) and K 2^-125. So |f - a| <= e =
    s (|x|_1 c(K) + K 2^-117) + K 2^-120 + 2^-126 |x|_1 with c(K) = 1/2 + 2^-12 + 256 gamma_K (``bound_factor``,
    ``bound_terms``: |x|_1 of the last term taken as the largest over the rows of x), computed in float64 and
    widened by 2^-30 for its own roundings. The exact form returns R(f), R = rounding to bfloat16 (via float32),
    monotone. With M = max_r (a_r - e_r) <= max_r f_r, row r is re-scored when R(a_r + e_r) >= R(M); any other row has
    R(f_r) <= R(a_r + e_r) < R(M) <= R(max f), so it is neither the argmax nor tied with it, and its returned R(a_r)
    is below the maximum too. The re-scored rows (every row whose exact value can reach the maximum, ties included)
    run the exact form's own C loop on its own inputs (``neffbuild_bf16_linear_at``), so they are bit-identical.

    With AVX512-VNNI or AVX2 (``head16``) each row of x is quantized to int16 with one scale, x^ = d qx, and
    a = fl32((s d) S) with S = sum q qx an exact integer: |s sum q x - s sum q x^| <= 127 s ex, ex = sum |x - x^|
    (double, widened by 2^-18), and the two double products and the rounding to float32 move a by at most
    2^-23 |a| <= 2^-23 127 s (|x|_1 + ex): inside c(K)'s 127 (gamma_K + 2^-24) for |x|_1, and 2^-16 ex for the rest.
    Both go into x1c (``bound_terms`` with ``ex``); the float sums' term of c(K) is then slack.

    Where the exact form is oneDNN's matmul (no C kernel, or its plain path), or a weight or x is not finite, the
    exact form itself runs."""
    quantized = _int8_rows("q8_head", x, w, rescores=True)
    if quantized is None or not bool(x.isfinite().all()):
        return native.bf16_linear(x, w)
    lib, q, s = quantized
    a, ex = rows_matmul(lib, x, q, s, "q8_head")
    rows, cols = candidates(lib, a, s, x, ex)
    out = a.bfloat16()
    out[rows, cols] = bf16_at(lib, x, w, rows, cols).bfloat16()
    return out


@q8_head.register_fake
def _(x, w):
    _check_rows("q8_head", x, w)
    return x.new_empty(x.shape[0], w.shape[0])


def candidates(lib: ctypes.CDLL, a: torch.Tensor, s: torch.Tensor, x: torch.Tensor,
               ex: torch.Tensor | None = None):
    """(rows, cols) of the values ``q8_head`` re-scores: in each row of x, every logit with R(a + e) >= R(M),
    M = max(a - e), e = ``head_bound`` (the same float64 operations), picked by one C pass over the row instead of a
    dozen float64 torch passes over the vocabulary (about 2 ms a step at 201,088 rows)."""
    (m, n), op, p = a.shape, "q8_head", native._pointer
    x1c, tiny = bound_terms(x, ex)
    x1c = x1c.contiguous()
    cap = 64 * m
    while True:
        rows, cols = torch.empty(cap, dtype=torch.int64), torch.empty(cap, dtype=torch.int64)
        got = lib.neffbuild_q8_pick(p(op, "a", a, torch.float32, (m, n)), m, n, p(op, "s", s, torch.float32, (n,)),
                                    p(op, "x1c", x1c, torch.float64, (m,)), tiny,
                                    p(op, "rows", rows, torch.int64, (cap,)), p(op, "cols", cols, torch.int64, (cap,)),
                                    cap)
        if got <= cap:
            return rows[:got], cols[:got]
        cap = got


def bf16_at(lib: ctypes.CDLL, x: torch.Tensor, w: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor):
    """``bf16_native(lib, x, w)[rows, cols]`` (float32), computing only those values, bit for bit."""
    xc, wc = x.contiguous(), w.contiguous()
    (m, k), n, op, p = xc.shape, wc.shape[0], "q8_head", native._pointer
    r, c = rows.to(torch.int64).contiguous(), cols.to(torch.int64).contiguous()
    if r.numel() and (int(r.min()) < 0 or int(r.max()) >= m or int(c.min()) < 0 or int(c.max()) >= n):
        raise ValueError(f"q8_head: picked values must lie in [0, {m}) x [0, {n})")
    y = torch.empty(r.numel(), dtype=torch.float32)
    if lib.neffbuild_bf16_linear_at(p(op, "x", xc, torch.bfloat16, (m, k)), m, p(op, "w", wc, torch.bfloat16, (n, k)),
                                    n, k, p(op, "rows", r, torch.int64, (r.numel(),)),
                                    p(op, "cols", c, torch.int64, (r.numel(),)), r.numel(),
                                    p(op, "out", y, torch.float32, (r.numel(),))):
        raise MemoryError("q8_head: no memory to re-score the top rows")
    return y
