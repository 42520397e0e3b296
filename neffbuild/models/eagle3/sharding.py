"""Which slice of the EAGLE3 draft each rank of a parallel layout holds, and the pieces the bundle stores.

The draft is split over TP by the target's rules (``models/eagle3/shapes.py`` names the tensors):
the rows of the fused QKV by heads (``kv_heads_of``: the target's rule, on the draft's heads),
the o-proj's columns by query heads (the graph all-reduces its partial sums), the LM head and an
own embedding by vocabulary rows [r * V/tp, (r + 1) * V/tp). The rest is replicated. In the
bundle the split tensors go into the target's ``tp{r}`` pieces and the rest into ``shared``
(``piece``), so a rank maps its slice of the draft with its slice of the target.
"""

from __future__ import annotations

import torch

from neffbuild.errors import InvalidInput
from neffbuild.models.eagle3.config import Eagle3Config
from neffbuild.models.eagle3.shapes import TP_SPLIT, layout_problem, local_config
from neffbuild.models.gpt_oss.sharding import kv_heads_of  # the draft's KV heads: the target's rule
from neffbuild.runtime.parallel import ParallelLayout

SHARED = "shared"


def _qkv_rows(cfg: Eagle3Config, par: ParallelLayout, tp_rank: int) -> torch.Tensor:
    """Rows of the fused QKV weight [(Hq + 2 Hk) d, 2H] that TP rank ``tp_rank`` holds."""
    d, Hq, Hk = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    q_per = Hq // par.tp
    heads = kv_heads_of(cfg, par, tp_rank)
    q = torch.arange(tp_rank * q_per * d, (tp_rank + 1) * q_per * d)
    k = Hq * d + torch.arange(heads.start * d, heads.stop * d)
    return torch.cat([q, k, k + Hk * d])


def tp_slice(cfg: Eagle3Config, weights: dict, par: ParallelLayout, tp_rank: int) -> dict[str, torch.Tensor]:
    """TP rank ``tp_rank``'s slices of the draft's split tensors (those of ``weights`` it has)."""
    q_cols = local_config(cfg, par).num_attention_heads * cfg.head_dim
    out = {"draft_qkv_w": weights["draft_qkv_w"].index_select(0, _qkv_rows(cfg, par, tp_rank)),
           "draft_o_w": weights["draft_o_w"].narrow(1, tp_rank * q_cols, q_cols).contiguous()}
    for name in ("draft_lm_head", "draft_embed"):
        if name in weights:
            rows = weights[name].shape[0] // par.tp
            out[name] = weights[name].narrow(0, tp_rank * rows, rows).contiguous()
    return out


def piece(cfg: Eagle3Config, weights: dict, par: ParallelLayout, name: str) -> dict[str, torch.Tensor]:
    """The draft's tensors in the bundle's piece ``name``: ``shared`` (replicated; all of them unless tp > 1),
    ``tp{r}`` (TP rank r's slices), ``ep{r}`` (none)."""
    if par.tp > 1 and (why := layout_problem(cfg, par.tp)):
        raise InvalidInput(f"parallel.tp {par.tp}: {why}")
    split = set(TP_SPLIT) if par.tp > 1 else set()
    if name == SHARED:
        return {k: v for k, v in weights.items() if k not in split}
    if name.startswith("tp") and par.tp > 1:
        return tp_slice(cfg, weights, par, int(name[2:]))
    return {}


def shard(cfg: Eagle3Config, weights: dict, par: ParallelLayout, rank: int) -> dict[str, torch.Tensor]:
    """The draft's tensors as world rank ``rank`` holds them."""
    out = piece(cfg, weights, par, SHARED)
    return dict(out, **piece(cfg, weights, par, f"tp{par.tp_rank(rank)}")) if par.tp > 1 else out


def shard_layout(par: ParallelLayout, names) -> dict[str, dict]:
    """For the manifest: how each split draft tensor of ``names`` is split (axis, over TP)."""
    return {k: {"over": "tp", "axis": a} for k, a in TP_SPLIT.items() if k in names} if par.tp > 1 else {}


def unshard(cfg: Eagle3Config, parts: dict[str, dict[str, torch.Tensor]], par: ParallelLayout) -> dict:
    """The whole draft from the bundle's pieces (the inverse of ``piece``): the unsharded reference."""
    out = {k: v for k, v in parts[SHARED].items() if k.startswith("draft_")}
    if par.tp == 1:
        return out
    tp = [parts[f"tp{r}"] for r in range(par.tp)]
    out["draft_o_w"] = torch.cat([p["draft_o_w"] for p in tp], dim=1)
    for name in ("draft_lm_head", "draft_embed"):
        if name in tp[0]:
            out[name] = torch.cat([p[name] for p in tp], dim=0)
    local, d = local_config(cfg, par), cfg.head_dim
    sizes = [local.num_attention_heads * d, local.num_key_value_heads * d, local.num_key_value_heads * d]
    q, k, v = zip(*(p["draft_qkv_w"].split(sizes, dim=0) for p in tp), strict=True)
    heads = [kv_heads_of(cfg, par, r) for r in range(par.tp)]
    keep = [r for r in range(par.tp) if r == 0 or heads[r] != heads[r - 1]]  # one copy of a replicated head
    out["draft_qkv_w"] = torch.cat([*q, *(k[r] for r in keep), *(v[r] for r in keep)], dim=0)
    return out
