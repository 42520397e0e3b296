"""Paged KV cache reads and writes, including packed FP8 K.

A KV buffer half (K or V) is ``[num_blocks, kv_heads, block_size, head_dim]``. Packed FP8 K
stores logical ``K[b, h, t, d]`` at ``packed[b, h, t // 2, d, t % 2]``: the view
``[num_blocks, kv_heads, block_size // 2, head_dim, 2]`` of the same bytes.
Slot ``s`` means block ``s // block_size``, offset ``s % block_size``; slot ``-1`` is a pad
and its write is skipped (the old value is written back).
"""

import torch


def pack_k_fp8_view(k_half: torch.Tensor) -> torch.Tensor:
    """[nb, h, bs, d] storage -> packed view [nb, h, bs//2, d, 2] of the same bytes."""
    nb, h, bs, d = k_half.shape
    return k_half.view(nb, h, bs // 2, d, 2)


def _logical_from_packed(packed: torch.Tensor) -> torch.Tensor:
    nb, h, half, d, two = packed.shape
    return packed.permute(0, 1, 2, 4, 3).reshape(nb, h, half * two, d)


FP8 = torch.float8_e4m3fn


def _storage_view(half: torch.Tensor) -> torch.Tensor:
    """An FP8 cache as its raw bytes (a uint8 cache already is: it holds float8_e4m3fn bytes).

    Compiled graphs take FP8 caches as uint8: when one graph writes both halves of a
    float8 buffer, inductor's CPU codegen fails ("Promotion for Float8 Types is not
    supported", bool with float8); on bytes the same graph compiles.
    """
    return half.view(torch.uint8) if half.dtype == FP8 else half


def _decode(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (raw.view(FP8) if raw.dtype == torch.uint8 else raw).to(dtype)


def gather_blocks(half: torch.Tensor, table: torch.Tensor, packed: bool, dtype: torch.dtype) -> torch.Tensor:
    """Gather the blocks a table names: [B, W] -> [B, h, W*bs, d] in ``dtype``."""
    half = _storage_view(half)
    if packed:
        blocks = _logical_from_packed(pack_k_fp8_view(half)[table.clamp(min=0)].flatten(0, 1))
        B, W = table.shape
        blocks = blocks.view(B, W, *blocks.shape[1:])
    else:
        blocks = half[table.clamp(min=0)]  # [B, W, h, bs, d]
    B, W, h, bs, d = blocks.shape
    return _decode(blocks.permute(0, 2, 1, 3, 4).reshape(B, h, W * bs, d), dtype)


def write_kv(half: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, packed: bool) -> None:
    """In place: half[slot] = values for every slot >= 0. slots [N]; values [N, h, d]."""
    bs = half.shape[2]
    valid = slots >= 0
    safe = slots.clamp(min=0)
    blk, off = safe // bs, safe % bs
    half = _storage_view(half)
    vals = values.to(FP8).view(torch.uint8) if half.dtype == torch.uint8 else values.to(half.dtype)
    if packed:
        view = pack_k_fp8_view(half)  # [nb, h, bs//2, d, 2]
        # Separated advanced indices put the N axis first: [N, h, d].
        old = view[blk, :, off // 2, :, off % 2]
        view[blk, :, off // 2, :, off % 2] = torch.where(valid[:, None, None], vals, old)
    else:
        old = half[blk, :, off]  # [N, h, d]
        half[blk, :, off] = torch.where(valid[:, None, None], vals, old)
