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
from neffbuild.errors import BuildFailed
from neffbuild.runtime import parallel, world
from neffbuild.runtime.buckets import table_width
from neffbuild.runtime.kv_cache import KVLayout


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

    @property
    def config(self):
        return registry.arch(self.arch).get("config").from_hf_dict(self.hf_config)

    @property
    def layout(self) -> parallel.ParallelLayout:
        return parallel.ParallelLayout(self.tp, self.dp, self.ep)

    def kv_layout(self) -> KVLayout:
        return _kv_layout(self.config, self.num_blocks, self.block_size, self.fp8_packed_kv, self.layout)


def spec_for(recipe, target) -> GraphSpec:
    return GraphSpec(recipe.model.arch, recipe.model.hf_config, target.family, target.batch, target.ctx,
                     target.query_len, recipe.block_size, recipe.num_blocks, recipe.num_swa, recipe.fp8_packed_kv,
                     recipe.tp, recipe.dp, recipe.ep)


def layout_for(recipe) -> parallel.ParallelLayout:
    return parallel.ParallelLayout(recipe.tp, recipe.dp, recipe.ep)


def kv_layout_for(recipe) -> KVLayout:
    """One rank's KV layout (its KV heads)."""
    return _kv_layout(recipe.model.config, recipe.num_blocks, recipe.block_size, recipe.fp8_packed_kv,
                      layout_for(recipe))


def _kv_layout(cfg, num_blocks: int, block_size: int, fp8_packed_kv: bool, par) -> KVLayout:
    # The recipe's one FP8 switch turns on both the FP8 dtype and the packed K layout.
    local = registry.arch_of(cfg).get("local_config")(cfg, par)  # this rank's KV heads
    return KVLayout(cfg.num_kv_buffers, num_blocks, local.num_key_value_heads, block_size,
                    cfg.head_dim, fp8=fp8_packed_kv, packed_k=fp8_packed_kv)


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


def example_inputs(spec: GraphSpec, *, caches: bool = True) -> tuple:
    """Zeroed inputs of the target's shapes (pad write slots); ``caches=False`` leaves the KV caches out."""
    B, q = spec.batch, spec.query_len
    layout = spec.kv_layout()
    long = {"dtype": torch.long}
    return (
        torch.zeros(B, q, **long),  # input_ids
        torch.zeros(B, q, **long),  # positions
        torch.zeros(B, table_width(spec.ctx, spec.block_size), **long),  # block_table
        torch.zeros(B, max(spec.num_swa, 1), **long),  # block_table_swa
        torch.zeros(B, **long),  # swa_kv_pos_offset
        torch.full((B * q,), -1, **long),  # slot_mapping
        torch.full((B * q,), -1, **long),  # slot_mapping_swa
        tuple(torch.zeros(layout.buffer_shape, dtype=layout.graph_dtype) for _ in range(layout.num_buffers))
        if caches else None,
    ) + ((parallel.rank_tensor(0),) if spec.layout.sharded else ())


INPUT_NAMES = ("input_ids", "positions", "block_table", "block_table_swa", "swa_kv_pos_offset", "slot_mapping",
               "slot_mapping_swa", "kv_caches", "rank")


def input_signature(inputs: tuple) -> list[dict]:
    out = []
    for name, value in zip(INPUT_NAMES, inputs, strict=False):
        items = value if isinstance(value, tuple) else (value,)
        for n, t in enumerate(items):
            out.append({"name": f"{name}[{n}]" if isinstance(value, tuple) else name, "shape": list(t.shape),
                        "dtype": str(t.dtype).removeprefix("torch.")})
    return out


def build_graph(spec: GraphSpec, weights: dict[str, torch.Tensor] | None = None):
    """(module, example inputs) for one target; placeholder weights unless given."""
    if spec.family == "draft":
        raise BuildFailed(f"{spec.family}: the EAGLE3 draft graph (models/eagle3) is not implemented yet")
    cfg, arch, par = spec.config, registry.arch(spec.arch), spec.layout
    if weights is None:  # one rank's shapes: every rank runs the same graph on its own shard
        shapes = arch.get("rank_shapes")(cfg, par)
        weights = {n: torch.empty(shape, dtype=torch.float32) for n, shape in shapes.items()}
    aux = arch.get("aux_layers")(cfg.num_hidden_layers) if spec.family in ("target_spec", "target_nospec") else None
    module = arch.get("decode")(cfg, weights, packed_k=spec.fp8_packed_kv, aux_layers=aux, parallel=par).eval()
    return module, example_inputs(spec)
