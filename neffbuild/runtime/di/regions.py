"""KV region geometry for disaggregated inference: registered regions, the head mapping, pull descriptors.

Pure arithmetic over addresses (no NIXL, no sockets). Each side of a transfer registers one K
and one V region per distinct KV buffer, in layer order (the caller hands one buffer per
layer, from the architecture's ``kv_buffer_of_layer``; a buffer already seen adds nothing).
A buffer is ``[2, num_blocks, heads, block_size, head_dim]``, so within a block the heads are
outermost: the bytes of heads ``[a, a + n)`` of block ``b`` of region ``r`` are one run,
``base_r + b * block_len + a * head_len`` for ``n * head_len`` bytes, with
``head_len = block_size * head_dim * itemsize``. A packed-FP8 K block
(``[heads, block_size // 2, head_dim, 2]``) keeps that order, so the same runs hold.

A rank holds a contiguous range of the model's KV heads (its TP slice; replicated heads when
tp exceeds the KV heads). ``head_segments`` says which remote rank supplies each local head
run: a decode TP larger than prefill's reads a slice of each remote block, a smaller one
gathers several remote blocks into each local block. ``pull_descriptors`` turns one
segment and a request's block pairs into descriptor lists, merging consecutive blocks into
one descriptor when whole blocks move.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from neffbuild.errors import KVLayoutMismatch, KVTransferError

Desc = tuple[int, int, int]  # (address, length, device id)


@dataclass(frozen=True)
class KVRegions:
    """One side's registered regions and the geometry that places a head of a block in them."""

    bases: tuple[int, ...]
    num_blocks: int
    num_layers: int
    first_head: int  # the first of this rank's KV heads, in the model's numbering
    num_heads: int  # heads held here (per block)
    total_heads: int  # the model's KV heads
    block_size: int
    head_dim: int
    itemsize: int
    dtype: str
    packed_fp8: bool = False
    device_id: int = 0
    mem_type: str = "DRAM"
    draft: bool = False  # the EAGLE3 draft's KV buffer is registered too (``regions_for``'s ``draft_kv``)

    @property
    def heads(self) -> range:
        return range(self.first_head, self.first_head + self.num_heads)

    @property
    def head_len(self) -> int:
        return self.block_size * self.head_dim * self.itemsize

    @property
    def block_len(self) -> int:
        return self.num_heads * self.head_len

    @property
    def region_len(self) -> int:
        return self.block_len * self.num_blocks

    def addr(self, region: int, block: int, head: int = 0) -> int:
        """Address of local head offset ``head`` of ``block`` in ``region``."""
        return self.bases[region] + block * self.block_len + head * self.head_len

    def to_json(self) -> dict:
        return {"bases": list(self.bases), "num_blocks": self.num_blocks, "num_layers": self.num_layers,
                "first_head": self.first_head, "num_heads": self.num_heads, "total_heads": self.total_heads,
                "block_size": self.block_size, "head_dim": self.head_dim, "itemsize": self.itemsize,
                "dtype": self.dtype, "packed_fp8": self.packed_fp8, "mem_type": self.mem_type, "draft": self.draft}

    @classmethod
    def from_json(cls, d: dict) -> KVRegions:
        ints = ("num_blocks", "num_layers", "first_head", "num_heads", "total_heads", "block_size", "head_dim",
                "itemsize")
        return cls(tuple(int(b) for b in d["bases"]), *(int(d[k]) for k in ints), str(d["dtype"]),
                   bool(d["packed_fp8"]), 0, str(d.get("mem_type", "DRAM")), bool(d.get("draft", False)))

    def describe(self) -> str:
        h = self.heads
        return (f"{self.num_layers} layers on {len(self.bases)} regions, KV heads {h.start}..{h.stop - 1} of "
                f"{self.total_heads}, block_size {self.block_size}, head_dim {self.head_dim}, {self.dtype}"
                f"{', packed FP8 K' if self.packed_fp8 else ''}{', EAGLE3 draft KV' if self.draft else ''}")

    def mismatch(self, other: KVRegions, here: str, there: str) -> str | None:
        """What must match for any head mapping (not the head split, not the pool size), or None."""
        fields = [("layers", self.num_layers, other.num_layers), ("regions", len(self.bases), len(other.bases)),
                  ("block_size", self.block_size, other.block_size), ("head_dim", self.head_dim, other.head_dim),
                  ("dtype", self.dtype, other.dtype), ("packed_fp8", self.packed_fp8, other.packed_fp8),
                  ("total KV heads", self.total_heads, other.total_heads), ("EAGLE3 draft KV", self.draft, other.draft)]
        bad = [f"{name} {a} on {here} vs {b} on {there}" for name, a, b in fields if a != b]
        if not bad:
            return None
        return (f"KV layouts cannot map: {'; '.join(bad)} ({here}: {self.describe()}; {there}: {other.describe()}). "
                "Both sides must serve the same model with the same bundle's kv_layout.")


