"""Per-buffer paged KV cache: allocation and views. Thin: no model import.

G = num_layers / 2 buffers, each ``[2, num_blocks, kv_heads, block_size, head_dim]`` (K half
then V half). Layer pair (2j, 2j+1) shares buffer j through two block tables. With packed
FP8 K the K half is also viewed as ``[num_blocks, kv_heads, block_size // 2, head_dim, 2]``
(logical token t of a block at ``[t // 2, :, t % 2]``); V is never packed.
Block 0 is the null block: never handed to a request, it absorbs padding rows' reads
(block allocation: runtime/kv/blocks.py).
FP8 buffers are passed to compiled graphs as their uint8 bytes (``graph_view``).
The layout and its byte counts live in ``runtime/kv/layout.py`` (torch-free, so ``plan`` sizes pools by it).
With EAGLE3 the draft has a KV group of its own: one more buffer of the same kind
(``draft_buffer_shape``, its own heads), addressed through the full-attention group's
block table, so it needs no block accounting of its own.
"""

from __future__ import annotations

import torch

from neffbuild.runtime.kv.blocks import NULL_BLOCK  # noqa: F401  (re-exported: block 0 is the null block)
from neffbuild.runtime.kv.layout import KVLayout  # the layout and its bytes (torch-free)


def allocate(layout: KVLayout, device: str = "cpu") -> list[torch.Tensor]:
    return [torch.zeros(layout.buffer_shape, dtype=layout.dtype, device=device) for _ in range(layout.num_buffers)]


def allocate_draft(layout: KVLayout, device: str = "cpu") -> torch.Tensor | None:
    """The draft's KV buffer (EAGLE3 bundles), or None."""
    return torch.zeros(layout.draft_buffer_shape, dtype=layout.dtype, device=device) if layout.has_draft else None


def graph_view(buffer: torch.Tensor) -> torch.Tensor:
    """The tensor a compiled graph takes for a KV buffer: FP8 as its uint8 bytes, else itself."""
    return buffer.view(torch.uint8) if buffer.dtype == torch.float8_e4m3fn else buffer


def packed_k_view(buffer: torch.Tensor) -> torch.Tensor:
    _, nb, h, bs, d = buffer.shape
    return buffer[0].view(nb, h, bs // 2, d, 2)
