"""Inputs of one EAGLE3 draft call (the ``draft_b{B}_ctx{S}`` artifacts). Thin: torch only.

Per request the engine hands over the rows the target just verified: the token at each
position + 1 (accepted drafts, then the bonus token), the target's auxiliary hidden
states at each position, and the position of the first row. Rows beyond ``num_valid``
and padding requests write nothing (slot -1) and read the null block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from neffbuild.runtime.kv.cache import NULL_BLOCK, graph_view
from neffbuild.runtime.step.attn_metadata import PAD_SLOT, head_trim, widen


@dataclass
class DraftInputs:
    input_ids: torch.Tensor  # [B, 1+k]
    positions: torch.Tensor  # [B, 1+k]
    hidden: torch.Tensor  # [B, 1+k, 3H]
    num_valid: torch.Tensor  # [B]
    block_table: torch.Tensor  # [B, ctx/bs] head-trimmed full-attention table
    slot_mapping: torch.Tensor  # [B*(1+k)]

    def as_args(self, draft_cache: torch.Tensor) -> tuple:
        return (self.input_ids, self.positions, self.hidden, self.num_valid, self.block_table, self.slot_mapping,
                graph_view(draft_cache))


def build_draft(
    rows: list[tuple[list[int], torch.Tensor, int]],  # per request: (tokens [n], aux [n, 3H], first position)
    full_table: torch.Tensor,  # [R, max_blocks] engine block table, full-attention group
    *,
    batch: int,
    ctx: int,
    query_len: int,
    block_size: int,
    hidden_size: int,
) -> DraftInputs:
    """Inputs for one draft call at batch bucket ``batch`` and context bucket ``ctx``."""
    B, q = batch, query_len
    ids = torch.zeros(B, q, dtype=torch.long)
    hidden = torch.zeros(B, q, hidden_size)
    start = torch.zeros(B, dtype=torch.long)
    num_valid = torch.zeros(B, dtype=torch.long)
    for r, (tokens, aux, first) in enumerate(rows):
        n = len(tokens)
        if not 1 <= n <= q:
            raise ValueError(f"draft request {r}: {n} verified rows, the draft graph takes 1..{q}")
        ids[r, :n] = torch.as_tensor(tokens, dtype=torch.long)
        hidden[r, :n] = aux
        start[r], num_valid[r] = first, n
    positions = start[:, None] + torch.arange(q)  # [B, q]
    full_table = widen(full_table, -(-ctx // block_size))
    table = torch.full((B, full_table.shape[1]), NULL_BLOCK, dtype=torch.long)
    table[: len(rows)] = full_table
    blk = (positions // block_size).clamp(max=table.shape[1] - 1)
    slots = torch.gather(table, 1, blk) * block_size + positions % block_size
    slots = torch.where(torch.arange(q) < num_valid[:, None], slots, PAD_SLOT)
    return DraftInputs(ids, positions, hidden, num_valid, head_trim(table, ctx, block_size), slots.reshape(-1))
