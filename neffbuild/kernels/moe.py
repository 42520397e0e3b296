"""GPT-OSS mixture of experts: top-k router with bias, softmax over the chosen, clamped SwiGLU.

An expert-parallel rank holds a slice of the experts; the combine across ranks is the
caller's (the architecture's decode graph).
"""

import torch

DENSE_TOKENS = 64  # from this many tokens on (prefill), every expert runs on every token (see moe)


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
    gate_up_w: torch.Tensor,  # [E, 2I, H]: [out, in], the reduction axis contiguous
    gate_up_b: torch.Tensor,  # [E, 2I]
    down_w: torch.Tensor,  # [E, H, I]
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
    if x.shape[0] >= DENSE_TOKENS:
        return _dense(x, router_w.shape[0], top_idx, weights, gate_up_w, gate_up_b, down_w, down_b, alpha, limit,
                      first_expert)
    if first_expert is not None:
        local = top_idx - first_expert  # [N, k]
        held = (local >= 0) & (local < gate_up_w.shape[0])
        top_idx = local.clamp(0, gate_up_w.shape[0] - 1)
        weights = weights * held
    # Product-and-sum with the stacked weights indexed by top_idx (not einsum, whose batched matmul needs
    # the chosen experts copied out first): compiled, the lookup sits inside the loop over H (then I), and
    # with the weights [out, in] each output is one dot product over a contiguous weight row (vectorised
    # along it), not an accumulator over rows 2I apart (docs/benchmarks.md: x0.6-0.8 of that loop's time).
    h = (x[:, None, None, :] * gate_up_w[top_idx]).sum(-1) + gate_up_b[top_idx]  # [N, k, 2I]
    h = swiglu(h, alpha, limit)  # [N, k, I]
    out = (h[:, :, None, :] * down_w[top_idx]).sum(-1) + down_b[top_idx]  # [N, k, H]
    return (out * weights.unsqueeze(-1)).sum(1)


def _dense(x, experts, top_idx, weights, gate_up_w, gate_up_b, down_w, down_b, alpha, limit, first_expert):
    """Every held expert on every token as one batched matmul, each term scaled by its routing weight
    (zero where the token did not choose the expert): each expert's weights are read once, in place.

    The indexed product-and-sum (``moe``) compiles to loops that read the chosen experts in place, but run
    eagerly (prefill) it materialises ``[N, k, H, 2I]``: 0.87 s per layer at N = 400, H = I = 256, top 2
    of 8, against 0.03 s here. With N * k well above E every expert is chosen anyway. This is also the
    form transformers' experts module runs at inference."""
    N, E = x.shape[0], gate_up_w.shape[0]  # E: the experts held (all ``experts``, or one EP rank's slice)
    routed = torch.zeros(N, experts, dtype=x.dtype).scatter(1, top_idx, weights.to(x.dtype))  # weight or 0
    if first_expert is not None:
        routed = routed.index_select(1, torch.arange(E, device=x.device) + first_expert)  # [N, E]: the held slice
    h = torch.bmm(x[None].expand(E, N, x.shape[1]), gate_up_w.transpose(1, 2)) + gate_up_b[:, None, :]  # [E, N, 2I]
    out = torch.bmm(swiglu(h, alpha, limit), down_w.transpose(1, 2)) + down_b[:, None, :]  # [E, N, H]
    return (out * routed.t()[..., None]).sum(0)
