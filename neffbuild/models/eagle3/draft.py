"""The EAGLE3 draft graph: catch up on the verified tokens, then propose k tokens, in one call.

One compiled call per speculative step, at query length 1+k (the grid's ``draft_b{B}_ctx{S}``):

1. **Catch-up** (the 1+k query rows): row i of a request is the token at position p+i+1
   (the accepted drafts, then the bonus token) with the target's auxiliary hidden states
   at position p+i, for the ``num_valid`` rows the target just verified (1..1+k; 0 for a
   padding row). The rows' draft KV is written at positions p..p+num_valid-1, so rejected
   speculative entries from the previous call are overwritten.
2. **Proposal** (k-1 more single-row passes inside the graph): from the last valid row,
   greedy draft token -> its embedding plus the draft's own hidden state -> the next
   position, writing draft KV at positions computed in the graph from the block table.

Layer (common EAGLE3 form): fused = fc(aux [3H]); attention input = [norm(embedding),
norm(state)] (2H) -> q/k/v; residual on the state; o-proj; post-norm; SiLU-gated MLP;
final norm; LM head over the draft vocabulary; ``d2t`` maps the argmax to a target id.
No attention sinks (a -inf sink column is an exact no-op) and no sliding window.

Weights: the recipe's ``model.weights_dtype``; the layer computes in it (the aux states are cast on the
way in) and its logits in float32, as the target's. Under tp > 1 the draft is sharded like the target
(``models/eagle3/sharding.py``): a rank holds its query and KV heads (its KV buffer holds those KV
heads only) and all-reduces the o-proj's partial sums over the TP group; it holds vocab / tp rows of
the LM head and picks the greedy token with one all-gather of each rank's best (value, id); it looks
tokens up in the vocabulary-split embedding (the target's, or its own) as the target does (its rows,
then an all-reduce), so its graph takes the rank id as its last input.
"""

from __future__ import annotations

import torch
from torch import nn

from neffbuild.kernels import (
    apply_rope,
    paged_attention,
    rms_norm,
    rope_cos_sin,
    sdpa_with_sinks,
    write_kv,
    yarn_inv_freq,
)
from neffbuild.kernels.collectives import all_reduce_sum, vocab_parallel_argmax, vocab_parallel_embed
from neffbuild.kernels.linear import linear
from neffbuild.models.eagle3.config import Eagle3Config
from neffbuild.models.eagle3.shapes import local_config
from neffbuild.models.eagle3.weights import DRAFT_EMBED, DRAFT_NAMES
from neffbuild.runtime.parallel import TP_GROUP, ParallelLayout


def draft_layer(cfg: Eagle3Config, w: dict, emb: torch.Tensor, state: torch.Tensor, cos, sin, attend,
                tp: int = 1) -> torch.Tensor:
    """emb, state [B, S, H] -> new state [B, S, H]; ``attend(q, k, v) -> [B, S, Hq*d]`` owns the KV.

    ``cfg``: this rank's heads (``local_config``); with tp > 1 the o-proj's partial sums are all-reduced."""
    B, S, _ = state.shape
    d, Hq, Hk = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    x = torch.cat([rms_norm(emb.to(state.dtype), w["draft_ln_embed"], cfg.rms_norm_eps),
                   rms_norm(state, w["draft_ln_hidden"], cfg.rms_norm_eps)], dim=-1)  # [B, S, 2H]
    q, k, v = linear(x, w["draft_qkv_w"]).split([Hq * d, Hk * d, Hk * d], dim=-1)
    q, k, v = q.view(B, S, Hq, d), k.view(B, S, Hk, d), v.view(B, S, Hk, d)
    y = linear(attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v), w["draft_o_w"])
    state = state + (all_reduce_sum(y, TP_GROUP) if tp > 1 else y)
    m = rms_norm(state, w["draft_ln_mlp"], cfg.rms_norm_eps)
    return state + linear(nn.functional.silu(linear(m, w["draft_gate_w"])) * linear(m, w["draft_up_w"]),
                          w["draft_down_w"])


def propose(cfg: Eagle3Config, w: dict, state: torch.Tensor, tp: int = 1) -> torch.Tensor:
    """Greedy draft token as a target id. state [..., H] -> [...] int64 (the same on every TP rank)."""
    logits = linear(rms_norm(state, w["draft_norm"], cfg.rms_norm_eps), w["draft_lm_head"]).float()
    best = logits.argmax(-1) if tp == 1 else vocab_parallel_argmax(logits, tp, TP_GROUP)
    return best + w["draft_d2t"][best]


def no_sinks(cfg: Eagle3Config, like: torch.Tensor) -> torch.Tensor:
    return torch.full((cfg.num_attention_heads,), float("-inf"), dtype=like.dtype, device=like.device)


