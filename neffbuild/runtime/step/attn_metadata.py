"""Per-step graph inputs from the engine's block tables: trims, offsets, slots, padding.

Full-attention layers read a head-trimmed table (columns ``[0, ctx/block_size)``; positions
stay absolute). Sliding-window layers read a tail-trimmed table of ``num_swa`` columns
starting at ``start = max(0, ctx_len // bs - num_swa + 1)`` (ctx_len = the last position
written this step), with ``swa_kv_pos_offset = start * bs``. Padding rows (batch bucket
above the live requests) read the null block and write nothing (slot -1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from neffbuild.runtime.kv.cache import NULL_BLOCK, graph_view

PAD_SLOT = -1


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [B, q]
    positions: torch.Tensor  # [B, q]
    block_table: torch.Tensor  # [B, ctx/bs]
    block_table_swa: torch.Tensor  # [B, num_swa]
    swa_kv_pos_offset: torch.Tensor  # [B]
    slot_mapping: torch.Tensor  # [B*q]
    slot_mapping_swa: torch.Tensor  # [B*q]

    def as_args(self, kv_caches) -> tuple:
        """Positional graph arguments; FP8 caches travel as their uint8 bytes (see kv_cache.graph_view)."""
        return (self.input_ids, self.positions, self.block_table, self.block_table_swa, self.swa_kv_pos_offset,
                self.slot_mapping, self.slot_mapping_swa, tuple(graph_view(c) for c in kv_caches))


def head_trim(table: torch.Tensor, ctx: int, block_size: int) -> torch.Tensor:
    """Columns [0, ctx/bs) as a fresh contiguous tensor (index_select, never a view)."""
    return table.index_select(1, torch.arange(-(-ctx // block_size)))


def tail_trim(table: torch.Tensor, ctx_len: torch.Tensor, block_size: int, num_swa: int):
    """Last num_swa blocks up to ctx_len's block: (trimmed [R, num_swa], offsets [R])."""
    width = table.shape[1]
    if num_swa >= width:
        return table.clone(), torch.zeros(table.shape[0], dtype=torch.long)
    start = (ctx_len // block_size - num_swa + 1).clamp(min=0)
    cols = (start[:, None] + torch.arange(num_swa)).clamp(max=width - 1)
    return torch.gather(table, 1, cols), start * block_size


def widen(table: torch.Tensor, width: int) -> torch.Tensor:
    """Pad an engine table with null-block columns up to ``width`` (engines may pass rows only as
    wide as their requests; the graph reads ``ctx / block_size`` columns)."""
    short = width - table.shape[1]
    return torch.cat([table, table.new_full((table.shape[0], short), NULL_BLOCK)], 1) if short > 0 else table


def build(
    tokens: torch.Tensor,  # [R, q] tokens to run this step
    num_computed: torch.Tensor,  # [R] tokens already in the cache per request
    full_table: torch.Tensor,  # [R, W] engine block table, full-attention group (any W; widened to ctx/bs)
    swa_table: torch.Tensor,  # [R, W'] engine block table, sliding-window group
    *,
    batch: int,
    ctx: int,
    block_size: int,
    num_swa: int,
    lengths: torch.Tensor | None = None,  # [R] live tokens per row (None: all q); the rest are padding
) -> StepInputs:
    """Inputs for one step at batch bucket ``batch`` and context bucket ``ctx``. A row's positions past its
    ``lengths`` entry (a row with fewer drafts than the step's query) write nothing: slot -1, as padding rows."""
    R, q = tokens.shape
    pad = batch - R
    width = -(-ctx // block_size)
    full_table, swa_table = widen(full_table.long(), width), widen(swa_table.long(), max(width, num_swa))
    positions = num_computed[:, None] + torch.arange(q)  # [R, q]
    blk_idx, offs = positions // block_size, positions % block_size
    slots = torch.gather(full_table, 1, blk_idx) * block_size + offs
    slots_swa = torch.gather(swa_table, 1, blk_idx) * block_size + offs
    if lengths is not None:
        dead = torch.arange(q) >= lengths[:, None]  # [R, q] padded positions
        slots, slots_swa = slots.masked_fill(dead, PAD_SLOT), slots_swa.masked_fill(dead, PAD_SLOT)
    trimmed_swa, offset = tail_trim(swa_table, positions[:, -1], block_size, max(num_swa, 1))

    def padded(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.cat([t, torch.full((pad, *t.shape[1:]), value, dtype=t.dtype)]) if pad else t

    return StepInputs(
        input_ids=padded(tokens.long(), 0),
        positions=padded(positions, 0),
        block_table=padded(head_trim(full_table, ctx, block_size), NULL_BLOCK),
        block_table_swa=padded(trimmed_swa, NULL_BLOCK),
        swa_kv_pos_offset=padded(offset, 0),
        slot_mapping=padded(slots, PAD_SLOT).reshape(-1),
        slot_mapping_swa=padded(slots_swa, PAD_SLOT).reshape(-1),
    )
