"""EAGLE3 speculative decoding: family rules, and greedy speculation is lossless (eager and compiled)."""

from __future__ import annotations

import json

import pytest
import torch

from neffbuild.models.eagle3 import weights as dw
from neffbuild.models.eagle3.config import Eagle3Config
from neffbuild.models.eagle3.draft import Eagle3Draft
from neffbuild.models.gpt_oss.decode import GptOssDecode
from neffbuild.models.gpt_oss.weights import random_state_dict, stack
from neffbuild.runtime.kv.cache import KVLayout
from neffbuild.runtime.step.dispatch import TARGET_NOSPEC, TARGET_SPEC, Grid, needs_nospec, plan_draft, plan_synced
from neffbuild.serve.eager import EagerArtifacts
from neffbuild.serve.rank import serving_rank
from neffbuild.serve.spec import EagerSpecArtifacts
from tests import engine_runs
from tests.helpers import cli

K = 3
GRID = Grid((1, 2, 4), (128,), 256, K)


@pytest.mark.parametrize("computed, drafts, veto", [
    ([10, 20], True, False),
    ([10, 20], False, True),  # no request with drafts
    ([10, 256 - K - 1], True, False),  # max_position + k + 1 == max_model_len: room
    ([10, 256 - K], True, True),  # no room for drafts
])
def test_family_veto(computed, drafts, veto):
    assert needs_nospec(GRID, max(computed) + 1, any_drafts=drafts) is veto


def test_spec_plan_includes_drafts_and_shares_the_draft_bucket():
    p = plan_synced(GRID, batch_count=2, needed_base=125, nospec=False, num_reqs=2)
    assert (p.family, p.query_len, p.needed_seq, p.ctx, p.label) == (TARGET_SPEC, 4, 128, 128, "decode_b2_s4_ctx128")
    p = plan_synced(GRID, batch_count=2, needed_base=126, nospec=False, num_reqs=2)
    assert (p.needed_seq, p.ctx) == (129, 256)  # the drafts push it over the bucket boundary
    p = plan_synced(GRID, batch_count=1, needed_base=126, nospec=True, num_reqs=1)
    assert (p.family, p.query_len, p.ctx, p.label) == (TARGET_NOSPEC, 1, 128, "decode_b1_s1_ctx128")
    d = plan_draft(GRID, num_reqs=2, max_computed=124)
    assert (d.label, d.query_len, d.ctx) == ("draft_b2_ctx128", 4, 128)  # the next with-spec step's bucket


@pytest.fixture(scope="module")
def models(tiny_cfg):
    stacked = stack(tiny_cfg, random_state_dict(tiny_cfg, 0))
    dcfg = Eagle3Config.from_hf_dict({}, tiny_cfg)
    weights = dict(stacked, **dw.draft_weights(dcfg, None, 1))
    target = GptOssDecode(tiny_cfg, stacked, aux_layers=dcfg.aux_layers).eval()
    draft = Eagle3Draft(dcfg, weights, num_speculative_tokens=K).eval()
    return dcfg, weights, target, draft


def _layout(cfg):
    return KVLayout(cfg.num_kv_buffers, 128, cfg.num_key_value_heads, 16, cfg.head_dim,
                    draft_kv_heads=cfg.num_key_value_heads, draft_head_dim=cfg.head_dim)


