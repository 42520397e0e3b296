"""Per-buffer paged KV cache: allocation and views. Thin: no model import.

G = num_layers / 2 buffers, each ``[2, num_blocks, kv_heads, block_size, head_dim]`` (K half
then V half). Layer pair (2j, 2j+1) shares buffer j through two block tables. With packed
FP8 K the K half is also viewed as ``[num_blocks, kv_heads, block_size // 2, head_dim, 2]``
(logical token t of a block at ``[t // 2, :, t % 2]``); V is never packed.
Block 0 is the null block: never handed to a request, it absorbs padding rows' reads
(block allocation: runtime/blocks.py).
FP8 buffers are passed to compiled graphs as their uint8 bytes (``graph_view``).
With EAGLE3 the draft has a KV group of its own: one more buffer of the same kind
(``draft_buffer_shape``, its own heads), addressed through the full-attention group's
block table, so it needs no block accounting of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from neffbuild.runtime.blocks import NULL_BLOCK  # noqa: F401  (re-exported: block 0 is the null block)


@dataclass(frozen=True)
class KVLayout:
    num_buffers: int
    num_blocks: int
    kv_heads: int
    block_size: int
    head_dim: int
    fp8: bool = False
    packed_k: bool = False
    draft_kv_heads: int = 0  # EAGLE3: the draft's own KV group (one buffer); 0 = none
    draft_head_dim: int = 0

    @property
    def has_draft(self) -> bool:
        return self.draft_kv_heads > 0

    @property
    def draft_buffer_shape(self) -> tuple[int, ...]:
        """The draft's buffer: same blocks (ids from the full-attention group's table), its own heads."""
        return (2, self.num_blocks, self.draft_kv_heads, self.block_size, self.draft_head_dim)

    @property
    def dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self.fp8 else torch.float32

    @property
    def graph_dtype(self) -> torch.dtype:
        """What compiled graphs take: FP8 buffers as uint8 bytes (same storage, a free view)."""
        return torch.uint8 if self.fp8 else torch.float32

    @property
    def buffer_shape(self) -> tuple[int, ...]:
        return (2, self.num_blocks, self.kv_heads, self.block_size, self.head_dim)

    def to_json(self) -> dict:
        out = {"num_buffers": self.num_buffers, "buffer_shape": list(self.buffer_shape),
               "dtype": str(self.dtype).removeprefix("torch."), "packed_k": self.packed_k}
        if self.has_draft:
            out["draft"] = {"num_buffers": 1, "buffer_shape": list(self.draft_buffer_shape), "block_table": "full"}
        return out

    @classmethod
    def from_json(cls, kv: dict) -> KVLayout:
        """The inverse of ``to_json`` (the manifest's ``graph_inputs.kv_layout``, schema-checked)."""
        _, nb, h, bs, d = kv["buffer_shape"]
        draft = kv.get("draft", {}).get("buffer_shape", (0, 0, 0, 0, 0))
        return cls(kv["num_buffers"], nb, h, bs, d, fp8=kv["dtype"].startswith("float8"), packed_k=kv["packed_k"],
                   draft_kv_heads=draft[2], draft_head_dim=draft[4])


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
