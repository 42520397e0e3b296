"""GPT-OSS mixture of experts: top-k router with bias, softmax over the chosen, clamped SwiGLU.

An expert-parallel rank holds a slice of the experts; the combine across ranks is the
caller's (the architecture's decode graph).

Expert weights come dense ([E, out, in] tensors) or MXFP4 (``Mxfp4``: the checkpoint's blocks
and scales, kept packed). Packed experts are decoded where they are read: in decode, only
the rows of the experts the router picked (``packed_dot``), inside the product-and-sum, so a
compiled step reads 4.25 bits a weight; in a host engine's eager prefill (``native.eager_experts``),
the picked rows again, through the C loop; in other eager code, each expert that got tokens once.
"""

import contextlib
import contextvars
import functools
from typing import NamedTuple

import torch

from neffbuild.runtime import (
    native,
    native_q8,  # noqa: F401 - registers the opt-in integer ops the traced graph may call
)
from neffbuild.runtime.native import e2m1, e8m0, matmul_dtype, packed_dot

# On while a CPU graph is traced for AOTInductor (compiler/backends/inductor.py): the graph then calls the runtime's
# native ops (runtime/native.py) for picked packed experts and bf16 linears, as it calls oneDNN's matmuls.
_NATIVE = contextvars.ContextVar("neffbuild_native_cpu_ops", default=False)
# The numeric forms the native ops take (recipe model.expert_kernel / head_kernel / attn_kernel): set by the decode
# module while it runs, read only where ``native_on``; exact unless a recipe opts in to int8 (runtime/native_q8.py).
_FORMS = contextvars.ContextVar("neffbuild_kernel_forms", default=())
DENSE_TOKENS = 64  # from this many tokens on (prefill): expert by expert over its tokens (see moe)
# Eager, below DENSE_TOKENS: the indexed product materialises N x k x out x in values (MXFP4: as int32 codes and
# floats); above this many, expert by expert instead. A chunk of 16 tokens at GPT-OSS-20B's width would be 1.1e9
# values (over 10 GB: a host engine's prefill chunk after a prefix-cache hit); the tiny test models stay far below.
EAGER_INDEXED_VALUES = 1 << 26
# Eager, with the native kernels (a host engine's prefill: ``native.eager_experts``): packed experts run the C loop
# row by row (``mxfp4_dot``, reading only the picked rows' bytes) up to this many (token, expert) rows, expert by
# expert (``_grouped``: each routed expert decoded whole) above. GPT-OSS-20B width, one thread, AVX2: 64 tokens
# 0.39 s a layer against 4.2, 512 tokens 3.0 s against 5.3 (docs/benchmarks.md "Eager prefill's experts").
EAGER_NATIVE_ROWS = 2048


class Mxfp4(NamedTuple):
    """One expert weight [E, out, in] as MXFP4: blocks [E, out, in/32, 16] uint8 (two E2M1 nibbles a byte, low
    first), scales [E, out, in/32] uint8."""

    blocks: torch.Tensor
    scales: torch.Tensor

    def pick(self, idx) -> "Mxfp4":
        """The experts ``idx`` (as ``w[idx]`` picks them from a dense tensor), still packed."""
        return Mxfp4(self.blocks[idx], self.scales[idx])

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, groups, half = self.blocks.shape
        return (*lead, groups * half * 2)


def dequantize(w: Mxfp4, dtype: torch.dtype) -> torch.Tensor:
    """[..., G, 16] blocks and [..., G] scales -> [..., G * 32] in ``dtype`` (exact: E2M1 x 2^k fits bfloat16)."""
    b = w.blocks.to(torch.int32)
    codes = torch.stack([b & 0x0F, b >> 4], dim=-1)  # [..., G, 16, 2]: the low nibble is the earlier value
    values = e2m1(codes) * e8m0(w.scales)[..., None, None]
    return values.flatten(-3).to(dtype)


