"""The plugin's attention for vLLM's eager forwards (prefill, chunks, mixed batches), on the bundle's KV layout.

vLLM's CPU backend gives each layer a tensor ``[num_blocks, kv_heads, block_size, 2 * head_dim]``; its kernels
keep K transposed inside a block (``[head_dim, block_size]`` per block and head, for their SIMD loops) and V
plain. A bundle's artifacts read one buffer per layer pair as ``[2, num_blocks, kv_heads, block_size,
head_dim]`` (every block's K rows, then every block's V rows). Both are the same bytes of one tensor, so the
plugin keeps vLLM's allocation (its block manager, its pool, its sharing of one tensor per sliding/full layer
pair) and changes only how its attention layers read and write it: this implementation writes K and V at
``[half, block, :, offset]`` of the bundle's view and attends over the blocks of each request's table, exactly
as the artifacts do, through the runtime's one implementation of the layout (``runtime.kv_access``: writes,
block reads and the packed-FP8 decode the compiled graphs and the eager prefill use). Nothing is copied between
layouts; vLLM's own CPU kernels are not used.

Attention itself: per request, the keys from its table (the sliding window's first block on for sliding
layers), causal and window masks in absolute positions, softmax with the layer's sinks (GPT-OSS), GQA by
repeating KV heads. Plain torch: eager forwards are prefill, whose cost is not the decode step's.

What this leaves out: vLLM's block zeroing (``_zero_block_ids``: Mamba and mixed-precision caches only) and
KV connectors index the tensor in vLLM's own layout; the plugin serves GPT-OSS, which uses neither.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

from neffbuild.runtime import kv_access


def bundle_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """vLLM's per-layer tensor as the bundle's buffer ``[2, nb, kv, bs, d]`` (a view: same storage)."""
    nb, heads, bs, two_d = kv_cache.shape
    if not kv_cache.is_contiguous():
        raise RuntimeError(f"neffbuild: vLLM's KV tensor {tuple(kv_cache.shape)} is not contiguous; the bundle's "
                           "layout is a view of contiguous storage")
    return kv_cache.view(2, nb, heads, bs, two_d // 2)


class BundleLayoutAttention(CPUAttentionBackendImpl):
    """vLLM's CPU attention implementation, reading and writing K/V in the bundle's layout."""

    neffbuild_packed = False  # packed-FP8 K (the bundle's fp8_packed_kv): set by ``adopt``
    neffbuild_skip = None  # [T] bool: tokens an artifact ran in this forward (decode.BundleDecoder.skip_tokens)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        buffer = bundle_view(kv_cache)
        n = slot_mapping.shape[0]
        slots = slot_mapping.long()  # padding tokens have slot -1: written nowhere
        if self.neffbuild_skip is not None:  # an artifact wrote these tokens' KV in this forward
            slots = slots.masked_fill(self.neffbuild_skip[:n], -1)
        kv_access.write_kv(buffer, 0, slots, key[:n], self.neffbuild_packed)  # [n, kv, d] at each token's slot
        kv_access.write_kv(buffer, 1, slots, value[:n], False)  # V is never packed

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported with a neffbuild bundle")
        if attn_metadata is None:  # vLLM's warm-up and profile runs
            return output
        buffer = bundle_view(kv_cache)
        starts = attn_metadata.query_start_loc.tolist()
        seq_lens = attn_metadata.seq_lens.tolist()
        skip = self.neffbuild_skip
        for r, total in enumerate(seq_lens):
            a, b = starts[r], starts[r + 1]
            if b > a and skip is not None and bool(skip[a]):
                output[a:b] = 0  # the artifact ran this row; its eager output is never read (zeros, not garbage)
            elif b > a:
                output[a:b] = self._attend(query[a:b], buffer, attn_metadata.block_table[r], total).view_as(
                    output[a:b])
        return output

    def _attend(self, q: torch.Tensor, buffer: torch.Tensor, row: torch.Tensor, total: int) -> torch.Tensor:
        """One request's queries (the last ``len(q)`` of ``total`` positions) over its cached keys."""
        n, H, d = q.shape[0], self.num_heads, self.head_size
        bs, kv = buffer.shape[3], buffer.shape[2]
        first_q = total - n
        window = self.sliding_window if self.sliding_window not in (None, -1) else None
        lo_block = max(0, first_q - window + 1) // bs if window else 0
        blocks = row[lo_block: -(-total // bs)].long()[None]  # [1, W]
        k = kv_access.gather_blocks(buffer, 0, blocks, self.neffbuild_packed, q.dtype)[0]  # [kv, T, d] from lo_block
        v = kv_access.gather_blocks(buffer, 1, blocks, False, q.dtype)[0]
        k_pos = torch.arange(lo_block * bs, lo_block * bs + k.shape[1])
        q_pos = torch.arange(first_q, total)
        allowed = k_pos[None, :] <= q_pos[:, None]  # [n, T]
        if window:
            allowed &= k_pos[None, :] > q_pos[:, None] - window
        g = H // kv
        qh = q.reshape(n, kv, g, d).permute(1, 2, 0, 3)  # [kv, g, n, d]
        scores = torch.einsum("hgnd,htd->hgnt", qh, k) * self.scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        sinks = self.sinks.to(scores.dtype).reshape(kv, g, 1, 1).expand(kv, g, n, 1)
        probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
        out = torch.einsum("hgnt,htd->hgnd", probs, v)  # [kv, g, n, d]
        return out.permute(2, 0, 1, 3).reshape(n, H, d)


def adopt(attention_layers, packed_k: bool = False) -> None:
    """Switch every decoder attention layer's implementation to the bundle layout (the class, and whether K is
    packed FP8: the bundle facts' ``fp8_packed_kv``)."""
    for layer in attention_layers:
        impl = layer.impl
        if type(impl) is not CPUAttentionBackendImpl:
            raise RuntimeError(f"neffbuild: layer {layer.layer_name} uses {type(impl).__name__}; the bundle plugin "
                               "runs on vLLM's CPU attention backend (CPU_ATTN) only")
        if impl.attn_type != "decoder" or impl.sinks is None:
            raise RuntimeError(f"neffbuild: layer {layer.layer_name} is not a GPT-OSS decoder layer with sinks")
        impl.__class__ = BundleLayoutAttention
        impl.neffbuild_packed = packed_k
