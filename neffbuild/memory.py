"""What one serving rank holds in device memory, the largest KV pool that fits, and the 32-bit KV offset rule.

Pure arithmetic on a recipe (no torch, no tracing), by the project's one formula for each part:

- weights: the pieces the rank maps, as the bundle stores them (architecture part
  ``rank_weight_bytes``: the shared piece + the rank's tp and ep pieces, the embedding and
  unembedding as vocab / tp rows), plus the EAGLE3 draft's tensors (its TP slice, in the weights'
  dtype: ``models/eagle3/shapes.py``);
- KV: ``runtime/kv/layout.py`` (``num_blocks x bytes_per_block``: target buffers, and the
  draft's buffer, its TP slice of the draft's KV heads, separately);
- the pool a device fits, the way vLLM sizes its pool from free memory:

      usable     = device_memory - reserve            reserve = RESERVE_PERCENT % of device_memory
      num_blocks = (usable - weight_bytes) // bytes_per_block

  The reserve stands for what is neither weights nor KV: the runtime, activations and scratch,
  the loaded artifacts (vLLM's default ``gpu_memory_utilization`` 0.9 keeps the same 10 %).
  A backend whose kernels cannot address a larger pool caps it further (its ``kv_limit``
  registry part; neuron: 32-bit offsets, compiler/backends/neuron_rules.py); the suggestion is
  the smaller of the two.
"""

from __future__ import annotations

import dataclasses

from neffbuild import registry
from neffbuild.errors import InvalidInput
from neffbuild.runtime.kv.blocks import kv_groups, min_pool_blocks
from neffbuild.runtime.kv.layout import KVLayout
from neffbuild.runtime.parallel import ParallelLayout

GIB = 1 << 30
RESERVE_PERCENT = 10


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "unknown"
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def kv_layout(cfg, draft_cfg, num_blocks: int, block_size: int, fp8_packed_kv: bool,
              par, kv_dtype: str = "float32") -> KVLayout:
    """One rank's KV layout: its KV heads (architecture part ``local_config``), and its draft KV heads (the
    speculative method's ``local_config``: the draft is split over TP like the target)."""
    # The recipe's one FP8 switch turns on both the FP8 dtype and the packed K layout (the draft's group too);
    # without it the buffers are kv_dtype (neuron_config.kv_dtype).
    local = registry.arch_of(cfg).get("local_config")(cfg, par)
    draft_local = registry.speculative_of(draft_cfg).get("local_config")(draft_cfg, par) if draft_cfg else None
    return KVLayout(cfg.num_kv_buffers, num_blocks, local.num_key_value_heads, block_size, cfg.head_dim,
                    fp8=fp8_packed_kv, packed_k=fp8_packed_kv,
                    draft_kv_heads=draft_local.num_key_value_heads if draft_cfg else 0,
                    draft_head_dim=draft_cfg.head_dim if draft_cfg else 0, kv_dtype=kv_dtype)


def recipe_kv_layout(recipe, num_blocks: int | None = None) -> KVLayout:
    """One rank's KV layout for a recipe (its ``num_blocks`` unless another is given): the one place a recipe's
    layout is made (the builder, plan, the bundle's ``graph_inputs``)."""
    return kv_layout(recipe.model.config, recipe.draft_config, num_blocks or recipe.num_blocks, recipe.block_size,
                     recipe.fp8_packed_kv, recipe.parallel, recipe.kv_dtype)


def weight_parts(recipe) -> dict[str, int]:
    """Bytes one rank maps per part (the architecture's ``rank_weight_parts``: embedding, attention, router,
    experts) plus ``draft`` (its TP slice), from the dtypes the bundle stores (model.weights_dtype, model.experts)."""
    cfg, par = recipe.model.config, recipe.parallel
    arch = registry.arch(recipe.model.arch)
    form = arch.get("weight_form")(recipe.model.weights_dtype, recipe.model.experts)
    parts = dict(arch.get("rank_weight_parts")(cfg, par, form), draft=0)
    dcfg = recipe.draft_config
    if dcfg is not None:
        parts["draft"] = registry.speculative(recipe.speculative.method).get("weight_bytes")(
            dcfg, recipe.draft_own_embed, par, recipe.model.weights_dtype)
    return parts


