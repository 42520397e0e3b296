"""What shapes one compiled graph (``GraphSpec``), and one rank's KV layout: torch-free.

``compiler/graphs.py`` turns a GraphSpec into a traced module (torch); this module only
describes it, so ``plan`` (memory, compile RSS) and the executors' memory estimates read a
target's shapes without importing torch. ``graphs.py`` re-exports every name here.
"""

from __future__ import annotations

from dataclasses import dataclass

from neffbuild import registry
from neffbuild.models.eagle3.config import Eagle3Config
from neffbuild.models.eagle3.shapes import has_own_embed
from neffbuild.runtime import parallel
from neffbuild.runtime.kv_layout import KVLayout


@dataclass(frozen=True)
class GraphSpec:
    """Everything that shapes one compiled graph (picklable, sent to workers)."""

    arch: str
    hf_config: dict
    family: str
    batch: int
    ctx: int
    query_len: int
    block_size: int
    num_blocks: int
    num_swa: int
    fp8_packed_kv: bool
    tp: int = 1
    dp: int = 1
    ep: int = 1
    draft_hf_config: dict | None = None  # EAGLE3 recipes: the draft's config (aux layers, widths)
    num_speculative_tokens: int = 0
    draft_own_embed: bool = False  # the draft checkpoint brings its own token embedding

    @property
    def config(self):
        return registry.arch(self.arch).get("config").from_hf_dict(self.hf_config)

    @property
    def draft_config(self) -> Eagle3Config | None:
        return None if self.draft_hf_config is None else Eagle3Config.from_hf_dict(self.draft_hf_config, self.config)

    @property
    def layout(self) -> parallel.ParallelLayout:
        return parallel.ParallelLayout(self.tp, self.dp, self.ep)

    def kv_layout(self) -> KVLayout:
        return _kv_layout(self.config, self.draft_config, self.num_blocks, self.block_size, self.fp8_packed_kv,
                          self.layout)


def spec_for(recipe, target) -> GraphSpec:
    s = recipe.speculative
    own_embed = bool(s and s.draft_checkpoint and has_own_embed(s.draft_checkpoint))
    return GraphSpec(recipe.model.arch, recipe.model.hf_config, target.family, target.batch, target.ctx,
                     target.query_len, recipe.block_size, recipe.num_blocks, recipe.num_swa, recipe.fp8_packed_kv,
                     recipe.tp, recipe.dp, recipe.ep, draft_hf_config=s.draft_hf_config if s else None,
                     num_speculative_tokens=recipe.num_speculative_tokens, draft_own_embed=own_embed)


def draft_config_for(recipe) -> Eagle3Config | None:
    s = recipe.speculative
    return Eagle3Config.from_hf_dict(s.draft_hf_config, recipe.model.config) if s else None


def layout_for(recipe) -> parallel.ParallelLayout:
    return parallel.ParallelLayout(recipe.tp, recipe.dp, recipe.ep)


def kv_layout_for(recipe) -> KVLayout:
    """One rank's KV layout (its KV heads; the EAGLE3 draft's group is not sharded)."""
    return _kv_layout(recipe.model.config, draft_config_for(recipe), recipe.num_blocks, recipe.block_size,
                      recipe.fp8_packed_kv, layout_for(recipe))


def _kv_layout(cfg, dcfg: Eagle3Config | None, num_blocks: int, block_size: int, fp8_packed_kv: bool,
               par) -> KVLayout:
    # The recipe's one FP8 switch turns on both the FP8 dtype and the packed K layout (the draft's group too).
    local = registry.arch_of(cfg).get("local_config")(cfg, par)  # this rank's KV heads
    return KVLayout(cfg.num_kv_buffers, num_blocks, local.num_key_value_heads, block_size, cfg.head_dim,
                    fp8=fp8_packed_kv, packed_k=fp8_packed_kv,
                    draft_kv_heads=dcfg.num_key_value_heads if dcfg else 0, draft_head_dim=dcfg.head_dim if dcfg else 0)


def graph_summary(graph: GraphSpec) -> dict:
    """The shape fields a cache entry records (``graph``): plan's diff and the memory estimates match on them."""
    return {"family": graph.family, "batch": graph.batch, "ctx": graph.ctx, "query_len": graph.query_len,
            "block_size": graph.block_size, "num_blocks": graph.num_blocks, "num_swa": graph.num_swa,
            "fp8_packed_kv": graph.fp8_packed_kv, "tp": graph.tp, "dp": graph.dp, "ep": graph.ep}