CASES = {  # prompts, new tokens, the context buckets the steps must use
    "bucket_boundary": ([[(i * 37) % 256 for i in range(110)], [(i * 11) % 256 for i in range(40)], [5, 6, 7]], 40,
                        {128, 256}),
    "max_model_len": ([[(i * 13) % 256 for i in range(226)], [4, 5, 6, 7, 8, 9, 10]], 256 - 226, {256}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_eager_spec_equals_plain_greedy(tiny_cfg, models, case):
    """Random draft: the same tokens as plain greedy; at max_model_len the last steps go without spec."""
    prompts, n_new, ctxs = CASES[case]
    dcfg, weights, target, draft = models
    layout = _layout(tiny_cfg)
    s = serving_rank(tiny_cfg, weights, EagerArtifacts(GRID, layout, 8, GptOssDecode(tiny_cfg, weights).eval()))
    plain = engine_runs.greedy(s, prompts, n_new).tokens
    s = serving_rank(tiny_cfg, weights, EagerSpecArtifacts(GRID, layout, 8, target, draft))
    run = engine_runs.spec(s, dcfg, weights, prompts, n_new)
    tokens, stats = run.tokens, run.stats
    assert tokens == plain
    fams = [s["family"] for s in stats.steps]
    assert TARGET_SPEC in fams and {s["ctx"] for s in stats.steps} == ctxs
    if case == "max_model_len":  # the long request runs out of room while the short one still has drafts
        assert fams[-1] == TARGET_NOSPEC
        assert any(s["family"] == TARGET_NOSPEC and s["num_reqs"] == 2 for s in stats.steps)


# ----------------------------------------------------------------------------- compiled bundle (session fixture)

_cli = cli  # in-process (tests/helpers.py); --dp starts the ranks' processes itself


def _prompt_args(prompts):
    return [a for p in prompts for a in ("--prompt-ids", ",".join(map(str, p)))]


@pytest.mark.slow
def test_eagle3_bundle_has_three_families_and_verifies(eagle3_built):
    bundle = eagle3_built.bundle
    res = _cli("inspect", str(bundle), "--json")
    assert res.returncode == 0, res.stderr
    m = json.loads(res.stdout)
    fams = sorted((a["family"], a["batch"], a["ctx"], a["query_len"]) for a in m["artifacts"])
    assert fams == sorted((f, b, c, q) for b in (2,) for c in (128, 256)
                          for f, q in (("target_spec", 4), ("target_nospec", 1), ("draft", 4)))
    assert m["graph_inputs"]["kv_layout"]["draft"]["buffer_shape"] == [2, 128, 2, 32, 64]  # K/V, blocks, heads, ...
    assert "draft_fc" in m["weights"]["tensors"] and "draft_d2t" in m["weights"]["tensors"]
    assert "draft" in _cli("inspect", str(bundle)).stdout
    res = _cli("verify", str(bundle))
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.slow
def test_vllm_config_of_an_eagle3_bundle_names_the_draft_model(eagle3_built):
    """The speculative config vLLM Neuron gets always carries `model`: the draft checkpoint's folder, or, for a
    random draft (the shipped tiny recipe's), None with a warning saying so instead of leaving the key out. (This
    CPU bundle's own `inspect --vllm-config` prints the plugin's command line instead: tests/test_vllm_config.py.)"""
    import yaml

    from neffbuild.bundle import handoff

    bundle = eagle3_built.bundle
    manifest = json.loads((bundle / "manifest.json").read_text())
    recipe = yaml.safe_load((bundle / "recipe.yaml").read_text())
    doc = handoff.vllm_config(manifest, recipe)
    draft = recipe["speculative"]["draft"]["checkpoint"]
    assert doc["speculative_config"] == {"method": "eagle3", "model": draft, "num_speculative_tokens": K}
    assert doc["additional_config"]["neuron_config"]["num_seqs_buckets"] == [2]
    assert not any("speculative_config.model" in w for w in doc["warnings"])
    recipe["speculative"]["draft"] = {"random_seed": 1}
    doc = handoff.vllm_config(manifest, recipe)
    assert doc["speculative_config"] == {"method": "eagle3", "model": None, "num_speculative_tokens": K}
    flags = handoff.vllm_flags(doc)
    assert '--speculative-config \'{"method": "eagle3", "model": null, "num_speculative_tokens": 3}\'' in flags
    assert any("speculative_config.model" in w and "speculative.draft.checkpoint" in w for w in doc["warnings"])
    res = _cli("inspect", bundle, "--vllm-config")
    assert res.returncode == 0 and "vllm serve" in res.stdout, res.stderr


@pytest.mark.slow
def test_generate_spec_equals_plain_up_to_max_model_len(eagle3_built):
    """Random draft: --spec gives plain greedy's tokens across 128 -> 256 and up to max_model_len;
    the last steps switch to without-spec, first as a mixed batch (one request still has room)."""
    prompts = [[(i * 37) % 256 for i in range(100)], [(i * 11) % 256 for i in range(20)]]
    n_new = 256 - 100
    args = [str(eagle3_built.bundle), *_prompt_args(prompts), "--max-new-tokens", str(n_new), "--json"]
    plain, spec = _cli("generate", *args), _cli("generate", *args, "--spec")
    assert plain.returncode == 0 and spec.returncode == 0, plain.stderr + spec.stderr
    plain, spec = json.loads(plain.stdout), json.loads(spec.stdout)
    assert spec["tokens"] == plain["tokens"]
    assert 0.0 <= spec["acceptance_rate"] < 1.0
    steps = spec["steps"]
    assert all(s["family"] in (TARGET_SPEC, TARGET_NOSPEC) for s in steps)
    assert {s["label"] for s in steps if s["family"] == TARGET_SPEC} >= {"decode_b2_s4_ctx128", "decode_b2_s4_ctx256"}
    assert steps[-1]["family"] == TARGET_NOSPEC and steps[-1]["needed_seq"] > 256 - K
    assert [s["family"] for s in plain["steps"]] == [TARGET_NOSPEC] * (n_new - 1)


@pytest.mark.slow
def test_generate_spec_mixed_batch_near_the_end(eagle3_built):
    """One request reaches max_model_len while the other still has room: the batch runs without spec."""
    prompts = [[(i * 3) % 256 for i in range(240)], list(range(20))]
    args = [str(eagle3_built.bundle), *_prompt_args(prompts), "--max-new-tokens", "16", "--json", "--spec",
            "--check"]
    res = _cli("generate", *args)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["check"]["ok"]
    fams = [(s["family"], s["num_reqs"]) for s in out["steps"]]
    assert (TARGET_SPEC, 2) in fams and (TARGET_NOSPEC, 2) in fams


def _oracle(reference: dict[int, list[int]], k: int):
    """A draft that always proposes the target's own greedy continuation."""
    def propose(plan, reqs):
        out = torch.zeros(plan.batch, k, dtype=torch.long)
        for i, r in enumerate(reqs):
            n = len(r.tokens)
            out[i] = torch.tensor(reference[r.index][n: n + k])
        return out

    return propose


@pytest.mark.slow
@pytest.mark.parametrize("n_new", [41, 43])
def test_agreeing_draft_accepts_everything(eagle3_built, n_new):
    """Acceptance 1.0, and ceil((n_new - 1) / (k + 1)) target steps: every step emits k+1 tokens."""
    from neffbuild.runtime.bundle.reader import open_bundle
    from neffbuild.serve.rank import open_rank

    bundle = open_bundle(eagle3_built.bundle)
    s = open_rank(bundle)
    dcfg = Eagle3Config.from_hf_dict(bundle.manifest["graph_inputs"]["draft_config"], s.config)
    prompts = [list(range(3, 13)), [9, 8, 7, 6, 5]]
    reference = engine_runs.greedy(s, prompts, n_new + K + 1).tokens
    s = open_rank(bundle)  # fresh KV
    oracle = _oracle(dict(enumerate(reference)), K)
    run = engine_runs.spec(s, dcfg, bundle.weights, prompts, n_new, draft_fn=oracle)
    tokens, stats = run.tokens, run.stats
    assert tokens == [r[:n_new] for r in reference]
    assert stats.acceptance_rate == 1.0
    assert len(stats.steps) == -(-(n_new - 1) // (K + 1))
    assert all(s["family"] == TARGET_SPEC and s["accepted"] == 2 * K for s in stats.steps)


@pytest.mark.slow
def test_spec_dp2_ranks_run_the_same_family_every_step(eagle3_built):
    """Ranks with different lengths: every step is labelled, all ranks agree, tokens equal plain (--dp 2)."""
    prompts = [[(i * 7) % 256 for i in range(236)], [1, 2, 3], [(i * 5) % 256 for i in range(60)]]
    n_new = 256 - 236
    args = [str(eagle3_built.bundle), *_prompt_args(prompts), "--max-new-tokens", str(n_new), "--json"]
    dp, plain = _cli("generate", *args, "--spec", "--dp", "2"), _cli("generate", *args, "--dp", "2")
    assert dp.returncode == 0 and plain.returncode == 0, dp.stderr + plain.stderr
    dp, plain = json.loads(dp.stdout), json.loads(plain.stdout)
    assert dp["tokens"] == plain["tokens"]
    r0, r1 = (r["steps"] for r in dp["ranks"])
    assert len(r0) == len(r1) > 0
    assert [(s["family"], s["label"]) for s in r0] == [(s["family"], s["label"]) for s in r1]
    fams = {s["family"] for s in r0}
    assert fams == {TARGET_SPEC, TARGET_NOSPEC}
    assert all(r["collectives"] >= len(r0) for r in dp["ranks"])
    assert "acceptance_rate" in dp


@pytest.mark.slow
def test_compiled_draft_matches_eager(eagle3_built):
    """The draft artifact proposes the eager graph's tokens and writes the same draft KV in place."""
    from neffbuild.models.gpt_oss.config import GptOssConfig
    from neffbuild.runtime.bundle.reader import open_bundle
    from neffbuild.runtime.kv.cache import allocate_draft
    from neffbuild.runtime.step.draft_inputs import build_draft

    bundle = open_bundle(eagle3_built.bundle)
    gi = bundle.manifest["graph_inputs"]
    cfg = GptOssConfig.from_hf_dict(gi["model_config"])
    dcfg = Eagle3Config.from_hf_dict(gi["draft_config"], cfg)
    g = torch.Generator().manual_seed(0)
    rows = [([7, 8], torch.randn(2, 3 * cfg.hidden_size, generator=g), 40),
            ([1, 2, 3, 4], torch.randn(4, 3 * cfg.hidden_size, generator=g), 100)]
    table = torch.tensor([[1, 2, 3, 4, 5, 0, 0, 0, 0, 0], [6, 7, 8, 9, 10, 11, 12, 13, 0, 0]])
    inputs = build_draft(rows, table, batch=2, ctx=128, query_len=1 + K, block_size=bundle.kv_layout.block_size,
                         hidden_size=3 * cfg.hidden_size)
    caches = [allocate_draft(bundle.kv_layout) for _ in range(2)]
    for c in caches:
        c.copy_(torch.randn(c.shape, generator=torch.Generator().manual_seed(1)))
    eager = Eagle3Draft(dcfg, bundle.weights, num_speculative_tokens=K).eval()
    with torch.no_grad():
        want = eager(*inputs.as_args(caches[0]))
    got = bundle.artifact("draft_b2_ctx128")(*inputs.as_args(caches[1]))
    assert got.tolist() == want.tolist()
    # float32 sums of 2 x 256 terms in another order (the compiled kernels' reduction, eager's matmul): seen 3e-5
    torch.testing.assert_close(caches[1], caches[0], atol=1e-4, rtol=1e-4)


def _draft_inputs(hidden: int, ctx: int):
    """Two requests' verified rows (2 and 4 of them) over 16-block tables: the draft call's inputs."""
    from neffbuild.runtime.step.draft_inputs import build_draft

    g = torch.Generator().manual_seed(0)
    rows = [([7, 8], torch.randn(2, 3 * hidden, generator=g), 40),
            ([1, 2, 3, 4], torch.randn(4, 3 * hidden, generator=g), 100)]
    table = torch.stack([torch.arange(1, 17), torch.arange(17, 33)])
    return build_draft(rows, table, batch=2, ctx=ctx, query_len=1 + K, block_size=16, hidden_size=3 * hidden)


def _random_draft_kv(shape, dtype) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 0.5).to(dtype)


def _rank_draft_call(rank, world, bundle_path, full_shape):
    """One rank of the sharded bundle: its draft artifact on the common inputs, its slice of a common KV buffer."""
    from neffbuild.runtime.bundle.reader import open_bundle

    bundle = open_bundle(bundle_path)
    heads = bundle.facts.draft_kv_heads
    cache = _random_draft_kv(full_shape, bundle.kv_layout.dtype)[:, :, heads.start:heads.stop].contiguous()
    label = next(a for a in bundle.labels if a.startswith("draft_"))
    inputs = _draft_inputs(bundle.facts.hidden_size, bundle.entries[label]["ctx"])
    tokens = bundle.artifact(label)(*inputs.as_args(cache))
    drafts = {n: (tuple(t.shape), str(t.dtype)) for n, t in bundle.weights.items() if n.startswith("draft_")}
    return tokens, cache.float(), list(heads), drafts


@pytest.mark.slow
def test_sharded_draft_artifact_proposes_the_unsharded_drafts(production_built):
    """tp 2 x dp 2 (the production case, tiny): every rank holds its TP slice of the draft (its heads, its KV head,
    half its LM head's vocabulary) and its draft artifact proposes the unsharded eager draft's tokens, writing its
    KV head's slice of the unsharded draft's KV (packed FP8: within one FP8 step)."""
    from neffbuild import registry
    from neffbuild.runtime.bundle import reader
    from neffbuild.runtime.parallel import ParallelLayout
    from tests.dist_util import run_ranks

    facts = reader.read_facts(production_built)
    cfg, dcfg, par = facts.config, facts.draft_config, facts.parallel
    assert (par.tp, par.dp) == (2, 2) and facts.kv_dtype == "float8_e4m3fn"
    layout = facts.graph_inputs.kv_layout
    full_shape = (2, layout.num_blocks, dcfg.num_key_value_heads, layout.block_size, dcfg.head_dim)
    assert layout.draft_buffer_shape == (*full_shape[:2], 1, *full_shape[3:])  # one of the draft's 2 KV heads
    results = run_ranks(_rank_draft_call, par.world_size, production_built, full_shape)

    weights, pieces = reader.weight_pieces(production_built)
    parts = dict(pieces, shared=weights)
    joined = dict(registry.arch(facts.arch).get("unshard")(cfg, parts, par),
                  **registry.speculative(facts.speculative_method).get("unshard")(dcfg, parts, par))
    eager = Eagle3Draft(dcfg, joined, num_speculative_tokens=K, packed_k=True, parallel=ParallelLayout()).eval()
    want_cache = _random_draft_kv(full_shape, layout.dtype)
    ctx = next(a["ctx"] for a in reader.read_manifest(production_built)["artifacts"] if a["family"] == "draft")
    with torch.no_grad():
        want = eager(*_draft_inputs(cfg.hidden_size, ctx).as_args(want_cache))
    H, d, V = cfg.hidden_size, dcfg.head_dim, dcfg.draft_vocab_size
    for rank, (tokens, cache, heads, drafts) in enumerate(results):
        assert heads == [par.tp_rank(rank)]
        assert drafts["draft_lm_head"] == ((V // 2, H), "torch.float32") and drafts["draft_o_w"][0] == (H, 2 * d)
        assert drafts["draft_qkv_w"][0] == ((2 + 2) * d, 2 * H)  # 2 query heads + its KV head's K and V
        assert tokens.tolist() == want.tolist()
        torch.testing.assert_close(cache, want_cache[:, :, heads].float(), atol=1e-2, rtol=0.13)
