"""Native per-layer prefill (eager): the DI producer side and the way tests fill a KV cache.

It runs one prompt at a time with dense causal attention over the prompt itself (an
implementation independent of the paged decode kernels), and writes every position's K
and V into the per-buffer paged cache through the request's full and sliding-window
block tables, in the same layout the decode graph reads. A later chunk of a prompt
(``start`` > 0: a host engine's chunked prefill) attends over the KV its earlier chunks
left in the cache, read through the same paged kernel the decode graph uses.

On a sharded rank it runs that rank's shard with the same collectives as the decode graph,
eagerly; ranks whose MoE gathers tokens across DP groups must call it in lockstep with the
same ``pad_to`` length (positions past the prompt are computed and never written).
"""

from __future__ import annotations

import torch

from neffbuild.kernels import paged_attention, rope_cos_sin, sdpa_with_sinks, write_kv, yarn_inv_freq
from neffbuild.models.gpt_oss.config import SLIDING, GptOssConfig
from neffbuild.models.gpt_oss.decode import (
    SINGLE,
    attention_inputs,
    attention_output_and_mlp,
    embed,
    unembed,
)
from neffbuild.models.gpt_oss.sharding import local_config
from neffbuild.runtime.kv.blocks import (
    NULL_BLOCK,  # a plain layout constant (models import no runtime logic)
)
from neffbuild.runtime.parallel import ParallelLayout, rank_tensor

LOGITS = ("all", "last", "none")  # prefill's ``logits``: which positions' rows it returns


def slots_for(block_row: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of absolute positions through one request's (untrimmed) block table row.

    Positions whose block is the null block get slot -1 (not written): a sliding-window row
    holds only the blocks later queries read, the older entries are the null block.
    """
    blocks = block_row[positions // block_size]
    return torch.where(blocks == NULL_BLOCK, -1, blocks * block_size + positions % block_size)


def _as_stored(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to the cache's element type (FP8: e4m3; bfloat16), back in ``x``'s dtype.

    Prefill attends over K and V at the precision decode reads them from the cache, so the
    logits of the last prompt position equal what a decode step at that position computes
    (a DI decode worker recomputes that position from the transferred FP8 KV).
    """
    if cache.dtype in (torch.float8_e4m3fn, torch.uint8):  # uint8: FP8 bytes (kv_cache.graph_view)
        return x.to(torch.float8_e4m3fn).to(x.dtype)
    return x.to(cache.dtype).to(x.dtype)


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
    parallel: ParallelLayout = SINGLE,
    rank: int = 0,
    pad_to: int = 0,
    aux_layers: tuple[int, ...] = (),
    logits: str = "all",
    start: int = 0,
):
    """Fill the KV cache for one prompt; return logits [N, vocab] for every prompt position
    (and, with ``aux_layers``, those layers' outputs concatenated: [N, len(aux_layers) * H]).

    ``start``: the prompt is positions ``start .. start + N - 1`` of a sequence whose first ``start`` positions'
    KV the cache already holds (through the same block rows); 0: a whole prompt (dense attention).

    ``logits="last"``: only the last position's row ([1, vocab]; what a sampler needs), ``"none"``: None (a KV
    producer): at a 201k vocabulary the unembedding of every position costs more than the layers."""
    if logits not in LOGITS:
        raise ValueError(f"prefill: logits={logits!r}; one of {', '.join(LOGITS)}")
    prompt = torch.as_tensor(prompt, dtype=torch.long)
    N = prompt.shape[0]
    ids = torch.cat([prompt, prompt.new_zeros(max(0, pad_to - N))])[None]  # [1, max(N, pad_to)]
    pos = start + torch.arange(ids.shape[1])
    inv_freq, scale = yarn_inv_freq(cfg.head_dim, cfg.rope)
    cos, sin = rope_cos_sin(pos[None], inv_freq, scale)
    bs = kv_caches[0].shape[3]
    real = pos < start + N
    slots = {True: torch.where(real, slots_for(block_row_swa, pos.clamp(max=start + N - 1), bs), -1),
             False: torch.where(real, slots_for(block_row, pos.clamp(max=start + N - 1), bs), -1)}
    width = -(-(start + N) // bs)  # the table columns a later chunk's attention reads
    local, rank_t = local_config(cfg, parallel), rank_tensor(rank)
    x = embed(stacked, ids, parallel, rank_t)
    hidden = []
    for i, kind in enumerate(cfg.layer_types):
        hidden.append(x[0, :N])  # the residual stream entering layer i: EAGLE3 aux id i (0: the embeddings)
        sliding = kind == SLIDING
        cache = kv_caches[i // 2]
        q, k, v = attention_inputs(local, stacked, i, x, cos, sin)
        write_kv(cache, 0, slots[sliding], k[0], packed_k)
        write_kv(cache, 1, slots[sliding], v[0], False)
        window = cfg.sliding_window if sliding else None
        if start:  # over the cache: the earlier chunks' KV and this chunk's, as stored
            first = max(0, start - window + 1) // bs if window else 0  # a sliding row's older blocks are null
            row = (block_row_swa if sliding else block_row)[first:width].long()[None]
            attn = paged_attention(q, cache, row, pos[None], pos.new_full((1,), first * bs), stacked["sinks"][i],
                                   cfg.attention_scale, window, packed_k)
        else:
            k, v = _as_stored(k, cache), _as_stored(v, cache)
            attn = sdpa_with_sinks(q, k, v, stacked["sinks"][i], cfg.attention_scale, window)
        x = attention_output_and_mlp(cfg, stacked, i, x, attn, parallel, rank_t)
    hidden.append(x[0, :N])  # aux id L: the stream after the last layer, before the final norm
    if logits == "none":
        out = None
    elif logits == "last":  # one row; none for an empty prompt (a lockstep rank with no request: same collectives)
        out = unembed(cfg, stacked, x[:, max(N - 1, 0):max(N, 1)], parallel)[0, :min(N, 1)]
    else:
        out = unembed(cfg, stacked, x, parallel)[0, :N]
    if aux_layers:
        return out, torch.cat([hidden[i] for i in aux_layers], dim=-1).float()
    return out
