"""Target -> (module, example inputs): the graph each grid cell compiles.

Weights in the traced module are uninitialised placeholders of the right shapes and
dtypes: artifacts carry no weights (they are bound at load), so values never matter here
and a worker never reads the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from neffbuild.errors import BuildFailed
from neffbuild.models.gpt_oss.config import GptOssConfig
from neffbuild.models.gpt_oss.decode import GptOssDecode, default_aux_layers
from neffbuild.models.gpt_oss.weights import stacked_shapes
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

    @property
    def config(self) -> GptOssConfig:
        return GptOssConfig.from_hf_dict(self.hf_config)

    def kv_layout(self) -> KVLayout:
        return _kv_layout(self.config, self.num_blocks, self.block_size, self.fp8_packed_kv)


def spec_for(recipe, target) -> GraphSpec:
    return GraphSpec(recipe.model.arch, recipe.model.hf_config, target.family, target.batch, target.ctx,
                     target.query_len, recipe.block_size, recipe.num_blocks, recipe.num_swa, recipe.fp8_packed_kv)


def kv_layout_for(recipe) -> KVLayout:
    return _kv_layout(recipe.model.config, recipe.num_blocks, recipe.block_size, recipe.fp8_packed_kv)


def _kv_layout(cfg: GptOssConfig, num_blocks: int, block_size: int, fp8_packed_kv: bool) -> KVLayout:
    # The recipe's one FP8 switch turns on both the FP8 dtype and the packed K layout.
    return KVLayout(cfg.num_kv_buffers, num_blocks, cfg.num_key_value_heads, block_size, cfg.head_dim,
                    fp8=fp8_packed_kv, packed_k=fp8_packed_kv)


def example_inputs(spec: GraphSpec, *, caches: bool = True) -> tuple:
    """Zeroed inputs of the target's shapes (pad write slots); ``caches=False`` leaves the KV caches out."""
    B, q = spec.batch, spec.query_len
    layout = spec.kv_layout()
    long = dict(dtype=torch.long)
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
    )


INPUT_NAMES = ("input_ids", "positions", "block_table", "block_table_swa", "swa_kv_pos_offset", "slot_mapping",
               "slot_mapping_swa", "kv_caches")


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
    cfg = spec.config
    if weights is None:
        weights = {n: torch.empty(shape, dtype=torch.float32) for n, shape in stacked_shapes(cfg).items()}
    aux = default_aux_layers(cfg.num_hidden_layers) if spec.family in ("target_spec", "target_nospec") else None
    module = GptOssDecode(cfg, weights, packed_k=spec.fp8_packed_kv, aux_layers=aux).eval()
    return module, example_inputs(spec)
