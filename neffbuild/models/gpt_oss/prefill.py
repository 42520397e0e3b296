"""Native per-layer prefill (eager): the DI producer side and the way tests fill a KV cache.

It runs one prompt at a time with dense causal attention over the prompt itself (an
implementation independent of the paged decode kernels), and writes every position's K
and V into the per-buffer paged cache through the request's full and sliding-window
block tables, in the same layout the decode graph reads.
"""

from __future__ import annotations

import torch

from kernels import rms_norm, rope_cos_sin, sdpa_with_sinks, write_kv, yarn_inv_freq
from neffbuild.models.gpt_oss.config import SLIDING, GptOssConfig
from neffbuild.models.gpt_oss.decode import attention_inputs, attention_output_and_mlp
from neffbuild.runtime.blocks import NULL_BLOCK  # a plain layout constant (models import no runtime logic)


def slots_for(block_row: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of absolute positions through one request's (untrimmed) block table row.

    Positions whose block is the null block get slot -1 (not written): a sliding-window row
    holds only the blocks later queries read, the older entries are the null block.
    """
    blocks = block_row[positions // block_size]
    return torch.where(blocks == NULL_BLOCK, -1, blocks * block_size + positions % block_size)


@torch.no_grad()
def prefill(
    cfg: GptOssConfig,
    stacked: dict[str, torch.Tensor],
    prompt: list[int] | torch.Tensor,
    kv_caches: list[torch.Tensor],
    block_row: torch.Tensor,  # [max_blocks] the request's full-attention blocks
    block_row_swa: torch.Tensor,  # [max_blocks] the request's sliding-window blocks
    *,
    packed_k: bool = False,
) -> torch.Tensor:
    """Fill the KV cache for one prompt; return logits [N, vocab] for every prompt position."""
    ids = torch.as_tensor(prompt, dtype=torch.long)[None]  # [1, N]
    N = ids.shape[1]
    pos = torch.arange(N)
    inv_freq, scale = yarn_inv_freq(cfg.head_dim, cfg.rope)
    cos, sin = rope_cos_sin(pos[None], inv_freq, scale)
    bs = kv_caches[0].shape[3]
    slots = {True: slots_for(block_row_swa, pos, bs), False: slots_for(block_row, pos, bs)}
    x = stacked["embed"][ids]
    for i, kind in enumerate(cfg.layer_types):
        sliding = kind == SLIDING
        cache = kv_caches[i // 2]
        q, k, v = attention_inputs(cfg, stacked, i, x, cos, sin)
        write_kv(cache, 0, slots[sliding], k[0], packed_k)
        write_kv(cache, 1, slots[sliding], v[0], False)
        window = cfg.sliding_window if sliding else None
        attn = sdpa_with_sinks(q, k, v, stacked["sinks"][i], cfg.attention_scale, window)
        x = attention_output_and_mlp(cfg, stacked, i, x, attn)
    return (rms_norm(x, stacked["norm"], cfg.rms_norm_eps) @ stacked["lm_head"].t())[0]
