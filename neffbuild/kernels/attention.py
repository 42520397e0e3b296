"""Attention with learned sinks: dense (prefill) and paged over a block table (decode).

Sinks are one extra logit column per head, included in the softmax and dropped after it.
GQA: query heads are grouped ``[kv_heads, group]`` and share one K/V head.

The paged form reads each KV block once, in place: the scores are a product-and-sum over
``head_dim`` whose K operand is the cache indexed through the block table, and the value
sum is a product-and-sum over the table's slots whose V operand is indexed the same way.
Written as elementwise products and sums (not ``einsum``, which lowers to a batched matmul
that needs its operands materialised), the compiler fuses each table lookup into the loop
that consumes it, so no ``[B, h, T, d]`` copy of the gathered blocks is ever made
(tests/test_stepcost.py reads the generated code for one). Only the scores,
``[B, h, g, T]``, are a buffer (``g/d`` of the K bytes), and the value sum's per-block
partials, ``[B, h, g, W, d]`` (``g/bs`` of the V bytes): the value sum runs per block, then
over the blocks, so each V row is read once, every ``d`` lane while it is in L1. The softmax
divides after that sum (flash-decoding's order: max, exp, sum; normalise at the end).

That holds for a float cache read by at most ``ROWS_IN_PLACE`` query rows per KV head
(``g*q``: plain decode up to GQA 4). More rows (GQA 8, ``target_spec``) and an FP8 cache
keep the gathered copy: the compiled in-place form recomputes the table lookup, and for FP8
the byte decode, of each K and V element once per query row of its head, and on CPU that
cost 1.4x (GQA 8 q 1, and GQA 2 q 4, fp32) and 1.1-5x (FP8, g 2-8) the copy-once read,
where 1-4 rows ran 0.8-0.92x (docs/benchmarks.md, benchmarks/attention_kernels.py). The
copy decodes each FP8 byte once, in integer ops.
"""

from __future__ import annotations

import torch

from neffbuild.kernels.moe import compute_dtype
from neffbuild.runtime.kv.access import FP8, block_operand, gather_blocks

ROWS_IN_PLACE = 4  # query rows per KV head up to which the in-place read beats the copy on CPU (measured)


def _attend(q, k, v, mask, sinks, scale):
    """q [B, S, h, g, d]; k, v [B, h, T, d]; mask [B, S, T] (True = attend); sinks [h*g]."""
    B, S, h, g, d = q.shape
    logits = torch.einsum("bshgd,bhtd->bhgst", q, k) * scale  # [B, h, g, S, T]
    probs = _softmax_with_sinks(logits, mask[:, None, None], sinks)
    out = torch.einsum("bhgst,bhtd->bshgd", probs, v)  # [B, S, h, g, d]
    return out.reshape(B, S, h * g * d)


def _softmax_with_sinks(logits, mask, sinks):
    """Softmax over the last axis of logits [B, h, g, S, T] plus one sink column per head; the sink dropped."""
    B, h, g, S, _ = logits.shape
    logits = logits.masked_fill(~mask, float("-inf"))
    sink = sinks.view(1, h, g, 1, 1).expand(B, h, g, S, 1).to(logits.dtype)
    logits = torch.cat([logits, sink], dim=-1)
    return torch.softmax(logits - logits.amax(-1, keepdim=True), dim=-1)[..., :-1]


def sdpa_with_sinks(q, k, v, sinks, scale: float, window: int | None):
    """Dense causal attention over one sequence chunk (eager prefill). q [B, S, H, d]; k, v [B, S, h, d].

    bfloat16 runs in float32 where oneDNN has no fast bf16 matmul (``compute_dtype``): without AVX-512 the two
    batched matmuls of a 400-token GPT-OSS-20B layer took 1.6 s in bf16."""
    B, S, H, d = q.shape
    h = k.shape[2]
    pos = torch.arange(S)
    mask = pos[None, :] <= pos[:, None]  # [S, T]
    if window is not None:
        mask &= pos[None, :] > pos[:, None] - window
    dtype = q.dtype
    cdt = compute_dtype(q)
    q, k, v = (t.to(cdt) for t in (q, k, v))
    out = _attend(q.view(B, S, h, H // h, d), k.transpose(1, 2), v.transpose(1, 2), mask.expand(B, S, S), sinks, scale)
    return out.to(dtype)


def paged_attention(
    q: torch.Tensor,  # [B, q, H, d]
    cache: torch.Tensor,  # [2, nb, h, bs, d]: K half, V half
    table: torch.Tensor,  # [B, W] block ids (head- or tail-trimmed)
    q_pos: torch.Tensor,  # [B, q] absolute positions
    kv_pos_offset: torch.Tensor,  # [B] absolute position of the table's first slot
    sinks: torch.Tensor,  # [H]
    scale: float,
    window: int | None,
    packed_k: bool = False,
) -> torch.Tensor:
    """Attention of q over the KV the table names; keys at positions > q_pos are masked."""
    B, S, H, d = q.shape
    h, bs = cache.shape[2], cache.shape[3]
    W = table.shape[1]
    g = H // h
    k_pos = kv_pos_offset[:, None] + torch.arange(W * bs, device=q.device)  # [B, T]
    mask = k_pos[:, None, :] <= q_pos[:, :, None]  # [B, q, T]
    if window is not None:
        mask &= k_pos[:, None, :] > q_pos[:, :, None] - window
    if g * S > ROWS_IN_PLACE or cache.dtype in (torch.uint8, FP8):  # copy (and decode) each block once
        cdt = compute_dtype(q)  # the copy in float32 where bf16 batched matmuls are slow (AVX2 hosts)
        k = gather_blocks(cache, 0, table, packed_k, cdt)  # [B, h, T, d]
        v = gather_blocks(cache, 1, table, False, cdt)
        return _attend(q.view(B, S, h, g, d).to(cdt), k, v, mask, sinks, scale).to(q.dtype)
    qg = q.view(B, S, h, g, d).permute(0, 2, 3, 1, 4)  # [B, h, g, S, d]
    k = block_operand(cache, 0, table, packed_k, q.dtype)  # [B, h, W, bs, d], indexed lazily
    scores = (qg[:, :, :, :, None, None, :] * k[:, :, None, None]).sum(-1)  # [B, h, g, S, W, bs]
    logits = (scores.reshape(B, h, g, S, W * bs) * scale).masked_fill(~mask[:, None, None], float("-inf"))
    sink = sinks.view(1, h, g, 1).to(logits.dtype)
    top = torch.maximum(logits.amax(-1), sink)  # [B, h, g, S]: the sink is finite, so is the top
    e = torch.exp(logits - top[..., None])  # [B, h, g, S, T], unnormalised
    denom = e.sum(-1) + torch.exp(sink - top)  # [B, h, g, S]
    v = block_operand(cache, 1, table, False, q.dtype)  # [B, h, W, bs, d]
    # Per block first (a sum over its bs slots, every d of a slot while the block is in L1), then over
    # the blocks: one sum over (W, bs) compiles to a pass over all T slots per 8 lanes of d, which
    # re-reads each V row d/8 times and, once a head's V outgrows L2 (long buckets), from memory.
    part = (e.view(B, h, g, S, W, bs, 1) * v[:, :, None, None]).sum(5)  # [B, h, g, S, W, d]
    out = part.sum(4) / denom[..., None]  # [B, h, g, S, d]
    return out.permute(0, 3, 1, 2, 4).reshape(B, S, H * d)
