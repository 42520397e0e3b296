"""Paged KV cache reads and writes in the bundle's layout, including packed FP8 K: the one implementation.

The decode graphs (through ``neffbuild.kernels``), the eager prefill and a host engine's own attention (the
vLLM plugin's eager forwards, neffbuild/vllm/attention.py) all read and write KV through these functions, so a
prefill writes exactly the bytes an artifact reads, for every KV dtype. Traceable: plain torch ops only.

A KV buffer is ``[2, num_blocks, kv_heads, block_size, head_dim]``: K half (index 0) then
V half (index 1). Packed FP8 K stores logical ``K[b, h, t, d]`` at
``packed[b, h, t // 2, d, t % 2]``: the view ``[num_blocks, kv_heads, block_size // 2, head_dim, 2]``
of the K half's bytes. Slot ``s`` means block ``s // block_size``, offset ``s % block_size``;
slot ``-1`` is a pad and its write is skipped (the old value is written back).

Why every access indexes the whole buffer with an explicit leading index: a write through a
view of a graph input (``cache[0][...] = ...``, ``cache.view(...)[...] = ...``) is
functionalized into a copy of the whole buffer and a copy back, so a compiled step would
cost the pool, not the rows it writes. Indexing the input itself (``cache[half, blk, :, off]``)
compiles to work proportional to the rows written (tests/test_stepcost.py reads the
generated code). Reads gather only the blocks a table names.
"""

import torch

FP8 = torch.float8_e4m3fn


def pack_k_fp8_view(k_half: torch.Tensor) -> torch.Tensor:
    """[nb, h, bs, d] storage -> packed view [nb, h, bs//2, d, 2] of the same bytes."""
    nb, h, bs, d = k_half.shape
    return k_half.view(nb, h, bs // 2, d, 2)


def _storage_view(cache: torch.Tensor) -> torch.Tensor:
    """An FP8 cache as its raw bytes (a uint8 cache already is: it holds float8_e4m3fn bytes).

    Compiled graphs take FP8 caches as uint8: when one graph writes both halves of a
    float8 buffer, inductor's CPU codegen fails ("Promotion for Float8 Types is not
    supported", bool with float8); on bytes the same graph compiles. Eager callers may
    pass float8 caches: this dtype view then aliases them.
    """
    return cache.view(torch.uint8) if cache.dtype == FP8 else cache


def _decode(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return fp8_bytes_to_float(raw).to(dtype) if raw.dtype == torch.uint8 else raw.to(dtype)


def fp8_bytes_to_float(raw: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn bytes -> float32, bit-exact with ``raw.view(float8_e4m3fn).float()``, in integer ops.

    The 7 magnitude bits shifted into a float32's exponent and mantissa read as 2^(e-127) * 1.m
    (e4m3 subnormals land on float32 subnormals); times 2^120 rebiases the exponent (e4m3's bias
    is 7), exactly. The compiler vectorises these ops, where its float8 conversion is scalar.
    """
    i = raw.to(torch.int32)
    bits = ((i & 0x7F) << 20) | ((i & 0x80) << 24)
    value = bits.view(torch.float32) * 2.0**120
    return torch.where((i & 0x7F) == 0x7F, float("nan"), value)  # e4m3fn has no inf: S.1111.111 is NaN


def block_operand(cache: torch.Tensor, half: int, table: torch.Tensor, packed: bool,
                  dtype: torch.dtype) -> torch.Tensor:
    """The blocks a table names from one half, as an operand: [B, W] -> [B, h, W, bs, d] in ``dtype``.

    Only indexing, permutes and views of the indexed bytes (no reshape that needs a copy), so a
    compiled consumer reads the cache through the table inside its own loop. Packed K bytes are
    ``[.., bs//2, d, 2]``: logical t = 2 * (t // 2) + t % 2, i.e. the view ``[bs//2, 2]`` of t.
    """
    cache = _storage_view(cache)
    table = table.clamp(min=0)
    blocks = cache[torch.full_like(table, half), table]  # [B, W, h, bs, d]: only the named blocks
    B, W, h, bs, d = blocks.shape
    if packed:
        blocks = blocks.view(B, W, h, bs // 2, d, 2).transpose(-1, -2).flatten(3, 4)
    return _decode(blocks.permute(0, 2, 1, 3, 4), dtype)


def gather_blocks(cache: torch.Tensor, half: int, table: torch.Tensor, packed: bool,
                  dtype: torch.dtype) -> torch.Tensor:
    """Gather the blocks a table names from one half into a copy: [B, W] -> [B, h, W*bs, d] in ``dtype``.

    For tests and tools that want the logical KV; the decode graph reads through ``block_operand``.
    """
    blocks = block_operand(cache, half, table, packed, dtype)
    B, h, W, bs, d = blocks.shape
    return blocks.reshape(B, h, W * bs, d)


def write_kv(cache: torch.Tensor, half: int, slots: torch.Tensor, values: torch.Tensor, packed: bool) -> None:
    """In place: cache[half] at each slot >= 0 = values. cache [2, nb, h, bs, d]; slots [N]; values [N, h, d]."""
    bs, d = cache.shape[3], cache.shape[4]
    valid = slots >= 0
    safe = slots.clamp(min=0)
    blk, off = safe // bs, safe % bs
    lead = torch.full_like(blk, half)
    cache = _storage_view(cache)
    vals = values.to(FP8).view(torch.uint8) if cache.dtype == torch.uint8 else values.to(cache.dtype)
    if packed:
        # Logical (t, j) of a block's head is byte (t // 2) * 2d + 2j + t % 2 of its [bs, d] rows:
        # index those bytes on the input itself rather than through the packed view.
        flat = (off // 2 * 2 * d + off % 2)[:, None] + 2 * torch.arange(d, device=cache.device)  # [N, d]
        index = (lead[:, None], blk[:, None], slice(None), flat // d, flat % d)
        old = cache[index]  # separated advanced indices go first: [N, d, h]
        cache[index] = torch.where(valid[:, None, None], vals.transpose(1, 2), old)
    else:
        old = cache[lead, blk, :, off]  # [N, h, d]
        cache[lead, blk, :, off] = torch.where(valid[:, None, None], vals, old)
