"""The GPT-OSS GK decode graph against Hugging Face transformers, and its invariances."""

import pytest
import torch

from neffbuild.models.gpt_oss import weights as W
from neffbuild.models.gpt_oss.decode import GptOssDecode
from neffbuild.runtime import StepBatch
from neffbuild.runtime.kv.cache import KVLayout
from neffbuild.runtime.step import attn_metadata
from neffbuild.runtime.step.dispatch import Grid
from neffbuild.serve.parts import block_rows
from neffbuild.serve.rank import eager_artifacts, serving_rank
from tests import engine_runs

PROMPTS = [list(range(3, 3 + 45)), [7, 1, 9, 200, 13], [(i * 37) % 256 for i in range(70)]]


def eager_rank(recipe, stacked, *, fp8=False, packed=False):
    """The eager graph behind the step API, with the recipe's pool and buckets."""
    cfg = recipe.model.config
    layout = KVLayout(cfg.num_kv_buffers, recipe.num_blocks, cfg.num_key_value_heads, recipe.block_size,
                      cfg.head_dim, fp8=fp8, packed_k=packed)
    spec = Grid(recipe.num_seqs_buckets, recipe.decode_context_length_buckets, recipe.max_model_len)
    return serving_rank(cfg, stacked, eager_artifacts(cfg, stacked, spec, layout, recipe.num_swa))


def greedy(session, prompts, n, **kw):
    return engine_runs.greedy(session, prompts, n, **kw).tokens


@pytest.fixture(scope="module")
def stacked(tiny_cfg, hf_checkpoint):
    return W.stack(tiny_cfg, W.load_checkpoint(hf_checkpoint))


def hf_greedy(folder, prompt, n):
    import transformers

    model = transformers.GptOssForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), torch.stack([lg[0] for lg in out.logits])


def test_oracle_matches_transformers(tiny_recipe, tiny_cfg, stacked, hf_checkpoint):
    """Prefill + 32 greedy steps, batched with different lengths, equal HF token for token."""
    assert max(map(len, PROMPTS)) > tiny_cfg.sliding_window
    session = eager_rank(tiny_recipe, stacked)
    step_logits = []
    ours = greedy(session, PROMPTS, 33, on_step=lambda plan, lg: step_logits.append(lg.clone()))
    for n, prompt in enumerate(PROMPTS):
        ref_tokens, ref_logits = hf_greedy(hf_checkpoint, prompt, 33)
        assert ours[n] == ref_tokens, f"prompt {n}"
        assert len(set(ref_tokens)) > 3, "degenerate oracle: random weights too small"
        mine = torch.stack([lg[n] for lg in step_logits])  # decode steps 1..32
        torch.testing.assert_close(mine, ref_logits[1:], atol=1e-4, rtol=0)


def test_prefill_returns_the_logits_asked_for(tiny_recipe, stacked):
    """``logits="last"`` (the engine's) is the last row of ``"all"`` (to float rounding: one row's product sums in
    another order than the whole prompt's matmul) with the same argmax; ``"none"`` (a KV producer) fills the same
    cache and returns nothing; another value is refused before anything runs."""
    prompt = PROMPTS[2]
    got = {}
    for mode in ("all", "last", "none"):
        session = eager_rank(tiny_recipe, stacked)
        blocks, N = session.block_manager(), len(prompt)
        blocks.reserve(0, N, N)
        rows = {g: t[0] for g, t in block_rows(blocks, [0], [N]).items()}
        got[mode] = session.prefill(prompt, session.stepper.kv_caches, rows, logits=mode), session.stepper.kv_caches
    assert got["all"][0].shape == (len(prompt), stacked["lm_head"].shape[0])
    torch.testing.assert_close(got["last"][0], got["all"][0][-1:], atol=1e-5, rtol=1e-5)
    assert int(got["last"][0].argmax()) == int(got["all"][0][-1].argmax())
    assert got["none"][0] is None
    for mode in ("last", "none"):
        assert all(torch.equal(a, b) for a, b in zip(got[mode][1], got["all"][1], strict=True))
    with pytest.raises(ValueError, match="logits='first'"):
        session.prefill(prompt, session.stepper.kv_caches, rows, logits="first")


