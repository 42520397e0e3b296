"""Bytes a decode step must read, and the machine's copy bandwidth: the step's lower bound.

Weights touched: every stacked weight, except that the embedding reads one row per token
and the expert weights only the experts the router can pick (``min(tokens * top_k, E)``
per layer). KV: K and V of the context the step's table names, for each full-attention
layer, and of the ``num_swa`` sliding-window blocks for each sliding layer.
"""

from __future__ import annotations

import time

import torch

EXPERT_WEIGHTS = ("gate_up_w", "gate_up_b", "down_w", "down_b")


def weight_bytes(weights: dict[str, torch.Tensor], cfg, tokens: int) -> int:
    total = 0
    for name, t in weights.items():
        size = t.numel() * t.element_size()
        if name == "embed":
            size = tokens * t.shape[-1] * t.element_size()
        elif name in EXPERT_WEIGHTS:
            size = size * min(tokens * cfg.num_experts_per_tok, cfg.num_local_experts) // cfg.num_local_experts
        total += size
    return total


def kv_bytes(cfg, layout, *, batch: int, ctx: int, num_swa: int) -> int:
    """K + V bytes a step gathers: ``ctx`` tokens per full layer, the SWA table per sliding layer."""
    per_token = layout.kv_heads * layout.head_dim * layout.itemsize * 2
    full = sum(1 for k in cfg.layer_types if k == "full_attention")
    sliding = len(cfg.layer_types) - full
    return batch * per_token * (full * ctx + sliding * max(num_swa, 1) * layout.block_size)


def copy_bandwidth(nbytes: int = 128 * 2**20, repeat: int = 15) -> float:
    """Bytes per second of a large tensor copy, best of ``repeat`` (the machine's bound, not its noise)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return nbytes / min(times)
