"""What shapes one compiled graph (``TargetGraph``): torch-free.

``compiler/graphs.py`` turns a TargetGraph into a traced module (torch); this module only
describes it, so ``plan`` (memory, compile RSS) and the executors' memory estimates read a
target's shapes without importing torch. ``graphs.py`` re-exports every name here.
"""

from __future__ import annotations

from dataclasses import dataclass

from neffbuild import memory
from neffbuild.grid import Target
from neffbuild.runtime.bundle.graph_inputs import GraphInputs
from neffbuild.runtime.kv.layout import KVLayout
from neffbuild.runtime.step.dispatch import label


@dataclass(frozen=True)
class TargetGraph:
    """Everything that shapes one compiled graph (picklable, sent to workers): a grid cell (``grid.Target``)
    of a bundle's inputs (``GraphInputs``, the manifest's ``graph_inputs``), and the form its weights take."""

    target: Target
    inputs: GraphInputs
    weights_dtype: str = "float32"  # model.weights_dtype: the placeholders' (and so the artifact's) dtype
    experts: str = "dense"  # model.experts: dense | mxfp4 (packed blocks and scales as graph constants)
    draft_own_embed: bool = False  # the draft checkpoint brings its own token embedding
    expert_kernel: str = "exact"  # model.expert_kernel: exact | int8 (a different op in the graph)
    head_kernel: str = "exact"  # model.head_kernel: exact | int8
    attn_kernel: str = "exact"  # model.attn_kernel: exact | int8 (the qkv and o projections)

    # the cell
    family = property(lambda self: self.target.family)
    batch = property(lambda self: self.target.batch)
    ctx = property(lambda self: self.target.ctx)
    query_len = property(lambda self: self.target.query_len)
    label = property(lambda self: self.target.label)
    # the bundle's
    arch = property(lambda self: self.inputs.arch)
    block_size = property(lambda self: self.inputs.block_size)
    num_blocks = property(lambda self: self.inputs.num_blocks)
    num_swa = property(lambda self: self.inputs.num_swa)
    fp8_packed_kv = property(lambda self: self.inputs.fp8_packed_kv)
    parallel = property(lambda self: self.inputs.parallel)
    num_speculative_tokens = property(lambda self: self.inputs.grid.num_speculative_tokens)
    speculative_method = property(lambda self: self.inputs.speculative_method)

    @property
    def config(self):
        return self.inputs.config()

    @property
    def draft_config(self):
        return self.inputs.draft(self.config)

    def kv_layout(self) -> KVLayout:
        return self.inputs.kv_layout

    def spec(self) -> dict:
        """What shapes this graph, as JSON (the pre-key hashes it). The bundle's other cells (its bucket lists,
        max_model_len) shape nothing here, so adding a bucket keeps every other graph's pre-key; dp counts only
        in a sharded graph, as in the cache key."""
        i = self.inputs
        out = {"target": self.target.to_json(), "arch": i.arch, "model_config": i.model_config,
               "block_size": i.block_size, "num_blocks": i.num_blocks, "num_swa": i.num_swa,
               "fp8_packed_kv": i.fp8_packed_kv, "kv_layout": i.kv_layout.to_json(),
               "num_speculative_tokens": i.grid.num_speculative_tokens, "draft_config": i.draft_config,
               "speculative_method": i.speculative_method, "weights_dtype": self.weights_dtype,
               "experts": self.experts, "draft_own_embed": self.draft_own_embed}
        if i.parallel.sharded:
            out["parallel"] = i.parallel.to_json()
        out.update(self.kernel_forms())
        return out

    def kernel_forms(self) -> dict:
        """The opt-in int8 forms this graph computes with (none: the exact forms, whose keys stay as before)."""
        forms = (("expert_kernel", self.expert_kernel), ("head_kernel", self.head_kernel),
                 ("attn_kernel", self.attn_kernel))
        return {k: v for k, v in forms if v != "exact"}


def target_graph_from(gi: GraphInputs, family: str, batch: int, ctx: int, query_len: int) -> TargetGraph:
    """The TargetGraph of one grid cell of an existing bundle; the weights' form is that of the weights the
    caller builds it with."""
    return TargetGraph(Target(family, batch, ctx, query_len, label(family, batch, ctx, query_len)), gi)


def target_graph(recipe, target: Target) -> TargetGraph:
    return TargetGraph(target, GraphInputs.from_recipe(recipe, memory.recipe_kv_layout(recipe)),
                       weights_dtype=recipe.model.weights_dtype, experts=recipe.model.experts,
                       draft_own_embed=recipe.draft_own_embed, expert_kernel=recipe.model.expert_kernel,
                       head_kernel=recipe.model.head_kernel, attn_kernel=recipe.model.attn_kernel)


def graph_summary(graph: TargetGraph) -> dict:
    """The shape fields a cache entry records (``graph``): plan's diff and the memory estimates match on them."""
    out = {"family": graph.family, "batch": graph.batch, "ctx": graph.ctx, "query_len": graph.query_len,
           "block_size": graph.block_size, "num_blocks": graph.num_blocks, "num_swa": graph.num_swa,
           "fp8_packed_kv": graph.fp8_packed_kv, "tp": graph.parallel.tp, "dp": graph.parallel.dp,
           "ep": graph.parallel.ep}
    forms = {"weights_dtype": graph.weights_dtype, "experts": graph.experts, "kv_dtype": graph.kv_layout().kv_dtype}
    for name, default in (("weights_dtype", "float32"), ("experts", "dense"), ("kv_dtype", "float32")):
        if forms[name] != default:  # a default-dtype graph summarises as before
            out[name] = forms[name]
    out.update(graph.kernel_forms())
    return out