@pytest.mark.parametrize("fp8", [False, True], ids=["float32-kv", "packed-fp8-kv"])
def test_a_prompt_in_chunks_equals_the_whole_prompt(tiny_recipe, stacked, fp8):
    """A host engine's chunked prefill (``start`` > 0: each chunk attends over the KV the earlier chunks left in
    the cache, sliding window included): the last logits and every decode step after it equal the whole
    prompt's, and the KV the chunks wrote equals the whole prompt's (float32: to summation order)."""
    prompt = PROMPTS[2] + PROMPTS[0]  # 115 tokens: past the sliding window (the tiny model's) and 7 blocks
    results = []
    for cuts in ((len(prompt),), (50, 97, len(prompt)), (1, 2, 70, len(prompt))):
        session, N = eager_rank(tiny_recipe, stacked, fp8=fp8, packed=fp8), len(prompt)
        # every block live in both groups (an engine that chunks keeps a sliding block until its window passed)
        rows = {"full": torch.arange(1, 9), "sliding": torch.arange(9, 17)}
        caches, begin = session.stepper.kv_caches, 0
        for end in cuts:
            last = session.prefill(prompt[begin:end], caches, rows, start=begin, logits="last")
            begin = end
        toks = [int(last.argmax())]
        for _ in range(8):  # decode steps over the chunks' KV
            full = {g: r[None] for g, r in rows.items()}
            out = session.stepper.step(StepBatch([[toks[-1]]], [N + len(toks) - 1], full))
            toks.append(int(out.logits[0, 0].argmax()))
        results.append((last, toks, [c.clone() for c in caches]))
    (whole, whole_toks, whole_kv), *chunked = results
    for last, toks, kv in chunked:
        torch.testing.assert_close(last, whole, atol=1e-3 if fp8 else 1e-4, rtol=0)
        assert toks == whole_toks
        if not fp8:
            for a, b in zip(kv, whole_kv, strict=True):
                torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def _one_step(tiny_recipe, module, stacked, prompt, ctx, packed=False, fp8=False, trim_swa=True):
    """Prefill ``prompt`` (block manager tables), then one step of ``module`` at context bucket ``ctx``."""
    session = eager_rank(tiny_recipe, stacked, fp8=fp8, packed=packed)
    blocks, N = session.block_manager(), len(prompt)
    blocks.reserve(0, N, N)
    session.prefill(prompt, session.stepper.kv_caches, {g: t[0] for g, t in block_rows(blocks, [0], [N]).items()})
    blocks.reserve(0, N + 1, N)
    tables = block_rows(blocks, [0], [tiny_recipe.max_model_len])
    full, swa = tables["full"], tables["sliding"]
    inputs = attn_metadata.build(torch.tensor([[5]]), torch.tensor([N]), full, swa, batch=1, ctx=ctx,
                                 block_size=tiny_recipe.block_size,
                                 num_swa=tiny_recipe.num_swa if trim_swa else full.shape[1])
    with torch.no_grad():
        return module(*inputs.as_args(session.stepper.kv_caches))


def test_bucket_invariance(tiny_recipe, tiny_cfg, stacked):
    module = GptOssDecode(tiny_cfg, stacked)
    prompt = PROMPTS[2]  # 70 tokens: needed 71
    ref = _one_step(tiny_recipe, module, stacked, prompt, tiny_recipe.max_model_len)
    for ctx in (128, 256):
        torch.testing.assert_close(_one_step(tiny_recipe, module, stacked, prompt, ctx), ref, atol=1e-6, rtol=0)
    untrimmed = _one_step(tiny_recipe, module, stacked, prompt, 128, trim_swa=False)
    torch.testing.assert_close(untrimmed, ref, atol=1e-6, rtol=0)


