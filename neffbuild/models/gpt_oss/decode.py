"""The GPT-OSS giga-kernel (GK) decode step: all layers in one traceable graph.

Layers pair up: layer ``2j`` is sliding-window, layer ``2j+1`` full attention, and both
use KV buffer ``j`` (``[2, num_blocks, kv_heads, block_size, head_dim]``, K then V), each
through its own block table: the full layer through the head-trimmed table, the sliding
layer through the tail-trimmed one with ``swa_kv_pos_offset``. The weights are module
buffers stacked on ``[L, ...]``; export turns them into constants that the inductor
backend leaves out of the artifact and binds at load time.

KV reaches the caller by in-place mutation of the cache inputs: ``torch.export`` records
the write as an input mutation and the AOTInductor artifact performs it on the caller's
tensor (checked in tests/test_gpt_oss.py::test_aoti_matches_eager), so no KV is copied.

Sharded (runtime/parallel.py): with tp > 1 the graph holds one rank's heads and all-reduces
the o-proj over the TP group, and one rank's vocab / tp rows of the embedding (looked up, then
all-reduced) and of the LM head (its logits all-gathered along the vocabulary); with ep > 1 one
rank's experts and an EP combine. The
collectives are ``_c10d_functional`` ops inside the graph; the rank id is the last input.
"""

from __future__ import annotations

import torch
from torch import nn

from neffbuild.kernels import (
    Mxfp4,
    apply_rope,
    moe,
    paged_attention,
    rms_norm,
    rope_cos_sin,
    write_kv,
    yarn_inv_freq,
)
from neffbuild.kernels.collectives import (
    all_gather_rows,
    all_reduce_sum,
    reduce_scatter_rows,
    vocab_parallel_embed,
    vocab_parallel_gather,
)
from neffbuild.kernels.linear import linear, rows_op
from neffbuild.kernels.moe import kernel_forms, native_form  # also registers the native ops
from neffbuild.models.gpt_oss.config import FULL, SLIDING, GptOssConfig, default_aux_layers  # noqa: F401 - re-export
from neffbuild.models.gpt_oss.sharding import local_config
from neffbuild.models.gpt_oss.weights import BLOCKS, SCALES, experts_of, stacked_names
from neffbuild.runtime.parallel import EP_GROUP, TP_GROUP, ParallelLayout

SINGLE = ParallelLayout()


