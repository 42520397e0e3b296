"""The neuron backend's recipe-time rules: what layouts it can build, and the KV pool its kernels can
address (torch-free, so the recipe validator reaches them through the registry's ``layout_rule``,
``kv_rule`` and ``kv_limit`` parts without importing the SDK or torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from neffbuild.runtime.kv.layout import KVLayout

# Physical NeuronCores of the largest instance per target (trn1.32xlarge, trn2.48xlarge): a TP
# group's in-graph collectives stay inside one instance, so tp x lnc must fit in it.
NEURON_CORES_PER_INSTANCE = {"trn1": 32, "trn2": 128}
# The kernels' block-KV DMA addresses one buffer's K or V half with 32-bit offsets (NCC_IBTN127): each
# half (runtime/kv/layout.py ``half_bytes``: num_blocks x kv_heads x block_size x head_dim x itemsize)
# must span fewer bytes than this. That is why every KV buffer is its own base-0 allocation.
OFFSET_SPAN = 1 << 32


def neuron_instance_limit(err, tp: int, compiler: dict, lnc: int) -> None:
    """A TP group must fit the NeuronCores of one instance."""
    cores = NEURON_CORES_PER_INSTANCE.get(compiler.get("target"))
    if cores and tp * lnc > cores:
        err("parallel.tp", tp, f"tp x neuron_config.lnc ({tp * lnc}) must fit the {cores} NeuronCores of one "
                               f"{compiler.get('target')} instance (the neuron backend cannot build a TP group across "
                               "instances)")


def kv_offset_limit(layout: KVLayout) -> int:
    """The largest num_blocks whose every K/V half (target buffers and the draft's) spans fewer than 2^32 bytes."""
    widest = max(layout.block_len, layout.draft_block_len)
    return (OFFSET_SPAN - 1) // widest


def kv_offsets_32bit(err, layout: KVLayout) -> None:
    """Kernels that address block-KV with uint32 offsets (neuron: NCC_IBTN127) need each buffer half below 2^32."""
    halves = [("target", layout.half_bytes, layout.kv_heads, layout.head_dim)]
    if layout.has_draft:
        halves.append(("draft", layout.draft_half_bytes, layout.draft_kv_heads, layout.draft_head_dim))
    for name, span, heads, head_dim in halves:
        if span >= OFFSET_SPAN:
            err("serving.num_blocks", layout.num_blocks,
                f"one {name} KV buffer half spans {layout.num_blocks} blocks x {heads} KV head(s) per rank x "
                f"{layout.block_size} x head_dim {head_dim} x {layout.itemsize} byte(s) = {span:,} bytes, not below "
                f"2^32 ({OFFSET_SPAN:,}): the neuron backend's kernels address KV with 32-bit offsets; at most "
                f"{kv_offset_limit(layout)} blocks fit" + ("" if layout.fp8 else " (fp8_packed_kv quarters the span)"))
            return
