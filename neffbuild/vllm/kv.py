"""vLLM's KV tensors as the bundle's buffers: the same bytes, another view.

vLLM's CPU backend allocates each layer's KV as ``[num_blocks, kv_heads, block_size, 2 * head_dim]`` (its hybrid
KV manager gives a sliding/full layer pair one tensor). A bundle's artifacts and its eager prefill read one
buffer per layer pair as ``[2, num_blocks, kv_heads, block_size, head_dim]`` (every block's K rows, then every
block's V rows): a view of the same contiguous storage. The plugin keeps vLLM's allocation (its block manager,
its pool) and nothing but the runtime reads or writes those bytes (vLLM's attention layers never run), so the
byte format inside is the bundle's for every KV dtype: float32, bfloat16, packed FP8 (which vLLM allocates as
one-byte elements: viewed here as float8_e4m3fn).
"""

from __future__ import annotations

import torch


def bundle_view(kv_cache: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """vLLM's per-layer tensor as the bundle's buffer ``[2, nb, kv, bs, d]`` in ``dtype`` (a view: same storage)."""
    nb, heads, bs, two_d = kv_cache.shape
    if not kv_cache.is_contiguous():
        raise RuntimeError(f"neffbuild: vLLM's KV tensor {tuple(kv_cache.shape)} is not contiguous; the bundle's "
                           "layout is a view of contiguous storage")
    if dtype is not None and kv_cache.dtype != dtype:
        if kv_cache.element_size() != torch.empty(0, dtype=dtype).element_size():
            raise RuntimeError(f"neffbuild: vLLM's KV tensor is {kv_cache.dtype}, the bundle's KV is {dtype}; start "
                               "vLLM with the settings `neffbuild inspect BUNDLE --vllm-config` prints")
        kv_cache = kv_cache.view(dtype)  # FP8 bytes vLLM allocated as uint8 (or another one-byte type)
    return kv_cache.view(2, nb, heads, bs, two_d // 2)
