"""What shapes one compiled graph (``TargetGraph``), and one rank's KV layout: torch-free.

``compiler/graphs.py`` turns a TargetGraph into a traced module (torch); this module only
describes it, so ``plan`` (memory, compile RSS) and the executors' memory estimates read a
target's shapes without importing torch. ``graphs.py`` re-exports every name here.
"""

from __future__ import annotations

from dataclasses import dataclass

from neffbuild import memory, registry
from neffbuild.runtime import parallel
from neffbuild.runtime.kv.layout import KVLayout


@dataclass(frozen=True)
class TargetGraph:
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
    speculative_method: str | None = None  # a registry.SPECULATIVE name, with draft_hf_config
    weights_dtype: str = "float32"  # model.weights_dtype: the placeholders' (and so the artifact's) dtype
    experts: str = "dense"  # model.experts: dense | mxfp4 (packed blocks and scales as graph constants)
    kv_dtype: str = "float32"  # neuron_config.kv_dtype (without fp8_packed_kv)

    @property
    def config(self):
        return registry.arch(self.arch).get("config").from_hf_dict(self.hf_config)

    @property
    def draft_config(self):
        if self.draft_hf_config is None:
            return None
        return registry.speculative(self.speculative_method).get("config").from_hf_dict(self.draft_hf_config,
                                                                                        self.config)

    @property
    def parallel(self) -> parallel.ParallelLayout:
        return parallel.ParallelLayout(self.tp, self.dp, self.ep)

    def kv_layout(self) -> KVLayout:
        return _kv_layout(self.config, self.draft_config, self.num_blocks, self.block_size, self.fp8_packed_kv,
                          self.parallel, self.kv_dtype)


def target_graph_from(gi, family: str, batch: int, ctx: int, query_len: int) -> TargetGraph:
    """The TargetGraph of one grid cell of an existing bundle (``runtime.graph_inputs.GraphInputs``): its KV
    dtype from the bundle's KV layout; the weights' form is that of the weights the caller builds it with."""
    p = gi.parallel
    return TargetGraph(gi.arch, gi.model_config, family, batch, ctx, query_len, gi.block_size, gi.num_blocks,
                     gi.num_swa, gi.fp8_packed_kv, p.tp, p.dp, p.ep, draft_hf_config=gi.draft_config,
                     num_speculative_tokens=gi.grid.num_speculative_tokens,
                     speculative_method=gi.speculative_method, kv_dtype=gi.kv_layout.kv_dtype)


def target_graph(recipe, target) -> TargetGraph:
    s = recipe.speculative
    method = registry.speculative(s.method) if s else None
    own_embed = bool(s and s.draft_checkpoint and method.get("has_own_embed")(s.draft_checkpoint))
    return TargetGraph(recipe.model.arch, recipe.model.hf_config, target.family, target.batch, target.ctx,
                     target.query_len, recipe.block_size, recipe.num_blocks, recipe.num_swa, recipe.fp8_packed_kv,
                     recipe.tp, recipe.dp, recipe.ep, draft_hf_config=s.draft_hf_config if s else None,
                     num_speculative_tokens=recipe.num_speculative_tokens, draft_own_embed=own_embed,
                     speculative_method=s.method if s else None, weights_dtype=recipe.model.weights_dtype,
                     experts=recipe.model.experts, kv_dtype=recipe.kv_dtype)


def draft_config_for(recipe):
    """The speculative method's draft config (None without a speculative section)."""
    s = recipe.speculative
    return registry.speculative(s.method).get("config").from_hf_dict(s.draft_hf_config, recipe.model.config) \
        if s else None


def layout_for(recipe) -> parallel.ParallelLayout:
    return parallel.ParallelLayout(recipe.tp, recipe.dp, recipe.ep)


def kv_layout_for(recipe) -> KVLayout:
    """One rank's KV layout (its KV heads; the EAGLE3 draft's group is not sharded)."""
    return _kv_layout(recipe.model.config, draft_config_for(recipe), recipe.num_blocks, recipe.block_size,
                      recipe.fp8_packed_kv, layout_for(recipe), recipe.kv_dtype)


def _kv_layout(cfg, dcfg, num_blocks: int, block_size: int, fp8_packed_kv: bool, par,
               kv_dtype: str = "float32") -> KVLayout:
    return memory.kv_layout(cfg, dcfg, num_blocks, block_size, fp8_packed_kv, par, kv_dtype)


def graph_summary(graph: TargetGraph) -> dict:
    """The shape fields a cache entry records (``graph``): plan's diff and the memory estimates match on them."""
    out = {"family": graph.family, "batch": graph.batch, "ctx": graph.ctx, "query_len": graph.query_len,
           "block_size": graph.block_size, "num_blocks": graph.num_blocks, "num_swa": graph.num_swa,
           "fp8_packed_kv": graph.fp8_packed_kv, "tp": graph.tp, "dp": graph.dp, "ep": graph.ep}
    for name, default in (("weights_dtype", "float32"), ("experts", "dense"), ("kv_dtype", "float32")):
        if getattr(graph, name) != default:  # a default-dtype graph summarises as before
            out[name] = getattr(graph, name)
    return out
