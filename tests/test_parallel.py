"""Sharded decode graphs (tp, ep, dp) against the unsharded model, in real gloo processes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from neffbuild.models.gpt_oss import sharding
from neffbuild.models.gpt_oss import weights as W
from neffbuild.models.gpt_oss.decode import GptOssDecode
from neffbuild.runtime.parallel import ParallelLayout
from tests.dist_util import run_ranks

BS, NB, B = 16, 24, 2


def step_inputs(cfg, seed: int):
    """One decode step of B requests over a random KV cache (full heads): (inputs, kv caches)."""
    g = torch.Generator().manual_seed(seed)
    kv = tuple(torch.randn(2, NB, cfg.num_key_value_heads, BS, cfg.head_dim, generator=g) * 0.5
               for _ in range(cfg.num_kv_buffers))
    positions = torch.tensor([[5 + seed], [37 + seed]])
    table = torch.stack([torch.arange(1, 9), torch.arange(9, 17)])  # [B, 8] blocks, 128 positions
    slots = table[torch.arange(B), positions[:, 0] // BS] * BS + positions[:, 0] % BS
    ins = (torch.randint(0, cfg.vocab_size, (B, 1), generator=g), positions, table, table[:, -2:].clone(),
           torch.full((B,), 6 * BS), slots, slots.clone())
    return ins, kv


def _rank_step(rank, world, cfg, stacked, layout, per_dp):
    from neffbuild.runtime.parallel import rank_tensor
    from neffbuild.runtime.world import join

    join(layout)
    ins, kv = per_dp[layout.dp_rank(rank)]
    heads = sharding.kv_heads_of(cfg, layout, layout.tp_rank(rank))
    kv = tuple(c[:, :, heads.start:heads.stop].clone() for c in kv)
    module = GptOssDecode(cfg, sharding.shard(cfg, stacked, layout, rank), parallel=layout).eval()
    with torch.no_grad():
        logits = module(*ins, kv, rank_tensor(rank))
    return logits, kv, list(heads)


LAYOUTS = {
    "tp2_ep2": (ParallelLayout(tp=2, ep=2), {}),
    "tp2_ep1": (ParallelLayout(tp=2), {}),
    "dp2_ep2": (ParallelLayout(dp=2, ep=2), {}),
    "tp2_replicated_kv": (ParallelLayout(tp=2, ep=2), {"num_key_value_heads": 1}),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sharded_step_equals_unsharded(tiny_cfg, name):
    """Each rank's sharded step (its heads, its experts, in-graph collectives over gloo) gives the
    unsharded step's logits and writes its slice of the unsharded step's KV."""
    layout, overrides = LAYOUTS[name]
    cfg = dataclasses.replace(tiny_cfg, **overrides)
    stacked = W.stack(cfg, W.random_state_dict(cfg, 3))
    per_dp = [step_inputs(cfg, seed) for seed in range(layout.dp)]
    results = run_ranks(_rank_step, layout.world_size, cfg, stacked, layout, per_dp)
    full = GptOssDecode(cfg, stacked).eval()
    for rank, (logits, kv, heads) in enumerate(results):
        ins, ref_kv = per_dp[layout.dp_rank(rank)]
        ref_kv = tuple(c.clone() for c in ref_kv)
        with torch.no_grad():
            want = full(*ins, ref_kv)
        torch.testing.assert_close(logits, want, atol=1e-5, rtol=0)
        for got, ref in zip(kv, ref_kv, strict=True):
            torch.testing.assert_close(got, ref[:, :, heads], atol=1e-5, rtol=0)


def test_sharded_graph_traces_without_peers_and_key_covers_layout(tiny_recipe):
    """No process group exists in this process: tracing uses placeholders, removed afterwards. The
    graph holds the in-graph collectives, and every distinct layout of a sharded graph has its own key."""
    from torch._C._distributed_c10d import _resolve_process_group

    from neffbuild.compiler.backends import get_backend
    from neffbuild.compiler.graphs import target_graph
    from neffbuild.compiler.worker import key_for
    from neffbuild.grid import Target
    from neffbuild.runtime.parallel import TP_GROUP

    backend, target = get_backend("inductor"), Target("decode", 2, 128, 1, "decode_b2_ctx128")
    keys, texts = {}, {}
    for lay in [(1, 1, 1), (1, 2, 1), (2, 1, 2), (2, 2, 2), (1, 2, 2)]:
        r = tiny_recipe.replace(tp=lay[0], dp=lay[1], ep=lay[2])
        keys[lay], _, sig, texts[lay] = key_for(target_graph(r, target), backend)
        assert (sig[-1]["name"] == "rank") == (lay[0] > 1 or lay[2] > 1)
    assert keys[(1, 1, 1)] == keys[(1, 2, 1)]  # an unsharded graph is the same for any dp
    assert len({keys[k] for k in keys if k != (1, 2, 1)}) == 4  # (2,1,2) and (2,2,2) trace alike: the layout keys them
    assert "_c10d_functional" not in texts[(1, 1, 1)]
    L = tiny_recipe.model.config.num_hidden_layers
    # o-proj and MoE per layer, and the vocabulary-split embedding once; its logits all-gathered along the vocabulary
    assert texts[(2, 1, 2)].count("_c10d_functional.all_reduce.default(") == 2 * L + 1
    assert texts[(2, 1, 2)].count("_c10d_functional.all_gather_into_tensor.default(") == 1
    assert "all_gather_into_tensor" in texts[(1, 2, 2)] and "reduce_scatter_tensor" in texts[(1, 2, 2)]
    with pytest.raises(RuntimeError):
        _resolve_process_group(TP_GROUP)


def _subgroup_rank(rank, world):
    import torch.distributed as dist

    from neffbuild.kernels.collectives import all_reduce_sum
    from neffbuild.runtime.parallel import TP_GROUP
    from neffbuild.runtime.world import join

    sub = dist.new_group([1, 2])  # ranks 1 and 2 are the bundle's world; rank 0 stands for a prefill worker
    if rank == 0:
        return None
    ctx = join(ParallelLayout(tp=2), group=sub)
    return ctx.rank, all_reduce_sum(torch.tensor([float(rank)]), TP_GROUP).item()


def test_join_a_subgroup_of_a_larger_job():
    """A bundle's world may be a subgroup: rank ids are ranks in it, collectives stay inside it."""
    assert run_ranks(_subgroup_rank, 3) == [None, (0, 3.0), (1, 3.0)]


