"""Shapes of the stacked GPT-OSS weights, whole and per rank: plain arithmetic on the config.

Torch-free, so ``plan`` and the recipe validator can size what a rank holds without
materialising anything. sharding.py (which slices real tensors) and weights.py re-export
these names. The stored form (``WeightForm``) picks the dtype of every float tensor (float32 or
bfloat16) and whether the experts are dense or MXFP4: ``*_blocks`` [.., G, 16] uint8 (two E2M1
nibbles a byte, low first) and ``*_scales`` [.., G] uint8 (E8M0, 2^(s-127)), G = in / 32,
kept packed in the bundle as the checkpoint stores them and decoded inside the graph.
"""

from __future__ import annotations

import dataclasses
import math

from neffbuild.models.gpt_oss.config import GptOssConfig

# name -> axis split over TP: attention by heads, the embedding and the LM head by vocabulary (rows)
TP_SPLIT = {"qkv_w": 1, "qkv_b": 1, "o_w": 2, "sinks": 1, "embed": 0, "lm_head": 0}
EP_SPLIT = {"gate_up_w": 1, "gate_up_b": 1, "down_w": 1, "down_b": 1}  # name -> axis split over EP
# Expert weights are stacked [out, in] per expert (gate_up_w [L, E, 2I, H], down_w [L, E, H, I]), as an MXFP4
# checkpoint stores them and nn.Linear holds a weight; transformers' float tensors are [in, out]
# (weights.stack transposes them). kernels/moe.py's decode loops then read each reduction contiguously.
EXPERTS_OUT_IN = ("gate_up_w", "down_w")
MXFP4_GROUP = 32  # values sharing one scale; a block row holds 16 bytes
BLOCKS, SCALES = "_blocks", "_scales"  # the checkpoint's suffixes, kept as the bundle's too
PACKED = {f"{w}{sfx}": w for w in EXPERTS_OUT_IN for sfx in (BLOCKS, SCALES)}  # packed name -> the dense one
EP_SPLIT.update(dict.fromkeys(PACKED, 1))  # packed experts split over EP on the same (expert) axis
DTYPES = ("float32", "bfloat16")
EXPERT_FORMS = ("dense", "mxfp4")
ITEMSIZE = {"float32": 4, "bfloat16": 2, "uint8": 1}
STORED_ITEMSIZE = ITEMSIZE["float32"]  # the default form's (float32, dense experts)


@dataclasses.dataclass(frozen=True)
class WeightForm:
    """How the bundle stores the stacked weights: float tensors in ``dtype``, experts ``dense`` or ``mxfp4``."""

    dtype: str = "float32"
    experts: str = "dense"

    @property
    def mxfp4(self) -> bool:
        return self.experts == "mxfp4"


DEFAULT_FORM = WeightForm()


def experts_of(names) -> str:
    """The experts' form of a set of stored tensor names (a bundle's weights table)."""
    return "mxfp4" if any(n in PACKED for n in names) else "dense"


def _packed(shapes: dict) -> dict:
    """Dense expert weights [.., out, in] -> their MXFP4 blocks [.., out, in/32, 16] and scales [.., out, in/32]."""
    out = {}
    for name, shape in shapes.items():
        if name in EXPERTS_OUT_IN:
            *lead, n_in = shape
            out[name + BLOCKS] = (*lead, n_in // MXFP4_GROUP, MXFP4_GROUP // 2)
            out[name + SCALES] = (*lead, n_in // MXFP4_GROUP)
        else:
            out[name] = shape
    return out


def stacked_shapes(cfg: GptOssConfig, experts: str = "dense") -> dict[str, tuple[int, ...]]:
    """Shapes of the stacked GK tensors, without materialising any weight."""
    shapes = _dense_shapes(cfg)
    return _packed(shapes) if experts == "mxfp4" else shapes


def _dense_shapes(cfg: GptOssConfig) -> dict[str, tuple[int, ...]]:
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


def rank_shapes(cfg: GptOssConfig, par, experts: str = "dense") -> dict[str, tuple[int, ...]]:
    """Shapes of one rank's stacked tensors (the same on every rank), without any weight."""
    full = stacked_shapes(cfg, experts)
    d = cfg.head_dim
    local = local_config(cfg, par)
    out = dict(full)
    q, k = local.num_attention_heads * d, local.num_key_value_heads * d
    L, H = cfg.num_hidden_layers, cfg.hidden_size
    out.update(qkv_w=(L, q + 2 * k, H), qkv_b=(L, q + 2 * k), o_w=(L, H, q), sinks=(L, local.num_attention_heads))
    out.update(embed=(cfg.vocab_size // par.tp, H), lm_head=(cfg.vocab_size // par.tp, H))  # vocab / tp rows
    for name, axis in EP_SPLIT.items():
        if name not in full:
            continue
        shape = list(full[name])
        shape[axis] //= par.ep
        out[name] = tuple(shape)
    return out


def dtype_of(name: str, form: WeightForm) -> str:
    """The stored dtype of one stacked tensor: packed experts are bytes, every other tensor ``form.dtype``."""
    return "uint8" if name in PACKED else form.dtype


def rank_specs(cfg: GptOssConfig, par, form: WeightForm = DEFAULT_FORM) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, dtype)} of one rank's stacked tensors as the bundle stores them (placeholders, plan)."""
    return {n: (s, dtype_of(n, form)) for n, s in rank_shapes(cfg, par, form.experts).items()}


# plan's breakdown: which part of the model each stacked tensor belongs to
PARTS = {"embed": "embedding", "lm_head": "embedding", "router_w": "router", "router_b": "router",
         "gate_up_b": "experts", "down_b": "experts", **dict.fromkeys((*EXPERTS_OUT_IN, *PACKED), "experts")}


def rank_weight_parts(cfg: GptOssConfig, par, form: WeightForm = DEFAULT_FORM) -> dict[str, int]:
    """Bytes one rank maps per part (embedding: embedding + unembedding; attention: QKV, o-proj, sinks and the
    norms; router; experts: weights and biases), as the bundle stores them."""
    out = dict.fromkeys(("embedding", "attention", "router", "experts"), 0)
    for name, (shape, dtype) in rank_specs(cfg, par, form).items():
        out[PARTS.get(name, "attention")] += math.prod(shape) * ITEMSIZE[dtype]
    return out


def rank_weight_bytes(cfg: GptOssConfig, par, form: WeightForm = DEFAULT_FORM) -> int:
    """Bytes of the pieces one rank maps (shared + its tp + its ep piece), as the bundle stores them."""
    return sum(rank_weight_parts(cfg, par, form).values())
