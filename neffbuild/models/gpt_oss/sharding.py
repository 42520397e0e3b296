"""Which slice of the stacked GPT-OSS weights each rank of a parallel layout holds.

Attention is split by heads over TP (q, k, v rows of the fused QKV; o-proj columns;
sinks); when there are fewer KV heads than TP ranks each KV head is replicated on the
ranks whose query heads use it. The embedding and the LM head are split over TP by
vocabulary: TP rank r holds rows [r * V/tp, (r + 1) * V/tp) of each (the decode graph sums
the looked-up rows and all-gathers the logits). Experts are split over EP (gate/up, down and
their biases). Everything else is replicated: norms, the router (every rank routes over all
experts) and the o-proj bias (added once, after the all-reduce).

The bundle stores the weights in pieces so that every tensor is stored once: ``shared``
(replicated), ``tp{r}`` (one per TP rank, when tp > 1) and ``ep{r}`` (one per EP rank,
when ep > 1). A rank maps ``shared`` plus its own TP and EP pieces (``piece_names``).
"""

from __future__ import annotations

import torch

from neffbuild.errors import InvalidInput
from neffbuild.models.gpt_oss.config import GptOssConfig
from neffbuild.models.gpt_oss.shapes import (  # noqa: F401 (torch-free)
    EP_SPLIT,
    PACKED,
    TP_SPLIT,
    local_config,
    rank_shapes,
)
from neffbuild.runtime.parallel import ParallelLayout

SHARED = "shared"


def check_layout(cfg: GptOssConfig, par: ParallelLayout) -> None:
    """The model-side divisibility rules (the recipe validator reports them per field first)."""
    Hq, Hk, E = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_local_experts
    if Hq % par.tp or (Hk % par.tp and par.tp % Hk):
        raise InvalidInput(f"tp {par.tp} must divide the {Hq} attention heads and divide or be a multiple of the "
                           f"{Hk} KV heads")
    if cfg.vocab_size % par.tp:
        raise InvalidInput(f"tp {par.tp} must divide the vocabulary of {cfg.vocab_size} tokens (the embedding and "
                           "the LM head are split by vocabulary over TP)")
    if E % par.ep or par.world_size % par.ep:
        raise InvalidInput(f"ep {par.ep} must divide the {E} experts and the world of {par.world_size} ranks")