def _eager_collectives_rank(rank, world):
    from torch._C._distributed_c10d import ProcessGroup

    from neffbuild.kernels.collectives import all_gather_rows, all_reduce_sum, reduce_scatter_rows
    from neffbuild.runtime import world as W
    from neffbuild.runtime.parallel import TP_GROUP, eager_group

    ctx = W.join(ParallelLayout(tp=2))
    twin_apart = ctx.groups[eager_group(TP_GROUP)] is not ctx.groups[TP_GROUP]
    dead = ProcessGroup(0, 2)  # no backend: any collective over it fails at once
    W.register(TP_GROUP, dead)  # the graphs' name now resolves to it; eager code must not notice
    x = torch.tensor([[1.0 + rank, 2.0]])
    out = (all_reduce_sum(x, TP_GROUP).tolist(), x.tolist(), all_gather_rows(x, 2, TP_GROUP).tolist(),
           reduce_scatter_rows(torch.arange(4.0).view(2, 2) * (rank + 1), 2, TP_GROUP).tolist(), twin_apart)
    del dead
    return out


def test_eager_collectives_run_over_the_twin_group_not_the_graphs():
    """Eager (Python) collectives use each group's eager twin through torch.distributed's API, never the group the
    artifacts use: a compiled artifact holds the GIL, and a gloo worker may need the GIL to drop an eager tensor
    under the group's queue lock (kernels/collectives.py). With the graphs' name bound to a group that cannot run
    a collective, the eager results are still the sums, gathers and scatters."""
    got = run_ranks(_eager_collectives_rank, 2)
    assert got[0] == ([[3.0, 4.0]], [[1.0, 2.0]], [[1.0, 2.0], [2.0, 2.0]], [[0.0, 3.0]], True)
    assert got[1] == ([[3.0, 4.0]], [[2.0, 2.0]], [[1.0, 2.0], [2.0, 2.0]], [[6.0, 9.0]], True)


def _rank_prefill_and_draft(rank, world, cfg, stacked, dweights, layout, prompt, draft_ins, draft_kv_heads):
    """Rank ``rank``'s eager prefill (its heads, its vocabulary rows, its experts) and EAGLE3 draft call."""
    from neffbuild.models.eagle3 import sharding as draft_sharding
    from neffbuild.models.eagle3.config import Eagle3Config
    from neffbuild.models.eagle3.draft import Eagle3Draft
    from neffbuild.models.gpt_oss.prefill import prefill
    from neffbuild.runtime.parallel import rank_tensor
    from neffbuild.runtime.world import join

    join(layout)
    mine = sharding.shard(cfg, stacked, layout, rank)
    heads = sharding.kv_heads_of(cfg, layout, layout.tp_rank(rank))
    kv = [torch.zeros(2, NB, len(heads), BS, cfg.head_dim) for _ in range(cfg.num_kv_buffers)]
    row = torch.arange(1, 9)
    logits = prefill(cfg, mine, prompt, kv, row, row, parallel=layout, rank=rank)
    dcfg = Eagle3Config.from_hf_dict({"num_key_value_heads": draft_kv_heads}, cfg)
    dmine = draft_sharding.shard(dcfg, dweights, layout, rank)  # its heads and LM-head rows of the draft
    dheads = draft_sharding.kv_heads_of(dcfg, layout, layout.tp_rank(rank))
    draft = Eagle3Draft(dcfg, dict(dmine, embed=mine["embed"]), num_speculative_tokens=3, parallel=layout).eval()
    cache = torch.zeros(2, NB, len(dheads), BS, dcfg.head_dim)
    with torch.no_grad():
        tokens = draft(*draft_ins, cache, rank_tensor(rank))
    shapes = {n: (tuple(t.shape), t.dtype) for n, t in dmine.items()}
    return logits, kv, list(heads), tuple(mine["embed"].shape), tokens, cache, list(dheads), shapes