def register_regions(layer_buffers: Sequence[torch.Tensor], *, packed_fp8: bool = False,
                     heads: range | None = None, total_heads: int | None = None) -> KVRegions:
    """Regions over one KV buffer per layer (``[2, num_blocks, heads, block_size, head_dim]``).

    ``heads``: the model KV heads this rank holds (default: all of the buffer's, from 0);
    ``total_heads``: the model's KV heads (default: the buffer's).
    """
    if not layer_buffers:
        raise KVTransferError("register_regions: no KV buffers to register")
    bases: list[int] = []
    geometry = None
    for i, buf in enumerate(layer_buffers):
        if buf.dim() != 5 or buf.shape[0] != 2 or not buf.is_contiguous():
            raise KVTransferError(f"KV buffer of layer {i}: expected a contiguous [2, num_blocks, kv_heads, "
                                  f"block_size, head_dim] tensor, got shape {tuple(buf.shape)}")
        here = (tuple(buf.shape), buf.dtype, buf.get_device())
        if geometry is not None and here != geometry:
            raise KVTransferError(f"KV buffer of layer {i}: shape {tuple(buf.shape)} {buf.dtype} differs from "
                                  "layer 0's; every buffer must share one layout")
        geometry = here
        if buf[0].data_ptr() not in bases:
            bases += [buf[0].data_ptr(), buf[1].data_ptr()]
    (_, nb, h, bs, d), dtype, dev = geometry
    heads = heads if heads is not None else range(h)
    if len(heads) != h:
        raise KVTransferError(f"register_regions: heads {heads.start}..{heads.stop - 1} ({len(heads)}) but the "
                              f"buffers hold {h} heads per block")
    itemsize = layer_buffers[0].element_size()
    return KVRegions(tuple(bases), nb, len(layer_buffers), heads.start, h, total_heads or h, bs, d, itemsize,
                     str(dtype).removeprefix("torch."), packed_fp8, max(dev, 0), "DRAM" if dev < 0 else "VRAM")


def regions_for(facts, kv_buffers: Sequence[torch.Tensor], *, heads: range | None = None,
                draft_kv: torch.Tensor | None = None) -> KVRegions:
    """A bundle's KV buffers as transfer regions, for any engine's transfer (neffbuild's prefill worker and
    decode ranks, a vLLM connector): one K and one V region per buffer in layer order (``facts.layer_buffers``),
    packed FP8 as the bundle says, this rank's KV heads (``facts.kv_heads``; ``heads`` for a rank that re-split
    the model for a TP degree of its own, as a DI prefill rank does). ``facts``: the bundle's ``BundleFacts``.

    ``draft_kv``: the EAGLE3 draft's KV buffer, when the engine moves the draft's prompt KV too (the vLLM
    plugin: vLLM's prefill instance runs the drafter over the prompt). It must be laid out as the target's
    buffers (the draft is sharded like the target: same KV heads per rank, head_dim, block size, dtype), so the
    same head mapping and descriptors move it; one K and one V region more unless it shares a target buffer's
    storage (vLLM's hybrid KV manager may give it one: de-duplicated by base like any buffer)."""
    per_layer = [kv_buffers[b] for b in facts.layer_buffers]
    if draft_kv is not None:
        ours, target = (tuple(draft_kv.shape), draft_kv.dtype), (tuple(per_layer[0].shape), per_layer[0].dtype)
        if ours != target:
            raise KVLayoutMismatch(f"the EAGLE3 draft's KV buffer is {ours[0]} {ours[1]}, the target's {target[0]} "
                                   f"{target[1]}: the draft's KV cannot move in the target's regions (a draft "
                                   "with the target's KV heads, head_dim and KV dtype can)")
    regions = register_regions([*per_layer, *([draft_kv] if draft_kv is not None else [])],
                               packed_fp8=facts.fp8_packed_kv, heads=heads if heads is not None else facts.kv_heads,
                               total_heads=facts.config.num_key_value_heads)
    return replace(regions, num_layers=len(per_layer), draft=draft_kv is not None)


