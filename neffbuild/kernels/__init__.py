"""Traceable decode kernels in plain PyTorch ops.

No data-dependent Python control flow and no ``.item()``: every function exports with
``torch.export`` for any static shape. The graphs in ``neffbuild.models`` call them. Eager-only
paths that graphs never reach: ``sdpa_with_sinks`` (prefill) and ``moe``'s expert-by-expert form
for many tokens (taken only outside tracing).
"""

from neffbuild.kernels.attention import paged_attention, sdpa_with_sinks
from neffbuild.kernels.moe import Mxfp4, moe, swiglu
from neffbuild.kernels.norm import rms_norm
from neffbuild.kernels.rope import apply_rope, rope_cos_sin, yarn_inv_freq
from neffbuild.runtime.kv.access import gather_blocks, pack_k_fp8_view, write_kv

__all__ = [
    "Mxfp4",
    "apply_rope",
    "gather_blocks",
    "moe",
    "pack_k_fp8_view",
    "paged_attention",
    "rms_norm",
    "rope_cos_sin",
    "sdpa_with_sinks",
    "swiglu",
    "write_kv",
    "yarn_inv_freq",
]
