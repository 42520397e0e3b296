"""One rank's KV layout and what it costs in bytes: the project's one KV-bytes formula.

Pure Python (torch only lazily, for the ``dtype`` properties), so ``plan`` and the recipe
validator size a pool by the same arithmetic the runtime allocates by (runtime/kv/cache.py).

G = ``num_buffers`` target buffers (layer pairs share one), each
``[2, num_blocks, kv_heads, block_size, head_dim]`` (K half then V half); with EAGLE3 one
more buffer for the draft, ``[2, num_blocks, draft_kv_heads, block_size, draft_head_dim]``
(the draft is split over TP like the target: a rank holds its share of the draft's KV heads). Per rank:

    block_len     = kv_heads x block_size x head_dim x itemsize    (one block of one half)
    half_bytes    = num_blocks x block_len        (the offset span of one K or V half)
    target_bytes  = num_buffers x 2 x half_bytes
    draft_bytes   = 2 x num_blocks x draft_kv_heads x block_size x draft_head_dim x itemsize
    kv_bytes      = target_bytes + draft_bytes = num_blocks x bytes_per_block

itemsize is 1 for FP8 (``fp8_packed_kv``), else that of ``kv_dtype`` (float32: 4, bfloat16: 2).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


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
    kv_dtype: str = "float32"  # the buffers' dtype when not FP8 (float32 | bfloat16)

    @property
    def has_draft(self) -> bool:
        return self.draft_kv_heads > 0

    @property
    def draft_buffer_shape(self) -> tuple[int, ...]:
        """The draft's buffer: same blocks (ids from the full-attention group's table), its own heads."""
        return (2, self.num_blocks, self.draft_kv_heads, self.block_size, self.draft_head_dim)

    @property
    def buffer_shape(self) -> tuple[int, ...]:
        return (2, self.num_blocks, self.kv_heads, self.block_size, self.head_dim)

    @property
    def dtype(self):
        import torch

        return torch.float8_e4m3fn if self.fp8 else getattr(torch, self.kv_dtype)

    @property
    def graph_dtype(self):
        """What compiled graphs take: FP8 buffers as uint8 bytes (same storage, a free view)."""
        import torch

        return torch.uint8 if self.fp8 else getattr(torch, self.kv_dtype)

    @property
    def dtype_name(self) -> str:
        return "float8_e4m3fn" if self.fp8 else self.kv_dtype

    # -- bytes (the formula in the module docstring)
    @property
    def itemsize(self) -> int:
        return 1 if self.fp8 else {"bfloat16": 2}.get(self.kv_dtype, 4)

    @property
    def block_len(self) -> int:
        """Bytes of one block of one half (K or V) of one target buffer."""
        return self.kv_heads * self.block_size * self.head_dim * self.itemsize

    @property
    def draft_block_len(self) -> int:
        return self.draft_kv_heads * self.block_size * self.draft_head_dim * self.itemsize

    @property
    def half_bytes(self) -> int:
        """One target buffer's K (or V) half: the span a kernel's block offsets address."""
        return self.num_blocks * self.block_len

    @property
    def draft_half_bytes(self) -> int:
        return self.num_blocks * self.draft_block_len

    @property
    def target_bytes(self) -> int:
        return self.num_buffers * 2 * self.half_bytes

    @property
    def draft_bytes(self) -> int:
        return 2 * self.draft_half_bytes

    @property
    def total_bytes(self) -> int:
        return self.target_bytes + self.draft_bytes

    @property
    def bytes_per_block(self) -> int:
        """What one more block id costs over every buffer (kv_bytes is linear in num_blocks)."""
        return 2 * (self.num_buffers * self.block_len + self.draft_block_len)

    def with_blocks(self, num_blocks: int) -> KVLayout:
        return dataclasses.replace(self, num_blocks=num_blocks)

    def to_json(self) -> dict:
        out = {"num_buffers": self.num_buffers, "buffer_shape": list(self.buffer_shape),
               "dtype": self.dtype_name, "packed_k": self.packed_k}
        if self.has_draft:
            out["draft"] = {"num_buffers": 1, "buffer_shape": list(self.draft_buffer_shape), "block_table": "full"}
        return out

    @classmethod
    def from_json(cls, kv: dict) -> KVLayout:
        """The inverse of ``to_json`` (the manifest's ``graph_inputs.kv_layout``, schema-checked)."""
        _, nb, h, bs, d = kv["buffer_shape"]
        draft = kv.get("draft", {}).get("buffer_shape", (0, 0, 0, 0, 0))
        fp8 = kv["dtype"].startswith("float8")
        return cls(kv["num_buffers"], nb, h, bs, d, fp8=fp8, packed_k=kv["packed_k"],
                   draft_kv_heads=draft[2], draft_head_dim=draft[4], kv_dtype="float32" if fp8 else kv["dtype"])
