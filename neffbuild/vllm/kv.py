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


def allow_fp8_kv_without_avx512() -> None:
    """Let vLLM's CPU attention backend set up a one-byte KV cache on a host without AVX-512 (idempotent).

    vLLM 0.32's CPU metadata builder picks its attention kernel for the KV dtype when the cache is set up, and
    refuses FP8 without AVX-512 or AMX ("FP8 KV cache on CPU requires x86 with AVX-512 or AMX."; its scheduler
    metadata has no FP8 form there either), because its own FP8 kernel needs them. A bundle's layers never run
    that kernel: the runtime reads and writes the bytes, and the builder only hands the forward its block tables,
    slots and lengths. So while the plugin serves a bundle, a builder that refuses the KV dtype is built as for
    the model's own dtype; its tensors (vLLM's allocation, one byte an element) are untouched."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder

    original = CPUAttentionMetadataBuilder.__init__
    if getattr(original, "neffbuild_fp8_kv", False):
        return

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        try:
            original(self, kv_cache_spec, layer_names, vllm_config, device)
            return
        except NotImplementedError:
            cache = vllm_config.cache_config
            if cache.cache_dtype == "auto":
                raise
            kept, cache.cache_dtype = cache.cache_dtype, "auto"
        try:
            original(self, kv_cache_spec, layer_names, vllm_config, device)
        finally:
            cache.cache_dtype = kept

    __init__.neffbuild_fp8_kv = True
    CPUAttentionMetadataBuilder.__init__ = __init__