def rows(w, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The chosen experts' weights ``w[idx]`` as values: a dense tensor indexed, or packed rows decoded."""
    return dequantize(w.pick(idx), dtype) if isinstance(w, Mxfp4) else w[idx]


@contextlib.contextmanager
def native_cpu_ops():
    """Inside: picked MXFP4 experts call ``torch.ops.neffbuild.mxfp4_dot`` (a table-lookup C kernel on the CPU,
    docs/benchmarks.md "Real width") instead of tracing ``packed_dot``'s arithmetic, which inductor's CPU code
    runs at about ten float ops a weight, and bfloat16 linears call ``neffbuild::bf16_linear`` (``native_on``: the
    architecture's LM head and attention projections). Only AOTInductor's CPU graphs use it: another backend
    cannot call a custom op, and the eager reference stays plain torch."""
    token = _NATIVE.set(True)
    try:
        yield
    finally:
        _NATIVE.reset(token)


def native_on() -> bool:
    """True inside ``native_cpu_ops`` (a CPU graph being traced for AOTInductor)."""
    return _NATIVE.get()


@contextlib.contextmanager
def kernel_forms(forms: dict):
    """Inside: the native ops take ``forms`` ({"expert_kernel": "int8", "head_kernel": "int8", "attn_kernel": "int8"},
    any left out for exact). Only a graph traced with ``native_cpu_ops`` changes: the eager reference and other
    backends stay exact."""
    token = _FORMS.set(tuple(forms.items()))
    try:
        yield
    finally:
        _FORMS.reset(token)


def native_form(name: str) -> str:
    """``exact`` or ``int8``: the form of native op ``name`` (expert_kernel, head_kernel, attn_kernel) in the graph
    traced now."""
    return dict(_FORMS.get()).get(name, "exact") if native_on() else "exact"


def _dot(x: torch.Tensor, w, idx: torch.Tensor, eager_native: bool = False) -> torch.Tensor:
    """x [N, 1 or k, in] times the picked experts' weights [N, k, out, in]: [N, k, out]. ``eager_native``: the C
    loop run eagerly (``_eager_native``)."""
    if isinstance(w, Mxfp4):
        if native_form("expert_kernel") == "int8":
            return torch.ops.neffbuild.mxfp4_q8_dot(x, w.blocks, w.scales, idx)
        if native_on() or eager_native:
            return torch.ops.neffbuild.mxfp4_dot(x, w.blocks, w.scales, idx)
        return packed_dot(x, w, idx)
    return (x[:, :, None, :] * w[idx]).sum(-1)


def whole(w, dtype: torch.dtype) -> torch.Tensor:
    """Every held expert's weights as values [E, out, in]."""
    return dequantize(w, dtype) if isinstance(w, Mxfp4) else w


def swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gate_up [..., 2I] interleaved (gate at even, up at odd columns) -> [..., I]."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def moe(
    x: torch.Tensor,  # [N, H]
    router_w: torch.Tensor,  # [E, H]
    router_b: torch.Tensor,  # [E]
    gate_up_w,  # [E, 2I, H]: [out, in], the reduction axis contiguous (a tensor, or Mxfp4)
    gate_up_b: torch.Tensor,  # [E, 2I]
    down_w,  # [E, H, I] (a tensor, or Mxfp4)
    down_b: torch.Tensor,  # [E, H]
    top_k: int,
    alpha: float,
    limit: float,
    first_expert: torch.Tensor | None = None,  # [1] global id of gate_up_w[0] when it holds a slice
) -> torch.Tensor:
    """Routes over all E experts (router_w); applies the experts it holds. With ``first_expert``
    the expert weights are one EP rank's slice and the other experts' terms are zero (the EP
    combine sums them across ranks)."""
    logits = x @ router_w.t() + router_b  # [N, E]
    top_val, top_idx = torch.topk(logits, top_k, dim=-1)  # [N, k]
    weights = torch.softmax(top_val, dim=-1)  # [N, k]
    eager_native = _eager_native(x, gate_up_w, top_k)
    if x.shape[0] >= DENSE_TOKENS or (_indexed_values(x, gate_up_w, top_k) > EAGER_INDEXED_VALUES and not traced(x)):
        if traced(x):
            return _dense(x, router_w.shape[0], top_idx, weights, gate_up_w, gate_up_b, down_w, down_b, alpha, limit,
                          first_expert)
        if not eager_native:
            return _grouped(x, top_idx, weights, gate_up_w, gate_up_b, down_w, down_b, alpha, limit, first_expert)
    if first_expert is not None:
        local = top_idx - first_expert  # [N, k]
        held = (local >= 0) & (local < gate_up_w.shape[0])
        top_idx = local.clamp(0, gate_up_w.shape[0] - 1)
        weights = weights * held
    # Product-and-sum with the stacked weights indexed by top_idx (not einsum, whose batched matmul needs
    # the chosen experts copied out first): compiled, the lookup sits inside the loop over H (then I), and
    # with the weights [out, in] each output is one dot product over a contiguous weight row (vectorised
    # along it), not an accumulator over rows 2I apart (docs/benchmarks.md: x0.6-0.8 of that loop's time).
    # MXFP4: the chosen rows decoded inside the same loops (packed_dot), so only their bytes are read.
    h = _dot(x[:, None, :], gate_up_w, top_idx, eager_native) + gate_up_b[top_idx]  # [N, k, 2I]
    h = swiglu(h, alpha, limit)  # [N, k, I]
    out = _dot(h, down_w, top_idx, eager_native) + down_b[top_idx]  # [N, k, H]
    return (out * weights.unsqueeze(-1)).sum(1)


