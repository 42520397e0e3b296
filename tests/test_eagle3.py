"""EAGLE3 draft head (eager): config, checkpoint layout, KV in place, proposals vs a dense oracle."""

from __future__ import annotations

import pytest
import torch

from neffbuild.errors import InvalidInput
from neffbuild.kernels import rope_cos_sin, sdpa_with_sinks
from neffbuild.models.eagle3 import weights as dw
from neffbuild.models.eagle3.config import Eagle3Config
from neffbuild.models.eagle3.draft import Eagle3Draft, draft_layer, no_sinks, prefill, propose
from neffbuild.models.gpt_oss.weights import random_state_dict, stack

K = 3
BS, NB = 16, 64


@pytest.fixture(scope="module")
def dcfg(tiny_cfg):
    return Eagle3Config.from_hf_dict({}, tiny_cfg)


@pytest.fixture(scope="module")
def draft(tiny_cfg, dcfg):
    w = dw.draft_weights(dcfg, None, 3)
    w["embed"] = stack(tiny_cfg, random_state_dict(tiny_cfg, 0))["embed"]
    return Eagle3Draft(dcfg, w, num_speculative_tokens=K).eval()


def new_cache(dcfg):
    return torch.zeros(2, NB, dcfg.num_key_value_heads, BS, dcfg.head_dim)


def dense_proposals(d: Eagle3Draft, tokens, aux, k):
    """Oracle: recompute every row densely (no KV cache) and feed proposals back one at a time."""
    cfg, w = d.cfg, d.weights()
    emb, state = w["embed"][tokens], aux @ w["draft_fc"].t()  # [n, H]
    out = []
    for _ in range(k):
        n = emb.shape[0]
        cos, sin = rope_cos_sin(torch.arange(n)[None], d.draft_inv_freq, d.rope_scale)
        h = draft_layer(cfg, w, emb[None], state[None], cos, sin,
                        lambda q, kk, v: sdpa_with_sinks(q, kk, v, no_sinks(cfg, q), cfg.attention_scale, None))[0]
        tok = propose(cfg, w, h[-1])
        out.append(int(tok))
        emb, state = torch.cat([emb, w["embed"][tok][None]]), torch.cat([state, h[-1:]])
    return out


def test_derived_config_matches_target(tiny_cfg, dcfg):
    assert (dcfg.hidden_size, dcfg.num_attention_heads, dcfg.num_key_value_heads) == (
        tiny_cfg.hidden_size, tiny_cfg.num_attention_heads, tiny_cfg.num_key_value_heads)
    assert dcfg.draft_vocab_size == tiny_cfg.vocab_size and len(dcfg.aux_layers) == 3
    assert Eagle3Config.from_hf_dict(dcfg.to_hf_dict(), tiny_cfg) == dcfg


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": 32}, "hidden_size"),
    ({"draft_vocab_size": 0}, "draft_vocab_size"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 9]}}, "eagle_aux_hidden_state_layer_ids"),
])
def test_config_errors_name_the_key(tiny_cfg, change, message):
    with pytest.raises(InvalidInput, match=message):
        Eagle3Config.from_hf_dict(change, tiny_cfg)


def test_checkpoint_roundtrip_in_common_layout(tmp_path, tiny_cfg):
    cfg = Eagle3Config.from_hf_dict({"draft_vocab_size": 100}, tiny_cfg)
    sd = dw.random_state_dict(cfg, 7)
    assert {"fc.weight", "midlayer.hidden_norm.weight", "midlayer.self_attn.q_proj.weight", "norm.weight",
            "lm_head.weight", "d2t", "t2d"} <= set(sd)
    folder = dw.save_checkpoint(sd, tmp_path / "draft", cfg)
    loaded = dw.draft_weights(cfg, folder, None)
    expected = dw.draft_weights(cfg, None, 7)
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[n], expected[n]) for n in loaded)
    ids = torch.arange(100) + loaded["draft_d2t"]
    assert bool(sd["t2d"][ids].all()) and int(sd["t2d"].sum()) == 100


def test_checkpoint_errors_name_the_tensor(tmp_path, tiny_cfg, dcfg):
    sd = dw.random_state_dict(dcfg, 1)
    del sd["midlayer.hidden_norm.weight"]
    with pytest.raises(InvalidInput, match=r"midlayer\.hidden_norm\.weight"):
        dw.draft_weights(dcfg, dw.save_checkpoint(sd, tmp_path / "a", dcfg), None)
    sd = dw.random_state_dict(dcfg, 1)
    sd["d2t"] = sd["d2t"] + 10_000
    with pytest.raises(InvalidInput, match="d2t"):
        dw.draft_weights(dcfg, dw.save_checkpoint(sd, tmp_path / "b", dcfg), None)


