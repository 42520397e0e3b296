"""Shapes, dtypes and stored bytes of the EAGLE3 draft's tensors, whole and per rank: plain arithmetic, no torch.

The bundle stores the draft's tensors (``draft_*``) beside the target's, in the recipe's
``model.weights_dtype`` (float32 or bfloat16) except the vocabulary map ``draft_d2t`` (int64),
plus the draft's own ``draft_embed [V, H]`` when its checkpoint brings one (read from the
safetensors headers only: 8-byte length, then JSON). Under tp > 1 the draft is split like the
target (``models/eagle3/sharding.py``): its attention by heads (the q, k, v rows of the fused
QKV and the o-proj columns; KV heads replicated on the ranks that share one when there are
fewer than tp), its LM head and its own embedding by vocabulary rows. The fc fusion, the norms,
the MLP and ``draft_d2t`` stay whole on every rank (``shared`` piece).
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from pathlib import Path

from neffbuild.errors import InvalidInput
from neffbuild.models.eagle3.config import Eagle3Config
from neffbuild.runtime.parallel import ParallelLayout

EMBED = "embed_tokens.weight"
D2T = "draft_d2t"
ITEMSIZE = {"float32": 4, "bfloat16": 2, "int64": 8}
# name -> the axis split over TP: attention by heads (QKV rows, o-proj columns), LM head and own embedding by rows
TP_SPLIT = {"draft_qkv_w": 0, "draft_o_w": 1, "draft_lm_head": 0, "draft_embed": 0}


def shapes(cfg: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Bundle-name shapes of the draft's tensors (without the optional own embedding)."""
    H, d, I, Vd = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.draft_vocab_size
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d
    return {
        "draft_fc": (H, 3 * H), "draft_ln_embed": (H,), "draft_ln_hidden": (H,), "draft_qkv_w": (qkv, 2 * H),
        "draft_o_w": (H, cfg.num_attention_heads * d), "draft_ln_mlp": (H,), "draft_gate_w": (I, H),
        "draft_up_w": (I, H), "draft_down_w": (H, I), "draft_norm": (H,), "draft_lm_head": (Vd, H), D2T: (Vd,),
    }


def local_config(cfg: Eagle3Config, par) -> Eagle3Config:
    """The config a rank's draft attention sees: its query heads and (possibly replicated) KV heads."""
    return dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // par.tp,
                               num_key_value_heads=max(1, cfg.num_key_value_heads // par.tp))


def layout_problem(cfg: Eagle3Config, tp: int) -> str | None:
    """Why the draft cannot be split over ``tp`` ranks (the recipe validator and the builder report it), or None."""
    Hq, Hk, Vd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.draft_vocab_size
    if Hq % tp or (Hk % tp and tp % Hk):
        return (f"must divide the draft's {Hq} attention heads and divide or be a multiple of its {Hk} KV heads "
                "(the draft is split over TP like the target)")
    if Vd % tp:
        return f"must divide the draft's vocabulary of {Vd} tokens (its LM head is split by vocabulary over TP)"
    return None


def rank_shapes(cfg: Eagle3Config, par, own_embed: bool = False) -> dict[str, tuple[int, ...]]:
    """Shapes of one rank's draft tensors (the same on every rank), the own embedding included when there is one."""
    out = shapes(cfg)
    if own_embed:
        out["draft_embed"] = (cfg.vocab_size, cfg.hidden_size)
    if par.tp == 1:
        return out
    local, d, H = local_config(cfg, par), cfg.head_dim, cfg.hidden_size
    q, k = local.num_attention_heads * d, local.num_key_value_heads * d
    out.update(draft_qkv_w=(q + 2 * k, 2 * H), draft_o_w=(H, q), draft_lm_head=(cfg.draft_vocab_size // par.tp, H))
    if own_embed:
        out["draft_embed"] = (cfg.vocab_size // par.tp, H)
    return out


def rank_specs(cfg: Eagle3Config, par, dtype: str = "float32",
               own_embed: bool = False) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, dtype)} of one rank's draft tensors as the bundle stores them (placeholders, plan)."""
    return {n: (s, "int64" if n == D2T else dtype) for n, s in rank_shapes(cfg, par, own_embed).items()}


def weight_bytes(cfg: Eagle3Config, own_embed: bool = False, par=None, dtype: str = "float32") -> int:
    """Bytes of the draft's tensors one rank maps, as the bundle stores them (``par`` None: unsharded)."""
    specs = rank_specs(cfg, par or ParallelLayout(), dtype, own_embed)
    return sum(math.prod(s) * ITEMSIZE[t] for s, t in specs.values())


def has_own_embed(checkpoint: str | Path) -> bool:
    """Whether a draft checkpoint brings its own token embedding (read from the headers only)."""
    folder = Path(checkpoint)
    for f in sorted(folder.glob("*.safetensors")) if folder.is_dir() else [folder]:
        try:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(min(n, 100 << 20)))
        except (OSError, struct.error, ValueError) as exc:
            raise InvalidInput(f"speculative.draft.checkpoint {f}: unreadable safetensors header ({exc})") from None
        if isinstance(header, dict) and any(k.removeprefix("model.") == EMBED for k in header):
            return True
    return False