def weight_bytes(recipe) -> tuple[int, int]:
    """(target, draft) bytes one rank maps, as the bundle stores them."""
    parts = weight_parts(recipe)
    return sum(parts.values()) - parts["draft"], parts["draft"]


def backend_kv_limit(backend: str, layout: KVLayout) -> int | None:
    """The backend's own cap on num_blocks (its ``kv_limit`` part), or None when it has none."""
    entry = registry.BACKENDS.get(backend)
    return entry.get("kv_limit")(layout) if entry is not None and "kv_limit" in entry.parts else None


def check_recipe(err, cfg, serving: dict, par: dict, fp8: bool, spec, compiler: dict,
                 kv_dtype: str = "float32") -> None:
    """The validator's hook: the chosen backend's KV rule, when every value it needs is valid."""
    entry = registry.BACKENDS.get(compiler.get("backend"))
    nb, bs, tp = serving.get("num_blocks"), serving.get("block_size"), par.get("tp")
    if entry is None or "kv_rule" not in entry.parts or not (nb and bs and tp and par.get("dp") and par.get("ep")):
        return
    Hk = cfg.num_key_value_heads
    if cfg.num_attention_heads % tp or (Hk % tp and tp % Hk):
        return  # reported by the parallel rules
    try:
        dcfg = registry.speculative(spec.method).get("config").from_hf_dict(spec.draft_hf_config, cfg) \
            if spec else None
    except InvalidInput:
        return  # reported by the speculative section
    entry.get("kv_rule")(err, kv_layout(cfg, dcfg, nb, bs, fp8, ParallelLayout(tp, par["dp"], par["ep"]), kv_dtype))


# -- per rank, and what a device fits