@dataclass(frozen=True)
class HeadSegment:
    """Local heads ``[local_first, local_first + count)`` come from remote ``rank``'s ``[remote_first, ...)``
    (offsets within each side's own heads)."""

    rank: int
    remote_first: int
    local_first: int
    count: int


def head_segments(local: range, remotes: Sequence[range], here: str = "decode", there: str = "prefill"
                  ) -> list[HeadSegment]:
    """Which remote rank supplies each run of ``local`` heads (the first rank that holds a head supplies it).

    A head no remote rank holds is a ``KVLayoutMismatch`` naming both sides.
    """
    segs: list[HeadSegment] = []
    for i, head in enumerate(local):
        rank = next((r for r, held in enumerate(remotes) if head in held), None)
        if rank is None:
            held = ", ".join(f"rank {r}: {h.start}..{h.stop - 1}" for r, h in enumerate(remotes)) or "none"
            raise KVLayoutMismatch(f"{here} holds KV heads {local.start}..{local.stop - 1} but no {there} rank holds "
                                   f"head {head} ({there} heads: {held})")
        off = head - remotes[rank].start
        last = segs[-1] if segs else None
        if last and last.rank == rank and last.local_first + last.count == i and last.remote_first + last.count == off:
            segs[-1] = HeadSegment(rank, last.remote_first, last.local_first, last.count + 1)
        else:
            segs.append(HeadSegment(rank, off, i, 1))
    return segs


def pull_descriptors(local: KVRegions, remote: KVRegions, seg: HeadSegment, local_blocks: Sequence[int],
                     remote_blocks: Sequence[int]) -> tuple[list[Desc], list[Desc]]:
    """(local, remote) descriptor lists moving ``seg``'s heads of every block pair, in every region.

    When the segment is every head on both sides, consecutive block pairs merge into one descriptor.
    """
    whole = seg.count == local.num_heads == remote.num_heads
    runs: list[tuple[int, int, int]] = []  # (local block, remote block, blocks)
    for lb, rb in zip(local_blocks, remote_blocks, strict=True):
        if whole and runs and runs[-1][0] + runs[-1][2] == lb and runs[-1][1] + runs[-1][2] == rb:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((lb, rb, 1))
    n = seg.count * local.head_len
    ldescs, rdescs = [], []
    for r in range(len(local.bases)):
        for lb, rb, k in runs:
            ldescs.append((local.addr(r, lb, seg.local_first), n * k, local.device_id))
            rdescs.append((remote.addr(r, rb, seg.remote_first), n * k, remote.device_id))
    return ldescs, rdescs


def last_blocks(remote: Sequence[int], local: Sequence[int]) -> list[int]:
    """The remote blocks that land on ``local``: the last len(local) ones (a partial prefix pull)."""
    if len(local) > len(remote):
        raise KVTransferError(f"pull: {len(local)} local blocks but the prefill worker has only {len(remote)}")
    return list(remote[len(remote) - len(local):])


def block_pairs(request: str, remote_block_ids, local_block_ids, local_pool: int, remote_pool: int
                ) -> tuple[list[int], list[int]]:
    """Flat (remote, local) block lists of a pull: per KV group a list (or one flat list); where a group has
    fewer local than remote blocks (a prefix cached here) the LAST remote ones are read."""
    remote_groups, local_groups = _groups(remote_block_ids), _groups(local_block_ids)
    if len(remote_groups) != len(local_groups):
        raise KVTransferError(f"pull of request {request!r}: {len(remote_groups)} remote groups but "
                              f"{len(local_groups)} local groups")
    remote, local = [], []
    for rg, lg in zip(remote_groups, local_groups, strict=True):
        remote += last_blocks(rg, lg)
        local += list(lg)
    for ids, pool, side in ((local, local_pool, "local"), (remote, remote_pool, "remote")):
        bad = [b for b in ids if not 0 <= b < pool]
        if bad:
            raise KVTransferError(f"pull of request {request!r}: {side} block ids {bad[:5]} outside [0, {pool})")
    return remote, local


def _groups(ids) -> list[list[int]]:
    ids = list(ids)
    if ids and isinstance(ids[0], (list, tuple)):
        return [list(map(int, g)) for g in ids]
    return [list(map(int, ids))]
