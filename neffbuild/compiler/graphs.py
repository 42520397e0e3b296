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
from neffbuild.models.eagle3 import weights as draft_weights
from neffbuild.models.eagle3.config import Eagle3Config
from neffbuild.models.eagle3.draft import Eagle3Draft
from neffbuild.runtime import parallel, world
from neffbuild.runtime.buckets import table_width
from neffbuild.runtime.dispatch import DRAFT, TARGET_NOSPEC, TARGET_SPEC
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
    own_embed = bool(s and s.draft_checkpoint and draft_weights.has_own_embed(s.draft_checkpoint))
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


def draft_example_inputs(spec: GraphSpec) -> tuple:
    with _inputs_mode():
        return _draft_example_inputs(spec)


def _draft_example_inputs(spec: GraphSpec) -> tuple:
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
    with _inputs_mode():
        return _example_inputs(spec, caches)


def _example_inputs(spec: GraphSpec, caches: bool) -> tuple:
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