def test_packed_fp8_k_equals_unpacked_fp8(tiny_recipe, tiny_cfg, stacked):
    toks = {}
    for packed in (False, True):
        toks[packed] = greedy(eager_rank(tiny_recipe, stacked, fp8=True, packed=packed), PROMPTS[:2], 16)
    assert toks[True] == toks[False]
    fp32 = _one_step(tiny_recipe, GptOssDecode(tiny_cfg, stacked), stacked, PROMPTS[0], 128)
    fp8 = _one_step(tiny_recipe, GptOssDecode(tiny_cfg, stacked, packed_k=True), stacked, PROMPTS[0], 128,
                    packed=True, fp8=True)
    unpacked = _one_step(tiny_recipe, GptOssDecode(tiny_cfg, stacked), stacked, PROMPTS[0], 128, fp8=True)
    torch.testing.assert_close(fp8, unpacked, atol=0, rtol=0)  # same bytes, another layout
    rel = ((fp8 - fp32).abs().max() / fp32.abs().max()).item()
    print(f"fp8 KV vs fp32: max |dlogit| / max |logit| = {rel:.4f}")
    assert rel < 0.25, (f"fp8 KV logits drift {rel:.4f} of the logit range "
                        "(docs/benchmarks.md states the measured value)")


def test_mxfp4_dequant_known_values():
    # Nibbles low-first: byte 0x21 -> codes 1 (0.5), 2 (1.0); 0xF8 -> codes 8 (-0.0), 15 (-6.0).
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0], blocks[0, 0, 1], blocks[0, 0, 15] = 0x21, 0xF8, 0x7A
    scales = torch.tensor([[128]], dtype=torch.uint8)  # 2^(128-127) = 2
    got = W.dequant_mxfp4(blocks, scales)[0]  # [1, 32]
    assert got[:4].tolist() == [1.0, 2.0, -0.0, -12.0]
    assert got[30:].tolist() == [-2.0, 12.0]  # 0x7A: low nibble 10 (-1.0), high 7 (6.0), times 2
    assert got[4:30].abs().sum() == 0
    scales = torch.tensor([[125]], dtype=torch.uint8)  # 2^-2
    assert W.dequant_mxfp4(blocks, scales)[0, 1].item() == 0.25


def test_mxfp4_checkpoint_loads(tmp_path, tiny_cfg):
    from safetensors.torch import save_file

    sd = W.random_state_dict(tiny_cfg, seed=3)
    quant = {}
    for k, t in sd.items():
        if k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj"):
            blocks, scales = W.quant_mxfp4(t.transpose(1, 2))  # checkpoint stores [E, out, in]
            quant[k + "_blocks"] = blocks  # [E, out, G, 16]
            quant[k + "_scales"] = scales
        else:
            quant[k] = t
    save_file(quant, str(tmp_path / "model.safetensors"))
    loaded = W.load_checkpoint(tmp_path)
    for k in sd:
        if k.endswith("_proj") and "experts" in k:
            want = W.dequant_mxfp4(quant[k + "_blocks"], quant[k + "_scales"]).transpose(1, 2)
            assert torch.equal(loaded[k], want)
            assert (loaded[k] - sd[k]).abs().max() < sd[k].abs().max() / 4  # FP4 keeps the gist
        else:
            assert torch.equal(loaded[k], sd[k])


