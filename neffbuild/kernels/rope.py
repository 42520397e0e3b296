"""Rotary position embeddings with YaRN scaling (GPT-OSS: non-interleaved halves)."""

from __future__ import annotations

import math

import torch


def yarn_inv_freq(head_dim: int, rope: dict) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] and the attention (mscale) factor for a rope dict."""
    base = float(rope.get("rope_theta", 150000.0))
    pos = base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if rope.get("rope_type", "default") != "yarn":
        return 1.0 / pos, 1.0
    factor = float(rope["factor"])
    orig = float(rope["original_max_position_embeddings"])
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    beta_fast, beta_slow = rope.get("beta_fast") or 32.0, rope.get("beta_slow") or 1.0

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos)) * (1 - extrapolation) + (1.0 / pos) * extrapolation
    return inv, float(attention_factor)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float):
    """cos, sin of shape [*positions.shape, head_dim/2], pre-multiplied by the YaRN scale."""
    freqs = positions.float()[..., None] * inv_freq
    return freqs.cos() * scale, freqs.sin() * scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, d]; cos/sin [..., d/2] broadcast over heads, in x's dtype (computed in float32)."""
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