def head(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The LM head: ``linear``, or with ``model.head_kernel: int8`` (a bf16 CPU graph) ``neffbuild::q8_head``, whose
    argmax (and the values near it) are the exact form's bit for bit and the other logits approximate
    (runtime/native_q8.py): for greedy serving."""
    if native_form("head_kernel") == "int8" and x.dtype == weight.dtype == torch.bfloat16:
        return rows_op(torch.ops.neffbuild.q8_head, x, weight)
    return linear(x, weight)


def projection(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """An attention projection (qkv, o): ``linear``, or with ``model.attn_kernel: int8`` (a bf16 CPU graph)
    ``neffbuild::q8_linear``: the weights read as int8 with one float scale a row, about half the bytes of bf16, and
    lossy (runtime/native_q8.py)."""
    if native_form("attn_kernel") == "int8" and x.dtype == weight.dtype == torch.bfloat16:
        return rows_op(torch.ops.neffbuild.q8_linear, x, weight)
    return linear(x, weight)


def attention_inputs(cfg: GptOssConfig, w: dict, i: int, x: torch.Tensor, cos, sin):
    """Norm, fused QKV projection and RoPE for layer i. x [B, S, H] -> q [B,S,Hq,d], k, v [B,S,Hk,d]."""
    d, Hq, Hk = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    h = rms_norm(x, w["ln_attn"][i], cfg.rms_norm_eps)
    qkv = projection(h, w["qkv_w"][i]) + w["qkv_b"][i]
    B, S = x.shape[:2]
    q, k, v = qkv.split([Hq * d, Hk * d, Hk * d], dim=-1)
    q, k, v = q.view(B, S, Hq, d), k.view(B, S, Hk, d), v.view(B, S, Hk, d)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def attention_output_and_mlp(cfg: GptOssConfig, w: dict, i: int, x: torch.Tensor, attn: torch.Tensor,
                             par: ParallelLayout = SINGLE, rank: torch.Tensor | None = None) -> torch.Tensor:
    """o-proj + residual, then the MoE block + residual. x [B, S, H]; attn [B, S, heads*d] (this rank's heads).

    With tp > 1 the o-proj partial sums are all-reduced over the TP group before the bias.
    """
    y = projection(attn, w["o_w"][i])  # [B, S, H], this rank's heads' share
    if par.tp > 1:
        y = all_reduce_sum(y, TP_GROUP)
    x = x + y + w["o_b"][i]
    h = rms_norm(x, w["ln_mlp"][i], cfg.rms_norm_eps)
    B, S, H = h.shape
    return x + expert_block(cfg, w, i, h.reshape(B * S, H), par, rank).view(B, S, H)


def expert_block(cfg: GptOssConfig, w: dict, i: int, h: torch.Tensor, par: ParallelLayout, rank) -> torch.Tensor:
    """The MoE over h [N, H]. With ep > 1 this rank holds a slice of the experts and the EP group
    combines: one all-reduce when its ranks hold the same tokens, else gather, apply, reduce-scatter."""
    gate_up, down = expert_weights(w, "gate_up_w", i), expert_weights(w, "down_w", i)
    args = (w["router_w"][i], w["router_b"][i], gate_up, w["gate_up_b"][i], down, w["down_b"][i],
            cfg.num_experts_per_tok, cfg.swiglu_alpha, cfg.swiglu_limit)
    if par.ep == 1:
        return moe(h, *args)
    first = (rank % par.ep) * w["gate_up_b"].shape[1]  # [1] global id of this rank's first expert
    if not par.ep_gathers:
        return all_reduce_sum(moe(h, *args, first_expert=first), EP_GROUP)
    every = all_gather_rows(h, par.ep, EP_GROUP)  # [ep*N, H]: the EP group's tokens, in group-rank order
    return reduce_scatter_rows(moe(every, *args, first_expert=first), par.ep, EP_GROUP)  # [N, H]


def expert_weights(w: dict, name: str, i: int):
    """Layer i's expert weight ``name``: the dense tensor, or its MXFP4 blocks and scales (kept packed)."""
    if name in w:
        return w[name][i]
    return Mxfp4(w[name + BLOCKS][i], w[name + SCALES][i])


def embed(w: dict, ids: torch.Tensor, par: ParallelLayout = SINGLE, rank: torch.Tensor | None = None) -> torch.Tensor:
    """Token embedding. With tp > 1 each rank holds vocab / tp rows (sharding.py) and the TP group sums."""
    if par.tp == 1:
        return w["embed"][ids]
    return vocab_parallel_embed(w["embed"], ids, rank % par.tp, TP_GROUP)


def unembed(cfg: GptOssConfig, w: dict, x: torch.Tensor, par: ParallelLayout = SINGLE) -> torch.Tensor:
    """Final norm and LM head; logits in float32 whatever the weights' dtype (the step's output contract).

    With tp > 1 each rank computes the logits of its vocab / tp rows and the TP group all-gathers them
    along the vocabulary, so every rank returns the full logits."""
    logits = head(rms_norm(x, w["norm"], cfg.rms_norm_eps), w["lm_head"]).float()  # the vocabulary's GEMV
    return logits if par.tp == 1 else vocab_parallel_gather(logits, par.tp, TP_GROUP)


class GptOssDecode(nn.Module):
    """One decode step over all layers; KV written in place into ``kv_caches``."""

    def __init__(self, cfg: GptOssConfig, stacked: dict[str, torch.Tensor], *, packed_k: bool = False,
                 aux_layers: tuple[int, ...] | None = None, parallel: ParallelLayout = SINGLE,
                 expert_kernel: str = "exact", head_kernel: str = "exact", attn_kernel: str = "exact"):
        super().__init__()
        self.par = parallel
        # the native ops' numeric forms (compiler/graph_spec.py TargetGraph.kernel_forms)
        self.forms = {"expert_kernel": expert_kernel, "head_kernel": head_kernel, "attn_kernel": attn_kernel}
        self.cfg = local_config(cfg, parallel)  # this rank's heads; the stacked weights are its shard
        self.packed_k = packed_k
        self.aux_layers = tuple(aux_layers) if aux_layers else ()
        self.window = cfg.sliding_window
        self.names = stacked_names(experts_of(stacked))  # dense or MXFP4 experts: the weights say which
        for name in self.names:
            self.register_buffer(name, stacked[name], persistent=True)
        # (layer, KV buffer, attention kind): decided once here, never inside forward.
        self.layer_plan = [(i, i // 2, kind) for i, kind in enumerate(cfg.layer_types)]

    def weights(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.names}

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, q] int64
        positions: torch.Tensor,  # [B, q] absolute
        block_table: torch.Tensor,  # [B, W] head-trimmed full-attention table
        block_table_swa: torch.Tensor,  # [B, W_swa] tail-trimmed sliding-window table
        swa_kv_pos_offset: torch.Tensor,  # [B] absolute position of block_table_swa[:, 0]
        slot_mapping: torch.Tensor,  # [B*q] full-group write slots (-1 = pad, skipped)
        slot_mapping_swa: torch.Tensor,  # [B*q] sliding-group write slots
        kv_caches: tuple[torch.Tensor, ...],  # G x [2, num_blocks, kv_heads, block_size, head_dim]
        rank: torch.Tensor | None = None,  # [1] this rank's id; sharded graphs only (picks its experts)
    ):
        with kernel_forms(self.forms):
            return self._step(input_ids, positions, block_table, block_table_swa, swa_kv_pos_offset, slot_mapping,
                              slot_mapping_swa, kv_caches, rank)

    def _step(self, input_ids, positions, block_table, block_table_swa, swa_kv_pos_offset, slot_mapping,
              slot_mapping_swa, kv_caches, rank):
        cfg, w = self.cfg, self.weights()
        B, S = input_ids.shape
        x = embed(w, input_ids, self.par, rank)  # [B, q, H]
        # Computed in the graph (a few ops on head_dim/2 values), not a buffer: a buffer becomes a
        # constant the artifact expects the bundle's weights to provide.
        inv_freq, rope_scale = yarn_inv_freq(cfg.head_dim, cfg.rope)
        cos, sin = rope_cos_sin(positions, inv_freq, rope_scale)  # [B, q, d/2]
        frames = {  # kind -> (block table, kv position offset, write slots, window)
            SLIDING: (block_table_swa, swa_kv_pos_offset, slot_mapping_swa, self.window),
            FULL: (block_table, torch.zeros_like(swa_kv_pos_offset), slot_mapping, None),
        }
        hidden = []
        for i, buf, kind in self.layer_plan:
            hidden.append(x)  # the residual stream entering layer i: EAGLE3 aux id i (0: the embeddings)
            table, offset, slots, window = frames[kind]
            cache = kv_caches[buf]
            q, k, v = attention_inputs(cfg, w, i, x, cos, sin)
            write_kv(cache, 0, slots, k.reshape(B * S, *k.shape[2:]), self.packed_k)
            write_kv(cache, 1, slots, v.reshape(B * S, *v.shape[2:]), False)
            attn = paged_attention(q, cache, table, positions, offset, w["sinks"][i],
                                   cfg.attention_scale, window, self.packed_k)
            x = attention_output_and_mlp(cfg, w, i, x, attn, self.par, rank)
        hidden.append(x)  # aux id L: the stream after the last layer, before the final norm (vLLM collects it too)
        logits = unembed(cfg, w, x, self.par)  # [B, q, V] float32, the whole vocabulary on every rank
        if self.aux_layers:  # aux [B, q, 3H], float32 as the draft takes it
            return logits, torch.cat([hidden[i] for i in self.aux_layers], dim=-1).float()
        return logits
