"""Shapes of the stacked GPT-OSS weights, whole and per rank: plain arithmetic on the config.

Torch-free, so ``plan`` and the recipe validator can size what a rank holds without
materialising anything. sharding.py (which slices real tensors) and weights.py re-export
these names. Every stacked tensor is stored as float32 (``STORED_ITEMSIZE``).
"""

from __future__ import annotations

import dataclasses
import math

from neffbuild.models.gpt_oss.config import GptOssConfig

TP_SPLIT = {"qkv_w": 1, "qkv_b": 1, "o_w": 2, "sinks": 1}  # name -> axis split over TP
EP_SPLIT = {"gate_up_w": 1, "gate_up_b": 1, "down_w": 1, "down_b": 1}  # name -> axis split over EP
# Expert weights are stacked [out, in] per expert (gate_up_w [L, E, 2I, H], down_w [L, E, H, I]), as an MXFP4
# checkpoint stores them and nn.Linear holds a weight; transformers' float tensors are [in, out]
# (weights.stack transposes them). kernels/moe.py's decode loops then read each reduction contiguously.
EXPERTS_OUT_IN = ("gate_up_w", "down_w")
STORED_ITEMSIZE = 4  # the bundle stores the stacked weights as float32 (MXFP4 experts dequantised)


def stacked_shapes(cfg: GptOssConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of the stacked GK tensors, without materialising any weight."""
    L, H, d, E, I, V = (cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim, cfg.num_local_experts,
                        cfg.intermediate_size, cfg.vocab_size)
    Hq, Hk = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    return {
        "embed": (V, H), "norm": (H,), "lm_head": (V, H),
        "qkv_w": (L, Hq + 2 * Hk, H), "qkv_b": (L, Hq + 2 * Hk),
        "ln_attn": (L, H), "ln_mlp": (L, H), "sinks": (L, cfg.num_attention_heads),
        "o_w": (L, H, Hq), "o_b": (L, H), "router_w": (L, E, H), "router_b": (L, E),
        "gate_up_w": (L, E, 2 * I, H), "gate_up_b": (L, E, 2 * I), "down_w": (L, E, H, I), "down_b": (L, E, H),
    }  # experts [out, in] (EXPERTS_OUT_IN): the reduction axis contiguous


def local_config(cfg: GptOssConfig, par) -> GptOssConfig:
    """The config a rank's attention sees: its query heads and (possibly replicated) KV heads."""
    return dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // par.tp,
                               num_key_value_heads=max(1, cfg.num_key_value_heads // par.tp))


def rank_shapes(cfg: GptOssConfig, par) -> dict[str, tuple[int, ...]]:
    """Shapes of one rank's stacked tensors (the same on every rank), without any weight."""
    full = stacked_shapes(cfg)
    d = cfg.head_dim
    local = local_config(cfg, par)
    out = dict(full)
    q, k = local.num_attention_heads * d, local.num_key_value_heads * d
    L, H = cfg.num_hidden_layers, cfg.hidden_size
    out.update(qkv_w=(L, q + 2 * k, H), qkv_b=(L, q + 2 * k), o_w=(L, H, q), sinks=(L, local.num_attention_heads))
    for name, axis in EP_SPLIT.items():
        shape = list(full[name])
        shape[axis] //= par.ep
        out[name] = tuple(shape)
    return out


def rank_weight_bytes(cfg: GptOssConfig, par) -> int:
    """Bytes of the pieces one rank maps (shared + its tp + its ep piece), as the bundle stores them."""
    return sum(math.prod(s) for s in rank_shapes(cfg, par).values()) * STORED_ITEMSIZE
