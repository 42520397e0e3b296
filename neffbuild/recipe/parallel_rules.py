"""Validation rules for the ``parallel`` section (tp, dp, ep) and what each backend can build.

World = tp x dp ranks; attention heads split over TP (KV heads split, or replicated when
there are fewer than tp), the embedding and the LM head by vocabulary over TP, experts over EP
groups of ``ep`` ranks taken from the world; an EAGLE3 draft splits over TP by the same rules (its heads,
its LM head's vocabulary). A backend's own limits are its ``layout_rule``
registry part (compiler/backends/neuron_rules.py).
"""

from __future__ import annotations

from neffbuild import registry
from neffbuild.errors import InvalidInput
from neffbuild.runtime.parallel import ParallelLayout


def check(err, cfg, par: dict, compiler: dict, lnc: int, spec=None) -> None:
    """Report every parallel-layout problem through ``err(path, value, rule)``."""
    tp, dp, ep = par["tp"], par["dp"], par["ep"]
    if not (tp and dp and ep):
        return  # a non-positive degree is already reported
    Hq, Hk, E = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_local_experts
    if Hq % tp:
        err("parallel.tp", tp, f"must divide model.config.num_attention_heads ({Hq})")
    if Hk % tp and tp % Hk:
        err("parallel.tp", tp, f"must divide model.config.num_key_value_heads ({Hk}) or be a multiple of it "
                               "(KV heads are then replicated over the TP ranks that share them)")
    if cfg.vocab_size % tp:
        err("parallel.tp", tp, f"must divide model.config.vocab_size ({cfg.vocab_size}): the embedding and the "
                               "LM head are split by vocabulary over the TP ranks (pad the vocabulary to a multiple)")
    if E % ep:
        err("parallel.ep", ep, f"must divide model.config.num_local_experts ({E})")
    if (tp * dp) % ep:
        err("parallel.ep", ep, f"must divide the world tp x dp = {tp * dp} (EP groups are made of the world's ranks)")
    _draft(err, cfg, spec, tp)
    _backend_limits(err, tp, compiler, lnc)


def _draft(err, cfg, spec, tp: int) -> None:
    """The speculative draft splits over TP like the target (its heads, its LM head's vocabulary): its rule."""
    if spec is None or tp == 1:
        return
    method = registry.speculative(spec.method)
    try:
        why = method.get("layout_problem")(method.get("config").from_hf_dict(spec.draft_hf_config, cfg), tp)
    except (InvalidInput, TypeError, ValueError, AttributeError, KeyError, ArithmeticError):
        return  # an unreadable draft config: reported by the speculative section (gate_rules.draft_config)
    if why:
        err("parallel.tp", tp, why)


def _backend_limits(err, tp: int, compiler: dict, lnc: int) -> None:
    """The backend's own layout rule, named in the registry (inductor has none: it builds any
    valid layout, collectives over gloo on CPU, NCCL on CUDA)."""
    entry = registry.BACKENDS.get(compiler.get("backend"))
    if entry is not None and "layout_rule" in entry.parts:
        entry.get("layout_rule")(err, tp, compiler, lnc)


def layout_json(recipe) -> dict:
    """The layout as validate/plan --json report it, with what one rank holds."""
    tp, dp, ep, cfg = recipe.tp, recipe.dp, recipe.ep, recipe.model.config
    combine = ParallelLayout(tp, dp, ep).ep_combine  # the runtime's one rule
    return {"tp": tp, "dp": dp, "ep": ep, "world_size": tp * dp, "ep_groups": tp * dp // ep, "ep_combine": combine,
            "sharded": tp > 1 or ep > 1,
            "per_rank": {"attention_heads": cfg.num_attention_heads // tp,
                         "kv_heads": max(1, cfg.num_key_value_heads // tp),
                         "kv_heads_replicated": cfg.num_key_value_heads < tp,
                         "experts": cfg.num_local_experts // ep,
                         "vocab_rows": cfg.vocab_size // tp}}


COMBINE_TEXT = {"none": "none", "all_reduce": "one all-reduce", "gather_reduce_scatter": "gather + reduce-scatter"}


def describe(recipe) -> str:
    """Lines for validate/plan: the world, how attention and experts are split, what one rank holds."""
    d = layout_json(recipe)
    if not d["sharded"]:
        return f"parallel: unsharded; {d['dp']} DP rank(s), each runs the whole model"
    r = d["per_rank"]
    return (f"parallel: tp {d['tp']} x dp {d['dp']} = {d['world_size']} ranks; {d['ep_groups']} EP group(s) of "
            f"{d['ep']} ranks (MoE combine: {COMBINE_TEXT[d['ep_combine']]}); one artifact per target serves every "
            f"rank\n  each rank: {r['attention_heads']} attention heads, {r['kv_heads']} KV head(s)"
            f"{' (replicated)' if r['kv_heads_replicated'] else ''}, {r['experts']} expert(s) per layer")