def test_sharded_checkpoint_loads(tmp_path, tiny_cfg):
    import json

    from safetensors.torch import save_file

    sd = W.random_state_dict(tiny_cfg, seed=4)
    keys = sorted(sd)
    half = len(keys) // 2
    save_file({k: sd[k] for k in keys[:half]}, str(tmp_path / "a.safetensors"))
    save_file({k: sd[k] for k in keys[half:]}, str(tmp_path / "b.safetensors"))
    index = {"weight_map": {k: ("a" if i < half else "b") + ".safetensors" for i, k in enumerate(keys)}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = W.load_checkpoint(tmp_path)
    assert all(torch.equal(loaded[k], sd[k]) for k in keys)


def test_shard_slices_heads_and_experts(tiny_cfg):
    from neffbuild.models.gpt_oss import sharding
    from neffbuild.runtime.parallel import ParallelLayout

    st = W.stack(tiny_cfg, W.random_state_dict(tiny_cfg, 0))
    par = ParallelLayout(tp=2, ep=2)
    parts = [sharding.shard(tiny_cfg, st, par, r) for r in (0, 1)]
    d, Hq, Hk = tiny_cfg.head_dim, tiny_cfg.num_attention_heads, tiny_cfg.num_key_value_heads
    assert parts[0]["qkv_w"].shape[1] == (Hq + 2 * Hk) * d // 2
    assert torch.equal(parts[1]["qkv_w"][:, : Hq * d // 2], st["qkv_w"][:, Hq * d // 2: Hq * d])  # rank 1's q heads
    assert parts[1]["gate_up_w"].shape[1] == tiny_cfg.num_local_experts // 2
    assert torch.equal(torch.cat([p["o_w"] for p in parts], dim=2), st["o_w"])
    assert torch.equal(parts[1]["gate_up_w"], st["gate_up_w"][:, 2:])
    assert torch.equal(parts[1]["o_b"], st["o_b"])  # replicated: added once, after the all-reduce
    V = tiny_cfg.vocab_size  # the embedding and the LM head: split by vocabulary, rank 1 the upper half
    assert torch.equal(parts[1]["embed"], st["embed"][V // 2:])
    assert torch.equal(parts[0]["lm_head"], st["lm_head"][: V // 2])
    assert {k: tuple(v.shape) for k, v in parts[0].items()} == sharding.rank_shapes(tiny_cfg, par)


def test_layer_plan_is_decided_in_init(tiny_cfg, stacked):
    import inspect

    src = inspect.getsource(GptOssDecode.forward)
    assert "if i" not in src and "layer_idx" not in src
    m = GptOssDecode(tiny_cfg, stacked)
    assert m.layer_plan == [(0, 0, "sliding_attention"), (1, 0, "full_attention"),
                            (2, 1, "sliding_attention"), (3, 1, "full_attention")]


def test_spec_family_graph_exports_with_aux_hidden_states(tiny_recipe, stacked):
    """q = 1+k with EAGLE3 aux outputs: torch.export traces it and the exported graph equals eager."""
    from neffbuild.compiler.graphs import build_graph, target_graph
    from neffbuild.grid import Target

    spec = target_graph(tiny_recipe, Target("target_spec", 2, 128, 4, "decode_b2_s4_ctx128"))
    module, inputs = build_graph(spec, stacked)
    ins = list(inputs)
    ins[0] = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    ins[1] = torch.tensor([[10, 11, 12, 13], [40, 41, 42, 43]])
    ins[2] = torch.arange(1, 17).view(2, 8)
    ins[5] = torch.arange(16, 24)
    ep = torch.export.export(module, tuple(ins[:7]) + (tuple(t.clone() for t in ins[7]),), strict=False)
    with torch.no_grad():
        want_logits, want_aux = module(*ins[:7], tuple(t.clone() for t in ins[7]))
        got_logits, got_aux = ep.module()(*ins[:7], tuple(t.clone() for t in ins[7]))
    assert want_logits.shape == (2, 4, tiny_recipe.model.config.vocab_size)
    assert want_aux.shape == (2, 4, 3 * tiny_recipe.model.config.hidden_size)
    torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(got_aux, want_aux, atol=1e-5, rtol=0)


@pytest.mark.parametrize("recipe_name", ["gpt-oss-tiny", "gpt-oss-small"])
def test_exported_graph_needs_only_the_bundles_weights(recipe_name):
    """Every constant an artifact expects is a stacked weight the bundle stores (gpt-oss-small once needed inv_freq)."""
    from neffbuild import grid, recipe
    from neffbuild.compiler.graphs import build_graph, target_graph
    from tests.conftest import ROOT

    r = recipe.load(ROOT / "recipes" / f"{recipe_name}.yaml")
    target = min(grid.targets(r), key=lambda t: (t.batch, t.ctx))
    module, inputs = build_graph(target_graph(r, target))
    ep = torch.export.export(module, inputs, strict=False)
    kinds = ("PARAMETER", "BUFFER", "CONSTANT_TENSOR")
    lifted = {s.target for s in ep.graph_signature.input_specs if s.kind.name in kinds}
    assert lifted == set(W.STACKED_NAMES), lifted ^ set(W.STACKED_NAMES)