def kv_heads_of(cfg: GptOssConfig, par: ParallelLayout, tp_rank: int) -> range:
    """The KV heads TP rank ``tp_rank`` holds (its slice of every KV buffer's head axis)."""
    Hq, Hk = cfg.num_attention_heads, cfg.num_key_value_heads
    k_per = max(1, Hk // par.tp)
    first_k = tp_rank * k_per if Hk >= par.tp else tp_rank * (Hq // par.tp) // (Hq // Hk)  # replicated: its queries'
    return range(first_k, first_k + k_per)


def _head_rows(cfg: GptOssConfig, par: ParallelLayout, tp_rank: int) -> torch.Tensor:
    """Rows of the fused QKV weight [Hq*d + 2*Hk*d, H] that TP rank ``tp_rank`` holds."""
    d, Hq, Hk = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    q_per = Hq // par.tp
    first_q = tp_rank * q_per
    heads = kv_heads_of(cfg, par, tp_rank)
    first_k, k_per = heads.start, len(heads)
    q = torch.arange(first_q * d, (first_q + q_per) * d)
    k = Hq * d + torch.arange(first_k * d, (first_k + k_per) * d)
    return torch.cat([q, k, k + Hk * d])


def tp_piece(cfg: GptOssConfig, stacked: dict, par: ParallelLayout, tp_rank: int) -> dict[str, torch.Tensor]:
    rows = _head_rows(cfg, par, tp_rank)
    q_per, d = cfg.num_attention_heads // par.tp, cfg.head_dim
    heads = torch.arange(tp_rank * q_per, (tp_rank + 1) * q_per)
    rows_per = cfg.vocab_size // par.tp
    return {
        "embed": stacked["embed"].narrow(0, tp_rank * rows_per, rows_per).contiguous(),
        "lm_head": stacked["lm_head"].narrow(0, tp_rank * rows_per, rows_per).contiguous(),
        "qkv_w": stacked["qkv_w"].index_select(1, rows),
        "qkv_b": stacked["qkv_b"].index_select(1, rows),
        "o_w": stacked["o_w"].index_select(2, torch.arange(tp_rank * q_per * d, (tp_rank + 1) * q_per * d)),
        "sinks": stacked["sinks"].index_select(1, heads),
    }


def ep_piece(stacked: dict, par: ParallelLayout, ep_rank: int) -> dict[str, torch.Tensor]:
    # Dense or packed experts: split on the expert axis either way (a packed piece keeps the checkpoint's bytes).
    per = stacked["gate_up_b"].shape[1] // par.ep
    return {k: stacked[k].narrow(axis, ep_rank * per, per).contiguous() for k, axis in EP_SPLIT.items()
            if k in stacked}


def iter_pieces(cfg: GptOssConfig, stacked: dict, par: ParallelLayout, names=None):
    """(name, tensors) for every stored piece, one at a time (a writer holds one slice at once):
    ``shared`` plus one per TP rank and one per EP rank (each split > 1); only ``names`` if given."""
    check_layout(cfg, par)
    split = (set(TP_SPLIT) if par.tp > 1 else set()) | (set(EP_SPLIT) if par.ep > 1 else set())
    makers = {SHARED: lambda: {k: v for k, v in stacked.items() if k not in split}}
    makers.update({f"tp{r}": (lambda r=r: tp_piece(cfg, stacked, par, r)) for r in range(par.tp if par.tp > 1 else 0)})
    makers.update({f"ep{r}": (lambda r=r: ep_piece(stacked, par, r)) for r in range(par.ep if par.ep > 1 else 0)})
    for name, make in makers.items():
        if names is None or name in names:
            yield name, make()


def piece_names(par: ParallelLayout, rank: int) -> list[str]:
    """The pieces rank ``rank`` maps."""
    names = [SHARED]
    if par.tp > 1:
        names.append(f"tp{par.tp_rank(rank)}")
    if par.ep > 1:
        names.append(f"ep{par.ep_rank(rank)}")
    return names


def shard(cfg: GptOssConfig, stacked: dict, par: ParallelLayout, rank: int) -> dict[str, torch.Tensor]:
    """All stacked tensors as rank ``rank`` holds them (the union of its pieces)."""
    return {k: v for _, part in iter_pieces(cfg, stacked, par, piece_names(par, rank)) for k, v in part.items()}


def shard_layout(par: ParallelLayout, names=None) -> dict[str, dict]:
    """For the manifest: how each split tensor of ``names`` (default: the dense form's) is split (axis and over
    which degree)."""
    out = {}
    if par.tp > 1:
        out.update({k: {"over": "tp", "axis": a} for k, a in TP_SPLIT.items()})
    if par.ep > 1:
        held = set(names) if names is not None else set(EP_SPLIT) - set(PACKED)
        out.update({k: {"over": "ep", "axis": a} for k, a in EP_SPLIT.items() if k in held})
    return out


def unshard(cfg: GptOssConfig, parts: dict[str, dict[str, torch.Tensor]], par: ParallelLayout) -> dict:
    """The full stacked weights from every piece (the inverse of ``iter_pieces``): the unsharded reference."""
    out = dict(parts[SHARED])
    if par.ep > 1:
        out.update({k: torch.cat([parts[f"ep{r}"][k] for r in range(par.ep)], dim=a) for k, a in EP_SPLIT.items()
                    if k in parts["ep0"]})
    if par.tp > 1:
        tp = [parts[f"tp{r}"] for r in range(par.tp)]
        out["o_w"] = torch.cat([p["o_w"] for p in tp], dim=2)
        out["sinks"] = torch.cat([p["sinks"] for p in tp], dim=1)
        out["embed"] = torch.cat([p["embed"] for p in tp], dim=0)
        out["lm_head"] = torch.cat([p["lm_head"] for p in tp], dim=0)
        local, d = local_config(cfg, par), cfg.head_dim
        sizes = [local.num_attention_heads * d, local.num_key_value_heads * d, local.num_key_value_heads * d]
        for name in ("qkv_w", "qkv_b"):
            q, k, v = zip(*(p[name].split(sizes, dim=1) for p in tp), strict=True)
            heads = [kv_heads_of(cfg, par, r) for r in range(par.tp)]
            keep = [r for r in range(par.tp) if r == 0 or heads[r] != heads[r - 1]]  # one copy of a replicated head
            out[name] = torch.cat([*q, *(k[r] for r in keep), *(v[r] for r in keep)], dim=1)
    return out
