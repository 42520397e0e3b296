"""``BundleFacts``: what a host engine needs to know of a bundle, typed, read once from a judged manifest.

Engines (neffbuild's own ``serve/``, the vLLM plugin) read these and never the manifest's dicts: the model
and draft configs (dataclasses, built through the registry), the weights' stored form (float dtype, dense or
MXFP4 experts), the KV buffers' dtype and packing, this rank's KV heads (the target's and the draft's), which
KV buffer each layer writes, the EAGLE3 aux layers and the parallel layout. Built only from a manifest
``reader.check`` passed (``graph_inputs.model_config`` under the recipe's rules, the weights' shapes against it),
so nothing here re-validates; a second engine that needs a fact adds it here, once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from neffbuild import registry
from neffbuild.runtime.bundle.graph_inputs import GraphInputs
from neffbuild.runtime.parallel import ParallelLayout, ParallelSection


@dataclass(frozen=True)
class BundleFacts:
    arch: str  # the registry's architecture name
    config: object  # the architecture's config dataclass (the target's)
    draft_config: object | None  # the speculative method's config over the target's, or None without drafts
    weights_dtype: str  # the stored float weights' dtype, which the artifacts compute in: float32 | bfloat16
    experts: str  # dense | mxfp4
    kv_dtype: str  # the KV buffers' element type: float32 | bfloat16 | float8_e4m3fn
    fp8_packed_kv: bool  # K packed two tokens a row (runtime/kv/cache.py)
    parallel: ParallelLayout  # the layout the artifacts were compiled for
    rank: int  # this rank in ``parallel``'s world (0 unsharded)
    kv_heads: range  # the model KV heads this rank's buffers hold
    draft_kv_heads: range  # EAGLE3: the draft KV heads its draft buffer holds (its TP slice); empty without
    layer_buffers: tuple[int, ...]  # layer i writes KV buffer layer_buffers[i]
    aux_layers: tuple[int, ...]  # EAGLE3: the target states the draft reads (id i: entering layer i); () without
    num_speculative_tokens: int
    speculative_method: str | None
    graph_inputs: GraphInputs  # the grid, the KV layout and num_swa every step is planned from
    backend: str = ""  # the compiler backend the artifacts come from (the registry's name: the manifest's toolchain)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def sharded(self) -> bool:
        return self.parallel.sharded

    def engine_dtypes(self) -> tuple[str, str]:
        """(model dtype, KV cache dtype) in the spelling of a host engine's flags (vLLM's ``--dtype`` and
        ``--kv-cache-dtype``): the weights' dtype, and ``fp8`` for packed-FP8 KV, ``auto`` when the KV buffers
        hold the model dtype, else the KV dtype itself. The hand-off prints it, the plugin's check compares it."""
        kv = "fp8" if self.fp8_packed_kv else ("auto" if self.kv_dtype == self.weights_dtype else self.kv_dtype)
        return self.weights_dtype, kv



def facts_of(manifest: dict, rank: int = 0) -> BundleFacts:
    """The facts of a manifest ``reader.check`` passed, for world rank ``rank``."""
    gi = GraphInputs.of_manifest(manifest)
    arch = registry.arch(gi.arch)
    cfg = gi.config()
    section = ParallelSection.of_manifest(manifest)
    par = section.parallel if section is not None else gi.parallel
    table = weight_table(manifest, rank)
    heads = range(cfg.num_key_value_heads) if par.tp == 1 else arch.get("kv_heads_of")(cfg, par, par.tp_rank(rank))
    draft = gi.draft(cfg)
    draft_heads = range(0)
    if draft is not None:
        draft_heads = range(draft.num_key_value_heads) if par.tp == 1 else \
            registry.speculative(gi.speculative_method).get("kv_heads_of")(draft, par, par.tp_rank(rank))
    of_layer = arch.get("kv_buffer_of_layer")
    return BundleFacts(
        arch=gi.arch, config=cfg, draft_config=draft, weights_dtype=_float_dtype(table),
        experts=arch.get("experts_of")(table), kv_dtype=gi.kv_layout.dtype_name, fp8_packed_kv=gi.fp8_packed_kv,
        parallel=par, rank=rank, kv_heads=heads, draft_kv_heads=draft_heads,
        layer_buffers=tuple(of_layer(i) for i in range(cfg.num_hidden_layers)),
        aux_layers=tuple(draft.aux_layers) if draft is not None else (),
        num_speculative_tokens=gi.grid.num_speculative_tokens, speculative_method=gi.speculative_method,
        graph_inputs=gi, backend=manifest["toolchain"]["backend"])


def weight_table(manifest: dict, rank: int = 0) -> dict:
    """The tensors (name -> {dtype, shape}) one rank's artifacts bind: ``weights.tensors`` plus its pieces'."""
    table = dict(manifest["weights"]["tensors"])
    section = ParallelSection.of_manifest(manifest)
    if section is not None:
        for name in section.pieces_of(rank):
            table.update(section.pieces[name]["tensors"])
    return table


def _float_dtype(table: dict) -> str:
    """The dtype most of the stored float bytes are in (norms, biases and the router follow the weights'
    dtype in every form neffbuild writes; MXFP4 blocks and scales are uint8 and do not count)."""
    sizes: dict[str, int] = {}
    for entry in table.values():
        dtype = entry["dtype"]
        if dtype in ("float32", "bfloat16", "float16"):
            sizes[dtype] = sizes.get(dtype, 0) + math.prod(entry["shape"])
    return max(sizes, key=sizes.get) if sizes else "float32"