def device_fit(device_bytes: int, weights: int, layout: KVLayout, *, cap: int | None = None) -> dict:
    """Whether weights + KV fit ``device_bytes`` after the reserve, and the largest num_blocks that does."""
    reserve = device_bytes * RESERVE_PERCENT // 100
    usable = device_bytes - reserve
    by_memory = max(0, (usable - weights) // layout.bytes_per_block)
    best = by_memory if cap is None else min(by_memory, cap)
    return {"device_memory_bytes": device_bytes, "reserve_bytes": reserve, "usable_bytes": usable,
            "needed_bytes": weights + layout.total_bytes, "fits": weights + layout.total_bytes <= usable,
            "max_num_blocks": best, "limited_by": "memory" if cap is None or by_memory <= cap else "kv_offsets_32bit",
            "max_num_blocks_by_memory": by_memory}


def sharding_outlook(parts: dict, layout: KVLayout, device_bytes: int | None) -> dict:
    """What one rank would hold without the EAGLE3 draft (its weights and KV group): arithmetic only, a forecast
    for a bundle built without ``speculative`` (the draft is split over TP already: ``parts`` has its share)."""
    weights = sum(parts.values()) - parts["draft"]
    lay = dataclasses.replace(layout, draft_kv_heads=0, draft_head_dim=0)
    out = {"weight_bytes": weights, "kv_bytes_per_block": lay.bytes_per_block}
    if device_bytes is not None:
        out["max_num_blocks"] = device_fit(device_bytes, weights, lay)["max_num_blocks_by_memory"]
    return {"no_draft": out}


def per_rank(recipe, device_bytes: int | None = None, artifact: dict | None = None) -> dict:
    """The ``memory`` document of ``plan --json``: per rank, and with ``device_bytes`` the fit."""
    layout = recipe_kv_layout(recipe)
    parts = weight_parts(recipe)
    draft_w = parts["draft"]
    cfg = recipe.model.config
    rank = {
        "weight_bytes": sum(parts.values()), "draft_weight_bytes": draft_w,
        "weight_parts_bytes": parts, "weights_dtype": recipe.model.weights_dtype, "experts": recipe.model.experts,
        "kv_bytes": layout.total_bytes, "kv_target_bytes": layout.target_bytes, "kv_draft_bytes": layout.draft_bytes,
        "kv_bytes_per_block": layout.bytes_per_block, "num_blocks": layout.num_blocks,
        "kv_formula": (f"{layout.num_buffers} buffers x 2 x {layout.num_blocks} blocks x {layout.kv_heads} KV "
                       f"head(s) x {layout.block_size} x {layout.head_dim} x {layout.itemsize} B"
                       + (f" + draft 2 x {layout.num_blocks} x {layout.draft_kv_heads} x {layout.block_size} x "
                          f"{layout.draft_head_dim} x {layout.itemsize} B" if layout.has_draft else "")),
        "largest_artifact": artifact or {"label": None, "bytes": None, "source": "unknown"},
        "sharding_outlook": sharding_outlook(parts, layout, device_bytes),
    }
    out = {"per_rank": rank, "reserve_percent": RESERVE_PERCENT}
    cap = backend_kv_limit(recipe.backend, layout)
    if cap is not None:
        out["kv_offset_limit"] = cap
    if device_bytes is not None:
        fit = device_fit(device_bytes, rank["weight_bytes"], layout, cap=cap)
        groups = kv_groups(cfg.sliding_window if cfg.has_sliding_layers else None)
        q = 1 + recipe.num_speculative_tokens
        fit["min_num_blocks"] = min_pool_blocks(recipe.max_model_len, recipe.block_size, groups, q)
        fit["max_model_len_sequences"] = (max(0, fit["max_num_blocks"] - 1)
                                          // max(1, fit["min_num_blocks"] - 1))
        out["device"] = fit
    return out


def describe(doc: dict) -> list[str]:
    """Text lines for ``plan``."""
    r = doc["per_rank"]
    art = r["largest_artifact"]
    parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in r["weight_parts_bytes"].items() if v)
    lines = [f"memory per rank: weights {fmt_bytes(r['weight_bytes'])}"
             + (f" (draft {fmt_bytes(r['draft_weight_bytes'])})" if r["draft_weight_bytes"] else "")
             + f", KV {fmt_bytes(r['kv_bytes'])} = target {fmt_bytes(r['kv_target_bytes'])}"
             + (f" + draft {fmt_bytes(r['kv_draft_bytes'])}" if r["kv_draft_bytes"] else ""),
             f"  weights ({r['weights_dtype']}, experts {r['experts']}): {parts}",
             f"  KV: {r['kv_formula']} ({fmt_bytes(r['kv_bytes_per_block'])} per block)",
             f"  largest artifact: {fmt_bytes(art['bytes'])}" + (f" ({art['label']}, {art['source']})"
                                                                 if art.get("label") else
                                                                 " (no past compile of these targets in the cache)")]
    if "kv_offset_limit" in doc:
        lines.append(f"  32-bit KV offsets: num_blocks <= {doc['kv_offset_limit']}")
    out = r["sharding_outlook"]["no_draft"]
    if "max_num_blocks" in out and r["draft_weight_bytes"]:
        lines.append(f"  without the draft: weights {fmt_bytes(out['weight_bytes'])} and "
                     f"{out['max_num_blocks']} blocks")
    d = doc.get("device")
    if d:
        verdict = "fits" if d["fits"] else "does NOT fit"
        lines.append(f"device memory {fmt_bytes(d['device_memory_bytes'])} per rank: {verdict} (needs "
                     f"{fmt_bytes(d['needed_bytes'])} of {fmt_bytes(d['usable_bytes'])} after the "
                     f"{doc['reserve_percent']}% reserve)")
        why = "" if d["limited_by"] == "memory" else " (capped by 32-bit KV offsets)"
        lines.append(f"  largest num_blocks that fits: {d['max_num_blocks']}{why}, "
                     f"{d['max_model_len_sequences']} max_model_len sequence(s) at once")
        if d["max_num_blocks"] < d["min_num_blocks"]:
            lines.append(f"  that is below the {d['min_num_blocks']} blocks one max_model_len sequence needs")
    return lines
