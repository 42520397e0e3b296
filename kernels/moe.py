"""GPT-OSS mixture of experts: top-k router with bias, softmax over the chosen, clamped SwiGLU."""

import torch


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
    gate_up_w: torch.Tensor,  # [E, H, 2I]
    gate_up_b: torch.Tensor,  # [E, 2I]
    down_w: torch.Tensor,  # [E, I, H]
    down_b: torch.Tensor,  # [E, H]
    top_k: int,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    logits = x @ router_w.t() + router_b  # [N, E]
    top_val, top_idx = torch.topk(logits, top_k, dim=-1)  # [N, k]
    weights = torch.softmax(top_val, dim=-1)  # [N, k]
    h = torch.einsum("nh,nkhi->nki", x, gate_up_w[top_idx]) + gate_up_b[top_idx]  # [N, k, 2I]
    h = swiglu(h, alpha, limit)  # [N, k, I]
    out = torch.einsum("nki,nkih->nkh", h, down_w[top_idx]) + down_b[top_idx]  # [N, k, H]
    return (out * weights.unsqueeze(-1)).sum(1)