def test_draft_step_shapes_kv_in_place_and_deterministic(draft, dcfg, tiny_cfg):
    B, q, H = 2, 1 + K, tiny_cfg.hidden_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, tiny_cfg.vocab_size, (B, q), generator=g)
    pos = torch.tensor([[5], [20]]) + torch.arange(q)
    hidden = torch.randn(B, q, 3 * H, generator=g)
    num_valid = torch.tensor([2, 4])
    table = torch.tensor([[1, 2], [3, 4]])
    slots = torch.where(torch.arange(q) < num_valid[:, None], table.gather(1, pos // BS) * BS + pos % BS, -1)
    outs, caches = [], []
    for _ in range(2):
        cache = new_cache(dcfg)
        with torch.no_grad():
            outs.append(draft(ids, pos, hidden, num_valid, table, slots.reshape(-1), cache))
        caches.append(cache)
    assert outs[0].shape == (B, K) and outs[0].dtype == torch.long
    assert torch.equal(outs[0], outs[1]) and torch.equal(caches[0], caches[1])
    written = (caches[0][0].abs().sum((1, 3)) != 0).nonzero().tolist()  # [block, offset]
    expect = sorted({(int(table[b, p // BS]), p % BS) for b, start, n in ((0, 5, 2 + K - 1), (1, 20, 4 + K - 1))
                     for p in range(start, start + n)})
    assert sorted(map(tuple, written)) == expect


def test_proposals_match_dense_oracle(draft, dcfg, tiny_cfg):
    """Prefill 9 rows, then one graph call verifies 1..1+k rows and proposes k tokens."""
    g = torch.Generator().manual_seed(1)
    H = tiny_cfg.hidden_size
    for n_valid in (1, 2, 1 + K):
        n0 = 9
        toks = torch.randint(0, tiny_cfg.vocab_size, (n0 + 1 + K,), generator=g)
        aux = torch.randn(n0 + 1 + K, 3 * H, generator=g)
        cache, row = new_cache(dcfg), torch.tensor([7, 3, 9])
        prefill(draft, toks[:n0], aux[:n0], cache, row)
        pos = (n0 + torch.arange(1 + K))[None]
        slots = torch.where(torch.arange(1 + K) < n_valid, row[pos // BS] * BS + pos % BS, -1)
        with torch.no_grad():
            got = draft(toks[None, n0:], pos, aux[None, n0:], torch.tensor([n_valid]), row[None], slots.reshape(-1),
                        cache)
        n = n0 + n_valid
        assert got[0].tolist() == dense_proposals(draft, toks[:n], aux[:n], K), n_valid


# ----------------------------------------------------------------------------- sharded over TP, in the weights' dtype

@pytest.mark.parametrize("hf, own_embed", [({}, False), ({"num_key_value_heads": 1}, True)])  # split / replicated
def test_draft_pieces_split_like_the_target_and_join_back(tiny_cfg, hf, own_embed):
    """bf16 draft at tp 2: each piece holds the tensors of the rule (split ones in tp{r}, the rest shared), a rank's
    shard has the shapes and dtypes plan and the tracer use (rank_specs), and the pieces join back to the draft."""
    from neffbuild.models.eagle3 import sharding
    from neffbuild.models.eagle3.shapes import TP_SPLIT, rank_specs
    from neffbuild.runtime.parallel import ParallelLayout

    dcfg = Eagle3Config.from_hf_dict(hf, tiny_cfg)
    sd = dw.random_state_dict(dcfg, 2)
    if own_embed:
        sd[dw.EMBED] = torch.randn(dcfg.vocab_size, dcfg.hidden_size)
    whole = dw.to_bundle(dcfg, sd, dtype="bfloat16")
    assert {str(t.dtype) for n, t in whole.items() if n != "draft_d2t"} == {"torch.bfloat16"}
    par = ParallelLayout(tp=2, dp=2, ep=4)
    parts = {n: sharding.piece(dcfg, whole, par, n) for n in ("shared", "tp0", "tp1", "ep3")}
    assert set(parts["tp0"]) == set(TP_SPLIT) - ({"draft_embed"} if not own_embed else set())
    assert not set(parts["shared"]) & set(TP_SPLIT) and parts["ep3"] == {}
    for rank in range(par.world_size):
        mine = sharding.shard(dcfg, whole, par, rank)
        assert {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in mine.items()} == rank_specs(
            dcfg, par, "bfloat16", own_embed)
    heads = [list(sharding.kv_heads_of(dcfg, par, r)) for r in range(2)]
    assert heads == ([[0], [1]] if not hf else [[0], [0]])
    back = sharding.unshard(dcfg, parts, par)
    assert set(back) == set(whole) and all(torch.equal(back[n], whole[n]) for n in whole)
    assert set(sharding.shard_layout(par, tuple(whole))) == set(parts["tp0"])


def test_sharded_bf16_draft_graph_traces_with_its_collectives():
    """The draft graph of a bf16 tp 2 recipe: its constants are the rank's draft shard in bf16 (d2t int64), its KV
    input holds the rank's one draft KV head, and each of its k layer passes all-reduces the embedding lookup and
    the o-proj and all-gathers each rank's best (value, id) once."""
    import yaml

    from neffbuild import grid
    from neffbuild import recipe as R
    from neffbuild.compiler.backends import get_backend
    from neffbuild.compiler.graphs import build_graph, target_graph
    from neffbuild.compiler.worker import key_for
    from tests.helpers import EAGLE3_TINY

    raw = yaml.safe_load(EAGLE3_TINY.read_text())
    raw["model"]["weights_dtype"] = "bfloat16"
    raw["parallel"] = {"tp": 2, "dp": 1, "ep": 2}
    r = R.from_dict(raw)
    target = next(t for t in grid.targets(r) if t.family == grid.DRAFT)
    graph = target_graph(r, target)
    module, _ = build_graph(graph)
    dtypes = {n: str(t.dtype).removeprefix("torch.") for n, t in module.named_buffers() if n != "draft_inv_freq"}
    assert dtypes == dict.fromkeys(set(dtypes) - {"draft_d2t"}, "bfloat16") | {"draft_d2t": "int64"}
    H, d, V = r.model.config.hidden_size, r.model.config.head_dim, r.model.config.vocab_size
    assert tuple(module.draft_lm_head.shape) == (V // 2, H) and tuple(module.draft_o_w.shape) == (H, 2 * d)
    _, _, sig, text = key_for(graph, get_backend("inductor"))
    assert [s["shape"] for s in sig if s["name"] == "kv_cache"] == [[2, r.num_blocks, 1, r.block_size, d]]
    k = r.num_speculative_tokens
    assert text.count("_c10d_functional.all_reduce.default(") == 2 * k
    assert text.count("_c10d_functional.all_gather_into_tensor.default(") == k
