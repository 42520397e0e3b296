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

import torch

from neffbuild import registry
from neffbuild.compiler.graph_spec import (  # noqa: F401  (torch-free; re-exported)
    GraphSpec,
    draft_config_for,
    kv_layout_for,
    layout_for,
    spec_for,
)
from neffbuild.models.eagle3 import weights as draft_weights
from neffbuild.models.eagle3.draft import Eagle3Draft
from neffbuild.runtime import parallel, world
from neffbuild.runtime.buckets import table_width
from neffbuild.runtime.dispatch import DRAFT, TARGET_NOSPEC, TARGET_SPEC


def draft_example_inputs(spec: GraphSpec) -> tuple:
    B, q, layout = spec.batch, spec.query_len, spec.kv_layout()
    long = {"dtype": torch.long}
    return (
        torch.zeros(B, q, **long),  # input_ids
        torch.zeros(B, q, **long),  # positions
        torch.zeros(B, q, 3 * spec.config.hidden_size),  # hidden (the target's aux states)
        torch.zeros(B, **long),  # num_valid
        torch.zeros(B, table_width(spec.ctx, spec.block_size), **long),  # block_table
        torch.full((B * q,), -1, **long),  # slot_mapping
        torch.zeros(layout.draft_buffer_shape, dtype=layout.graph_dtype),  # kv_cache (the draft's group)
    )


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
    if spec.family == DRAFT:
        return draft_example_inputs(spec)
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
DRAFT_INPUT_NAMES = ("input_ids", "positions", "hidden", "num_valid", "block_table", "slot_mapping", "kv_cache")


def input_signature(inputs: tuple, family: str | None = None) -> list[dict]:
    out = []
    names = DRAFT_INPUT_NAMES if family == DRAFT else INPUT_NAMES
    for name, value in zip(names, inputs, strict=False):  # "rank" only in sharded graphs
        items = value if isinstance(value, tuple) else (value,)
        for n, t in enumerate(items):
            out.append({"name": f"{name}[{n}]" if isinstance(value, tuple) else name, "shape": list(t.shape),
                        "dtype": str(t.dtype).removeprefix("torch.")})
    return out


def build_graph(spec: GraphSpec, weights: dict[str, torch.Tensor] | None = None):
    """(module, example inputs) for one target; placeholder weights unless given."""
    if spec.family == DRAFT:
        return _draft_graph(spec, weights)
    cfg, arch, par = spec.config, registry.arch(spec.arch), spec.layout
    if weights is None:  # one rank's shapes: every rank runs the same graph on its own shard
        shapes = arch.get("rank_shapes")(cfg, par)
        weights = {n: torch.empty(shape, dtype=torch.float32) for n, shape in shapes.items()}
    # EAGLE3 target families output the layers the draft fuses (the draft config's, default from the arch).
    aux = None
    if spec.family in (TARGET_SPEC, TARGET_NOSPEC):  # without a draft config: the architecture's default layers
        aux = spec.draft_config.aux_layers if spec.draft_config else arch.get("aux_layers")(cfg.num_hidden_layers)
    module = arch.get("decode")(cfg, weights, packed_k=spec.fp8_packed_kv, aux_layers=aux, parallel=par).eval()
    return module, example_inputs(spec)


def _draft_graph(spec: GraphSpec, weights: dict[str, torch.Tensor] | None):
    dcfg = spec.draft_config
    if weights is None:
        weights = draft_weights.placeholders(dcfg)
        embed = torch.empty(registry.arch(spec.arch).get("placeholder_shapes")(spec.config)["embed"])
        weights[draft_weights.DRAFT_EMBED if spec.draft_own_embed else "embed"] = embed
    module = Eagle3Draft(dcfg, weights, num_speculative_tokens=spec.num_speculative_tokens,
                         packed_k=spec.fp8_packed_kv).eval()
    return module, draft_example_inputs(spec)
