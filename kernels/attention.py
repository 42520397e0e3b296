"""Attention with learned sinks: dense (prefill) and paged over a block table (decode).

Sinks are one extra logit column per head, included in the softmax and dropped after it.
GQA: query heads are grouped ``[kv_heads, group]`` and share one K/V head.
"""

from __future__ import annotations

import torch

from kernels.kv import gather_blocks


def _attend(q, k, v, mask, sinks, scale):
    """q [B, S, h, g, d]; k, v [B, h, T, d]; mask [B, S, T] (True = attend); sinks [h*g]."""
    B, S, h, g, d = q.shape
    logits = torch.einsum("bshgd,bhtd->bhgst", q, k) * scale  # [B, h, g, S, T]
    logits = logits.masked_fill(~mask[:, None, None], float("-inf"))
    sink = sinks.view(1, h, g, 1, 1).expand(B, h, g, S, 1).to(logits.dtype)
    logits = torch.cat([logits, sink], dim=-1)
    probs = torch.softmax(logits - logits.amax(-1, keepdim=True), dim=-1)[..., :-1]
    out = torch.einsum("bhgst,bhtd->bshgd", probs, v)  # [B, S, h, g, d]
    return out.reshape(B, S, h * g * d)


def sdpa_with_sinks(q, k, v, sinks, scale: float, window: int | None):
    """Dense causal attention over one sequence chunk. q [B, S, H, d]; k, v [B, S, h, d]."""
    B, S, H, d = q.shape
    h = k.shape[2]
    pos = torch.arange(S)
    mask = pos[None, :] <= pos[:, None]  # [S, T]
    if window is not None:
        mask &= pos[None, :] > pos[:, None] - window
    return _attend(q.view(B, S, h, H // h, d), k.transpose(1, 2), v.transpose(1, 2), mask.expand(B, S, S), sinks, scale)


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
    h = cache.shape[2]
    k = gather_blocks(cache, 0, table, packed_k, q.dtype)  # [B, h, T, d]
    v = gather_blocks(cache, 1, table, False, q.dtype)
    T = k.shape[2]
    k_pos = kv_pos_offset[:, None] + torch.arange(T, device=q.device)  # [B, T]
    mask = k_pos[:, None, :] <= q_pos[:, :, None]  # [B, q, T]
    if window is not None:
        mask &= k_pos[:, None, :] > q_pos[:, :, None] - window
    return _attend(q.view(B, S, h, H // h, d), k, v, mask, sinks, scale)