class Eagle3Draft(nn.Module):
    """Catch-up over 1+k rows, then k greedy proposals; draft KV written in place into ``kv_cache``."""

    def __init__(self, cfg: Eagle3Config, weights: dict[str, torch.Tensor], *, num_speculative_tokens: int,
                 packed_k: bool = False, parallel: ParallelLayout | None = None):
        super().__init__()
        par = parallel or ParallelLayout()
        # ``weights`` are this rank's shard (models/eagle3/sharding.py): its heads, its LM head rows.
        self.cfg, self.tp, self.k, self.packed_k = local_config(cfg, par), par.tp, num_speculative_tokens, packed_k
        # The draft shares the target's token embedding (bundle name "embed") unless it brought its own;
        # either is the rank's vocabulary slice under tp > 1.
        self.embed_name = DRAFT_EMBED if DRAFT_EMBED in weights else "embed"
        for name in DRAFT_NAMES + (self.embed_name,):
            self.register_buffer(name, weights[name], persistent=True)
        self.rope_scale = yarn_inv_freq(cfg.head_dim, cfg.rope)[1]

    @property
    def draft_inv_freq(self) -> torch.Tensor:
        """Computed in the forward, as the target's graph does: a buffer would be a graph constant the bundle's
        weights do not hold (the artifact then refuses to load)."""
        return yarn_inv_freq(self.cfg.head_dim, self.cfg.rope)[0]

    def weights(self) -> dict[str, torch.Tensor]:
        w = {name: getattr(self, name) for name in DRAFT_NAMES}
        w["embed"] = getattr(self, self.embed_name)
        return w

    def lookup(self, w: dict, ids: torch.Tensor, rank: torch.Tensor | None) -> torch.Tensor:
        if self.tp == 1:
            return w["embed"][ids]
        return vocab_parallel_embed(w["embed"], ids, rank % self.tp, TP_GROUP)

    def paged_attend(self, kv_cache, table, positions, slots, sinks):
        B, S = positions.shape
        zero = torch.zeros_like(positions[:, 0])

        def attend(q, k, v):
            write_kv(kv_cache, 0, slots, k.reshape(B * S, *k.shape[2:]), self.packed_k)
            write_kv(kv_cache, 1, slots, v.reshape(B * S, *v.shape[2:]), False)
            return paged_attention(q, kv_cache, table, positions, zero, sinks,
                                   self.cfg.attention_scale, None, self.packed_k)

        return attend

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, 1+k] token at position p+i+1 (accepted drafts, then the bonus token)
        positions: torch.Tensor,  # [B, 1+k] p+i
        hidden: torch.Tensor,  # [B, 1+k, 3H] target auxiliary hidden states at p+i
        num_valid: torch.Tensor,  # [B] rows verified this step (1..1+k); 0 = padding row
        block_table: torch.Tensor,  # [B, W] head-trimmed (the full-attention group's block ids)
        slot_mapping: torch.Tensor,  # [B*(1+k)] catch-up write slots (-1 = not written)
        kv_cache: torch.Tensor,  # [2, num_blocks, kv_heads, block_size, head_dim] the draft's KV group (its heads)
        rank: torch.Tensor | None = None,  # [1] this rank's id; sharded bundles only (its embedding rows)
    ) -> torch.Tensor:  # [B, k] proposed target token ids
        cfg, w = self.cfg, self.weights()
        B = input_ids.shape[0]
        bs, W = kv_cache.shape[3], block_table.shape[1]
        state = linear(hidden.to(w["draft_fc"].dtype), w["draft_fc"])  # [B, 1+k, H] in the weights' dtype
        sinks = no_sinks(cfg, state)
        cos, sin = rope_cos_sin(positions, self.draft_inv_freq, self.rope_scale)
        state = draft_layer(cfg, w, self.lookup(w, input_ids, rank), state, cos, sin,
                            self.paged_attend(kv_cache, block_table, positions, slot_mapping, sinks), self.tp)
        last = (num_valid - 1).clamp(min=0)[:, None]  # [B, 1]
        state = state.gather(1, last[..., None].expand(B, 1, state.shape[-1]))  # [B, 1, H]
        pos = positions.gather(1, last)  # [B, 1]
        tokens = [propose(cfg, w, state, self.tp)]  # k x [B, 1]
        live = (num_valid > 0)[:, None]
        for _ in range(self.k - 1):
            pos = pos + 1
            col = (pos // bs).clamp(max=W - 1)
            slots = torch.where(live, block_table.gather(1, col) * bs + pos % bs, -1).reshape(B)
            cos, sin = rope_cos_sin(pos, self.draft_inv_freq, self.rope_scale)
            state = draft_layer(cfg, w, self.lookup(w, tokens[-1], rank), state, cos, sin,
                                self.paged_attend(kv_cache, block_table, pos, slots, sinks), self.tp)
            tokens.append(propose(cfg, w, state, self.tp))
        return torch.cat(tokens, dim=1)


@torch.no_grad()
def prefill(draft: Eagle3Draft, tokens: torch.Tensor, aux: torch.Tensor, kv_cache: torch.Tensor,
            block_row: torch.Tensor, rank: torch.Tensor | None = None) -> None:
    """Eager catch-up over a prompt: draft KV at positions 0..n-1 of one request.

    tokens [n]: the token at each position + 1; aux [n, 3H]: the target's aux states at each
    position; block_row: the request's full-attention block ids. Dense causal attention
    over the rows themselves (independent of the paged kernels the graph uses).
    """
    n = tokens.shape[0]
    if n == 0:
        return
    cfg, w = draft.cfg, draft.weights()
    pos = torch.arange(n)
    cos, sin = rope_cos_sin(pos[None], draft.draft_inv_freq, draft.rope_scale)
    bs = kv_cache.shape[3]
    slots = block_row[pos // bs] * bs + pos % bs

    def attend(q, k, v):
        write_kv(kv_cache, 0, slots, k[0], draft.packed_k)
        write_kv(kv_cache, 1, slots, v[0], False)
        return sdpa_with_sinks(q, k, v, no_sinks(cfg, q), cfg.attention_scale, None)

    state = linear(aux[None].to(w["draft_fc"].dtype), w["draft_fc"])
    draft_layer(cfg, w, draft.lookup(w, tokens[None], rank), state, cos, sin, attend, draft.tp)
