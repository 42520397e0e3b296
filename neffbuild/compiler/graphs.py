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
    TargetGraph,
    target_graph,
    target_graph_from,
)
from neffbuild.runtime import parallel, world
from neffbuild.runtime.step import inputs as step_inputs
from neffbuild.runtime.step.dispatch import DRAFT, TARGET_NOSPEC, TARGET_SPEC


def dims(graph: TargetGraph) -> step_inputs.Dims:
    """The shape inputs of the step-input table (runtime/step/inputs.py) for one target."""
    return step_inputs.Dims(graph.batch, graph.ctx, graph.query_len, graph.block_size, graph.num_swa,
                            graph.kv_layout().to_json(), hidden_size=graph.config.hidden_size,
                            sharded=graph.parallel.sharded)


def _example(inp: step_inputs.Input, d: step_inputs.Dims) -> torch.Tensor:
    return torch.full(inp.shape(d), inp.fill, dtype=getattr(torch, inp.dtype_of(d)))


_FAKE_MODE: list = []  # set by fake_example_inputs(): example inputs become fake tensors (no memory)


@contextlib.contextmanager
def fake_example_inputs():
    """Example inputs as fake tensors of the same shapes, dtypes and device: tracing for a cache key
    (``plan``) then never allocates the KV pool (num_blocks 2**24 is 64 GiB); the graph text is the same."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    _FAKE_MODE.append(FakeTensorMode(allow_non_fake_inputs=True))
    try:
        yield
    finally:
        _FAKE_MODE.pop()


def _inputs_mode():
    return _FAKE_MODE[-1] if _FAKE_MODE else contextlib.nullcontext()


def draft_example_inputs(graph: TargetGraph) -> tuple:
    d = dims(graph)
    with _inputs_mode():
        rank = (parallel.rank_tensor(0),) if d.sharded else ()
        return tuple(_example(i, d) for i in step_inputs.DRAFT_INPUTS) + rank


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
    with _inputs_mode():
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
    if weights is None:  # one rank's shapes and stored dtypes: every rank runs the same graph on its own shard
        specs = arch.get("rank_specs")(cfg, par, arch.get("weight_form")(graph.weights_dtype, graph.experts))
        weights = {n: torch.empty(shape, dtype=getattr(torch, dtype)) for n, (shape, dtype) in specs.items()}
    # EAGLE3 target families output the layers the draft fuses (the draft config's, default from the arch).
    aux = None
    if graph.family in (TARGET_SPEC, TARGET_NOSPEC):  # without a draft config: the architecture's default layers
        aux = graph.draft_config.aux_layers if graph.draft_config else arch.get("aux_layers")(cfg.num_hidden_layers)
    module = arch.get("decode")(cfg, weights, packed_k=graph.fp8_packed_kv, aux_layers=aux, parallel=par,
                                **graph.kernel_forms()).eval()
    return module, example_inputs(graph)


def _draft_graph(graph: TargetGraph, weights: dict[str, torch.Tensor] | None):
    dcfg, method = graph.draft_config, registry.speculative(graph.speculative_method)
    if weights is None:  # one rank's draft shard in the stored dtype (its own embedding too, when it has one)
        weights = method.get("placeholders")(dcfg, graph.parallel, graph.weights_dtype, graph.draft_own_embed)
        if not graph.draft_own_embed:  # the target's, shared: the rank's vocabulary slice under tp > 1
            shape = registry.arch(graph.arch).get("rank_specs")(graph.config, graph.parallel)["embed"][0]
            weights["embed"] = torch.empty(shape, dtype=getattr(torch, graph.weights_dtype))
    module = method.get("draft")(dcfg, weights, num_speculative_tokens=graph.num_speculative_tokens,
                                 packed_k=graph.fp8_packed_kv, parallel=graph.parallel).eval()
    return module, draft_example_inputs(graph)