def _eager_native(x: torch.Tensor, gate_up_w, top_k: int) -> bool:
    """Whether packed experts run the C loop eagerly here: a host engine's prefill (``native.eager_experts``, the
    kernels loaded) on the CPU, not traced, at most ``EAGER_NATIVE_ROWS`` (token, expert) rows."""
    return (isinstance(gate_up_w, Mxfp4) and x.device.type == "cpu" and x.shape[0] * top_k <= EAGER_NATIVE_ROWS
            and native.eager_experts_on() and not traced(x))


def _indexed_values(x: torch.Tensor, gate_up_w, top_k: int) -> int:
    """How many values the indexed product of the gate/up projection materialises when run eagerly."""
    out, n_in = gate_up_w.shape[1], x.shape[-1]
    return x.shape[0] * top_k * out * n_in


def traced(x: torch.Tensor) -> bool:
    """True while a graph is being traced (export, dynamo, ``torch.jit.trace``: the Neuron compiler's trace runs the
    module on real tensors): shapes that depend on the routing cannot be traced."""
    from torch._guards import detect_fake_mode

    return torch.compiler.is_compiling() or torch.jit.is_tracing() or detect_fake_mode([x]) is not None


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype x's matmuls run in here: ``runtime.native.matmul_dtype`` (float32 for bfloat16 where oneDNN has no
    fast bf16 kernel) for CPU tensors run eagerly or traced into an AOTInductor CPU graph (``native_on``); x's own
    dtype on other devices and in other backends' graphs (a Neuron graph traced on an AVX2 build host keeps bf16)."""
    if x.device.type != "cpu" or (traced(x) and not native_on()):
        return x.dtype
    return matmul_dtype(x.dtype)


