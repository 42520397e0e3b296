"""Target -> (module, example inputs): the graph each grid cell compiles.

Weights in the traced module are uninitialised placeholders of the right shapes and
dtypes: artifacts carry no weights (they are bound at load), so values never matter here
and a worker never reads the checkpoint. A sharded target (tp or ep above 1) is one
rank's graph, the same for every rank: one rank's weight shapes, one rank's KV heads, the
rank id as its last input, collectives over named groups (``placeholder_groups`` while
tracing and compiling).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from neffbuild import registry
from neffbuild.runtime import parallel, step_inputs, world
from neffbuild.runtime.dispatch import DRAFT, TARGET_NOSPEC, TARGET_SPEC
from neffbuild.runtime.kv_cache import KVLayout


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

    layout = parallel  # the old name, kept while branches written against it merge

    def kv_layout(self) -> KVLayout:
        return _kv_layout(self.config, self.draft_config, self.num_blocks, self.block_size, self.fp8_packed_kv,
                          self.parallel)


# Old names, kept while branches written against them merge ("spec" now means speculative decoding only).
GraphSpec = TargetGraph


def spec_for(recipe, target) -> TargetGraph:
    return target_graph(recipe, target)


def target_graph_from(gi, family: str, batch: int, ctx: int, query_len: int) -> TargetGraph:
    """The TargetGraph of one grid cell of an existing bundle (``runtime.graph_inputs.GraphInputs``)."""
    p = gi.parallel
    return TargetGraph(gi.arch, gi.model_config, family, batch, ctx, query_len, gi.block_size, gi.num_blocks,
                     gi.num_swa, gi.fp8_packed_kv, p.tp, p.dp, p.ep, draft_hf_config=gi.draft_config,
                     num_speculative_tokens=gi.grid.num_speculative_tokens,
                     speculative_method=next(iter(registry.SPECULATIVE)) if gi.draft_config is not None else None)


def target_graph(recipe, target) -> TargetGraph:
    s = recipe.speculative
    method = registry.speculative(s.method) if s else None
    own_embed = bool(s and s.draft_checkpoint and method.get("has_own_embed")(s.draft_checkpoint))
    return TargetGraph(recipe.model.arch, recipe.model.hf_config, target.family, target.batch, target.ctx,
                     target.query_len, recipe.block_size, recipe.num_blocks, recipe.num_swa, recipe.fp8_packed_kv,
                     recipe.tp, recipe.dp, recipe.ep, draft_hf_config=s.draft_hf_config if s else None,
                     num_speculative_tokens=recipe.num_speculative_tokens, draft_own_embed=own_embed,
                     speculative_method=s.method if s else None)


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
                      recipe.fp8_packed_kv, layout_for(recipe))


def _kv_layout(cfg, dcfg, num_blocks: int, block_size: int, fp8_packed_kv: bool,
               par) -> KVLayout:
    # The recipe's one FP8 switch turns on both the FP8 dtype and the packed K layout (the draft's group too).
    local = registry.arch_of(cfg).get("local_config")(cfg, par)  # this rank's KV heads
    return KVLayout(cfg.num_kv_buffers, num_blocks, local.num_key_value_heads, block_size, cfg.head_dim,
                    fp8=fp8_packed_kv, packed_k=fp8_packed_kv,
                    draft_kv_heads=dcfg.num_key_value_heads if dcfg else 0, draft_head_dim=dcfg.head_dim if dcfg else 0)


def dims(graph: TargetGraph) -> step_inputs.Dims:
    """The shape inputs of the step-input table (runtime/step_inputs.py) for one target."""
    return step_inputs.Dims(graph.batch, graph.ctx, graph.query_len, graph.block_size, graph.num_swa,
                            graph.kv_layout().to_json(), hidden_size=graph.config.hidden_size,
                            sharded=graph.parallel.sharded)


def _example(inp: step_inputs.Input, d: step_inputs.Dims) -> torch.Tensor:
    return torch.full(inp.shape(d), inp.fill, dtype=getattr(torch, inp.dtype_of(d)))


def draft_example_inputs(graph: TargetGraph) -> tuple:
    d = dims(graph)
    return tuple(_example(i, d) for i in step_inputs.DRAFT_INPUTS)


@contextlib.contextmanager
def placeholder_groups(par: parallel.ParallelLayout):
    """Trace and compile a sharded graph without peers: unconnected groups of the right sizes
    stand under the graph's group names (inductor asks a group its size; nothing communicates)."""
    from torch._C._distributed_c10d import ProcessGroup, _unregister_process_group

    sizes = {parallel.TP_GROUP: par.tp, parallel.EP_GROUP: par.ep}
    keep = {name: ProcessGroup(0, size) for name, size in sizes.items() if size > 1}  # the registry holds weak refs
    for name, pg in keep.items():
        world.register(name, pg)
    try:
        yield
    finally:
        for name in keep:
            _unregister_process_group(name)