@pytest.mark.parametrize("draft_kv_heads", [2, 1])  # split over the 2 ranks, or one head both ranks replicate
def test_vocab_parallel_prefill_and_draft_equal_unsharded(tiny_cfg, draft_kv_heads):
    """tp 2: each rank holds vocab / 2 rows of the embedding and the LM head; its eager prefill gives the
    unsharded prefill's full logits and its KV slice, and the EAGLE3 draft, sharded like the target (its heads,
    its KV heads, vocab / 2 rows of its LM head; the embedding shared and looked up the same way), proposes the
    unsharded draft's tokens and writes its heads' slice of the unsharded draft's KV."""
    from neffbuild.models.eagle3 import weights as dw
    from neffbuild.models.eagle3.config import Eagle3Config
    from neffbuild.models.eagle3.draft import Eagle3Draft
    from neffbuild.models.gpt_oss.prefill import prefill

    layout = ParallelLayout(tp=2, ep=2)
    cfg = tiny_cfg
    stacked = W.stack(cfg, W.random_state_dict(cfg, 4))
    dcfg = Eagle3Config.from_hf_dict({"num_key_value_heads": draft_kv_heads}, cfg)
    dweights = dw.draft_weights(dcfg, None, 5)
    g = torch.Generator().manual_seed(6)
    V, q = cfg.vocab_size, 4
    prompt = torch.cat([torch.tensor([0, V // 2 - 1, V // 2, V - 1]), torch.randint(0, V, (20,), generator=g)])
    pos = torch.tensor([[5], [40]]) + torch.arange(q)
    table = torch.stack([torch.arange(1, 9), torch.arange(9, 17)])
    slots = (table.gather(1, pos // BS) * BS + pos % BS).reshape(-1)
    ids = torch.tensor([[0, V // 2 - 1, V // 2, V - 1], [V - 1, 1, V // 2 + 1, 7]])  # both halves' edges
    draft_ins = (ids, pos, torch.randn(2, q, 3 * cfg.hidden_size, generator=g), torch.tensor([4, 2]), table, slots)
    results = run_ranks(_rank_prefill_and_draft, layout.world_size, cfg, stacked, dweights, layout, prompt, draft_ins,
                        draft_kv_heads)

    kv = [torch.zeros(2, NB, cfg.num_key_value_heads, BS, cfg.head_dim) for _ in range(cfg.num_kv_buffers)]
    row = torch.arange(1, 9)
    want = prefill(cfg, stacked, prompt, kv, row, row)
    draft = Eagle3Draft(dcfg, dict(dweights, embed=stacked["embed"]), num_speculative_tokens=3).eval()
    want_cache = torch.zeros(2, NB, dcfg.num_key_value_heads, BS, dcfg.head_dim)
    with torch.no_grad():
        want_tokens = draft(*draft_ins, want_cache)
    H, d, Hq = cfg.hidden_size, dcfg.head_dim, dcfg.num_attention_heads
    want_shapes = {"draft_qkv_w": ((Hq // 2 + 2 * max(1, draft_kv_heads // 2)) * d, 2 * H),
                   "draft_o_w": (H, Hq // 2 * d), "draft_lm_head": (V // 2, H), "draft_fc": (H, 3 * H)}
    for rank, (logits, got_kv, heads, embed_shape, tokens, cache, dheads, shapes) in enumerate(results):
        assert dheads == ([rank] if draft_kv_heads == 2 else [0])
        assert {n: shapes[n] for n in want_shapes} == {n: (s, torch.float32) for n, s in want_shapes.items()}
        assert shapes["draft_d2t"] == ((V,), torch.int64)
        assert embed_shape == (V // 2, cfg.hidden_size)
        assert logits.shape == want.shape == (len(prompt), V)
        torch.testing.assert_close(logits, want, atol=1e-5, rtol=0)
        for got, ref in zip(got_kv, kv, strict=True):
            torch.testing.assert_close(got, ref[:, :, heads], atol=1e-5, rtol=0)
        assert torch.equal(tokens, want_tokens)
        torch.testing.assert_close(cache, want_cache[:, :, dheads], atol=1e-5, rtol=0)