def _grouped(x, top_idx, weights, gate_up_w, gate_up_b, down_w, down_b, alpha, limit, first_expert):
    """Eager form for many tokens (prefill): each held expert runs two matmuls over the tokens that chose it,
    its weights decoded (MXFP4: ``decode_eager``) one expert at a time. The indexed product-and-sum (``moe``)
    compiles to loops that read the chosen experts in place, but run eagerly it materialises ``[N, k, H, 2I]``
    (0.87 s per layer at N = 400, H = I = 256, top 2 of 8); ``_dense`` runs every expert on every token, E / k
    times the routed work (x8 at GPT-OSS's top 4 of 32) and every expert decoded at once.

    bfloat16 runs in float32 where oneDNN has no fast bf16 matmul (``matmul_dtype``): the weights widened exactly,
    the sums in float32, the result rounded to bfloat16 once."""
    E = gate_up_w.shape[0]
    local = top_idx if first_expert is None else top_idx - first_expert  # [N, k]: ids in the held slice
    cdt = compute_dtype(x)
    xc = x.to(cdt)
    out = torch.zeros(x.shape, dtype=cdt)
    for e in torch.unique(local[(local >= 0) & (local < E)]).tolist():
        tok, slot = (local == e).nonzero(as_tuple=True)
        w1, w2 = (decode_eager(w.pick(e), cdt) if isinstance(w, Mxfp4) else w[e].to(cdt) for w in (gate_up_w, down_w))
        h = swiglu(xc[tok] @ w1.t() + gate_up_b[e].to(cdt), alpha, limit)
        out.index_add_(0, tok, (h @ w2.t() + down_b[e].to(cdt)) * weights[tok, slot, None].to(cdt))
    return out.to(x.dtype)


def decode_eager(w: Mxfp4, dtype: torch.dtype) -> torch.Tensor:
    """``dequantize`` for eager code, the same values: a byte's two bfloat16 values are one int32 word of a
    256-entry table, so decoding is one gather and one scale multiply (exact: a power of two), about 23x
    ``dequantize``'s arithmetic on a 2,880 x 5,760 expert. Graphs keep the arithmetic (a bit cast does not trace
    into every backend, and inductor vectorises the arithmetic)."""
    fast = native.decode_bf16(w.blocks, w.scales)  # the C loop, where built: the same values
    if fast is not None:
        return fast.to(dtype)
    values = _pair_words()[w.blocks.int()].view(torch.bfloat16)  # [..., G, 32]
    values = values.mul_(e8m0(w.scales).to(torch.bfloat16)[..., None])
    return values.flatten(-2).to(dtype)


@functools.cache
def _pair_words() -> torch.Tensor:
    """[256] int32: byte b's two E2M1 values as bfloat16, the low nibble's first (``decode_eager``'s table)."""
    codes = torch.arange(256)
    return torch.stack([e2m1(codes & 0x0F), e2m1(codes >> 4)], dim=-1).to(torch.bfloat16).view(torch.int32).flatten()


def _dense(x, experts, top_idx, weights, gate_up_w, gate_up_b, down_w, down_b, alpha, limit, first_expert):
    """Traced form for many tokens: every held expert on every token as one batched matmul, each term scaled
    by its routing weight (zero where the token did not choose the expert), so the graph's shapes do not
    depend on the routing; each expert's weights are read once, in place."""
    N, E = x.shape[0], gate_up_w.shape[0]  # E: the experts held (all ``experts``, or one EP rank's slice)
    routed = torch.zeros(N, experts, dtype=x.dtype).scatter(1, top_idx, weights.to(x.dtype))  # weight or 0
    if first_expert is not None:
        routed = routed.index_select(1, torch.arange(E, device=x.device) + first_expert)  # [N, E]: the held slice
    gate_up_w, down_w = whole(gate_up_w, x.dtype), whole(down_w, x.dtype)
    h = torch.bmm(x[None].expand(E, N, x.shape[1]), gate_up_w.transpose(1, 2)) + gate_up_b[:, None, :]  # [E, N, 2I]
    out = torch.bmm(swiglu(h, alpha, limit), down_w.transpose(1, 2)) + down_b[:, None, :]  # [E, N, H]
    return (out * routed.t()[..., None]).sum(0)