def example_inputs(graph: TargetGraph, *, caches: bool = True) -> tuple:
    """Zeroed inputs of the target's shapes (pad write slots); ``caches=False`` leaves the KV caches out."""
    if graph.family == DRAFT:
        return draft_example_inputs(graph)
    d = dims(graph)
    kv = tuple(_example(step_inputs.KV_CACHES, d) for _ in range(d.kv_layout["num_buffers"])) if caches else None
    rank = (parallel.rank_tensor(0),) if d.sharded else ()
    return tuple(_example(i, d) for i in step_inputs.STEP_INPUTS) + (kv,) + rank


INPUT_NAMES, DRAFT_INPUT_NAMES = step_inputs.INPUT_NAMES, step_inputs.DRAFT_INPUT_NAMES


def input_signature(inputs: tuple, family: str | None = None) -> list[dict]:
    out = []
    names = DRAFT_INPUT_NAMES if family == DRAFT else INPUT_NAMES
    for name, value in zip(names, inputs, strict=False):  # "rank" only in sharded graphs
        items = value if isinstance(value, tuple) else (value,)
        for n, t in enumerate(items):
            out.append({"name": f"{name}[{n}]" if isinstance(value, tuple) else name, "shape": list(t.shape),
                        "dtype": str(t.dtype).removeprefix("torch.")})
    return out


def build_graph(graph: TargetGraph, weights: dict[str, torch.Tensor] | None = None):
    """(module, example inputs) for one target; placeholder weights unless given."""
    if graph.family == DRAFT:
        return _draft_graph(graph, weights)
    cfg, arch, par = graph.config, registry.arch(graph.arch), graph.parallel
    if weights is None:  # one rank's shapes: every rank runs the same graph on its own shard
        shapes = arch.get("rank_shapes")(cfg, par)
        weights = {n: torch.empty(shape, dtype=torch.float32) for n, shape in shapes.items()}
    # EAGLE3 target families output the layers the draft fuses (the draft config's, default from the arch).
    aux = None
    if graph.family in (TARGET_SPEC, TARGET_NOSPEC):  # without a draft config: the architecture's default layers
        aux = graph.draft_config.aux_layers if graph.draft_config else arch.get("aux_layers")(cfg.num_hidden_layers)
    module = arch.get("decode")(cfg, weights, packed_k=graph.fp8_packed_kv, aux_layers=aux, parallel=par).eval()
    return module, example_inputs(graph)


def _draft_graph(graph: TargetGraph, weights: dict[str, torch.Tensor] | None):
    dcfg, method = graph.draft_config, registry.speculative(graph.speculative_method)
    if weights is None:
        weights = method.get("placeholders")(dcfg)
        embed = torch.empty(registry.arch(graph.arch).get("placeholder_shapes")(graph.config)["embed"])
        weights[method.get("embed_name")(graph.draft_own_embed)] = embed
    module = method.get("draft")(dcfg, weights, num_speculative_tokens=graph.num_speculative_tokens,
                         packed_k=graph.fp8_packed_kv).eval()
    return module, draft_example_inputs(graph)
