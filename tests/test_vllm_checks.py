"""The vLLM plugin's start-up rules (neffbuild/vllm/checks.py) and its settings (config.py), without vLLM.

The rules are pure Python over two plain views, so this table runs in the test venv; tests/test_vllm_startup.py
shows the same mismatches failing a real ``vllm serve``.
"""

import pytest

from neffbuild.errors import InvalidInput
from neffbuild.vllm import checks
from neffbuild.vllm.config import PluginConfig, from_additional_config

MODEL = {"vocab_size": 512, "hidden_size": 256, "num_hidden_layers": 2, "head_dim": 64, "sliding_window": 64,
         "rope_parameters": {"rope_theta": 150000.0, "factor": 32.0}}
BUNDLE = checks.Compiled(model_config=MODEL, max_model_len=512, block_size=32, num_blocks=128,
                         num_seqs_buckets=(2, 4))
FITS = checks.Engine(model_config=dict(MODEL, rope_parameters={"rope_theta": 150000, "factor": 32.0,
                                                               "rope_type": "yarn"}, torch_dtype="float32"),
                     dtype="float32", max_model_len=512, block_size=32, num_gpu_blocks_override=128, max_num_seqs=4)


def test_a_fitting_configuration_has_no_problem_and_a_smaller_max_num_seqs_fits():
    assert checks.problems(BUNDLE, FITS) == []  # rope_type only on vLLM's side, 150000 == 150000.0
    assert checks.problems(BUNDLE, checks.Engine(**{**FITS.__dict__, "max_num_seqs": 2})) == []


@pytest.mark.parametrize(("change", "expected"), [
    ({"block_size": 16}, "--block-size: vLLM has block_size 16, the bundle was compiled for 32 (pass --block-size 32)"),
    ({"max_model_len": 1024}, "--max-model-len: vLLM has max_model_len 1024, the bundle was compiled for 512"),
    ({"num_gpu_blocks_override": None}, "--num-gpu-blocks-override: vLLM has a KV pool of None, the bundle was "
                                        "compiled for 128 (the pool is part of the compiled shape"),
    ({"num_gpu_blocks_override": 512}, "--num-gpu-blocks-override: vLLM has a KV pool of 512, the bundle"),
    ({"max_num_seqs": 8}, "--max-num-seqs: vLLM has max_num_seqs 8, the bundle was compiled for 4 (the largest "
                          "batch bucket; pass --max-num-seqs 4 or fewer)"),
    ({"model_config": dict(MODEL, hidden_size=128)}, "the checkpoint (vllm serve MODEL / --hf-overrides): vLLM has "
                                                     "hidden_size 128, the bundle was compiled for 256"),
    ({"model_config": dict(MODEL, rope_parameters={"rope_theta": 10000.0})}, "vLLM has rope_parameters"),
    ({"dtype": "bfloat16"}, "--dtype: vLLM has dtype 'bfloat16', the bundle was compiled for 'float32'"),
    ({"kv_cache_dtype": "fp8"}, "--kv-cache-dtype: vLLM has kv_cache_dtype 'fp8', the bundle was compiled for 'auto'"),
    ({"num_speculative_tokens": 2}, "--speculative-config: vLLM has num_speculative_tokens 2"),
    ({"tensor_parallel_size": 2}, "--tensor-parallel-size: vLLM has tensor_parallel_size 2, the bundle was compiled "
                                  "for 1"),
    ({"pipeline_parallel_size": 2}, "--pipeline-parallel-size: vLLM has pipeline_parallel_size 2"),
])
def test_each_mismatch_names_the_flag_and_both_values(change, expected):
    [line] = checks.problems(BUNDLE, checks.Engine(**{**FITS.__dict__, **change}))
    assert line.startswith(expected) or expected in line, line


def test_every_mismatch_is_reported_at_once():
    found = checks.problems(BUNDLE, checks.Engine(**{**FITS.__dict__, "block_size": 16, "max_model_len": 256}))
    assert [f.split(":")[0] for f in found] == ["--max-model-len", "--block-size"]


DRAFT = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
         "intermediate_size": 256, "vocab_size": 512, "draft_vocab_size": 512}
EAGLE3 = checks.Compiled(**{**BUNDLE.__dict__, "num_speculative_tokens": 3, "speculative_method": "eagle3",
                            "draft_config": DRAFT, "aux_layers": (2, 2, 1)})
SPECULATES = checks.Engine(**{**FITS.__dict__, "num_speculative_tokens": 3, "speculative_method": "eagle3",
                              "draft_config": dict(DRAFT), "aux_layers": (2, 2, 1), "unpadded_drafts": True})


def test_an_eagle3_bundle_serves_with_its_own_speculation_or_without_any():
    assert checks.problems(EAGLE3, SPECULATES) == []
    assert checks.problems(EAGLE3, FITS) == []  # no --speculative-config: its target_nospec graphs
    assert checks.problems(EAGLE3, checks.Engine(**{**SPECULATES.__dict__, "aux_layers": ()})) == []  # defaults


@pytest.mark.parametrize(("change", "expected"), [
    ({"num_speculative_tokens": 2}, "--speculative-config: vLLM has num_speculative_tokens 2, the bundle was "
                                    "compiled for 3"),
    ({"speculative_method": "eagle"}, "--speculative-config: vLLM has method 'eagle', the bundle was compiled for "
                                      "'eagle3'"),
    ({"draft_config": dict(DRAFT, head_dim=128)}, "--speculative-config: vLLM has a draft model with head_dim 128, "
                                                  "the bundle was compiled for 64"),
    ({"aux_layers": (1, 2, 3)}, "--speculative-config: vLLM has draft aux layer ids (eagle_aux_hidden_state_layer_ids)"
                                " [1, 2, 3], the bundle was compiled for [2, 2, 1]"),
    ({"unpadded_drafts": False}, "--speculative-config: vLLM has disable_padded_drafter_batch False"),
])
def test_each_speculation_mismatch_names_the_flag_and_both_values(change, expected):
    [line] = checks.problems(EAGLE3, checks.Engine(**{**SPECULATES.__dict__, **change}))
    assert line.startswith(expected), line


# Sharded bundles: vLLM's ranks must be the bundle's (tp 2 with replicated experts; dp 2 with its experts split).
TP2 = checks.Compiled(**{**BUNDLE.__dict__, "tp": 2, "kv_heads_per_rank": 1})
TP2_FITS = checks.Engine(**{**FITS.__dict__, "tensor_parallel_size": 2, "kv_heads_per_rank": 1})
DP2 = checks.Compiled(**{**BUNDLE.__dict__, "dp": 2, "ep": 2, "kv_heads_per_rank": 2})
DP2_FITS = checks.Engine(**{**FITS.__dict__, "data_parallel_size": 2, "expert_parallel": True, "kv_heads_per_rank": 2})


@pytest.mark.parametrize(("bundle", "change", "expected"), [
    (TP2, {"tensor_parallel_size": 1}, "--tensor-parallel-size: vLLM has tensor_parallel_size 1, the bundle was "
                                       "compiled for 2 (pass --tensor-parallel-size 2)"),
    (TP2, {"expert_parallel": True}, "--enable-expert-parallel: vLLM has expert parallel 'on', the bundle was "
                                     "compiled for 'ep 1 (experts on every rank)' (remove --enable-expert-parallel)"),
    (TP2, {"kv_heads_per_rank": 2}, "--tensor-parallel-size: vLLM has KV heads per rank 2, the bundle was compiled "
                                    "for 1"),
    (DP2, {"data_parallel_size": 1}, "--data-parallel-size: vLLM has data_parallel_size 1, the bundle was compiled "
                                     "for 2 (pass --data-parallel-size 2)"),
    (DP2, {"expert_parallel": False}, "--enable-expert-parallel: vLLM has expert parallel 'off', the bundle was "
                                      "compiled for 'ep 2' (pass --enable-expert-parallel)"),
    (BUNDLE, {"data_parallel_size": 2}, "--data-parallel-size: vLLM has data_parallel_size 2, the bundle was "
                                        "compiled for 1"),
])
def test_each_parallel_mismatch_names_the_flag_and_both_values(bundle, change, expected):
    fits = TP2_FITS if bundle is TP2 else DP2_FITS if bundle is DP2 else FITS
    assert checks.problems(bundle, fits) == []
    [line] = checks.problems(bundle, checks.Engine(**{**fits.__dict__, **change}))
    assert line.startswith(expected), line


def test_a_dp2_bundle_serves_without_speculation_only():
    bundle = checks.Compiled(**{**EAGLE3.__dict__, "dp": 2, "ep": 2})
    engine = checks.Engine(**{**SPECULATES.__dict__, "data_parallel_size": 2, "expert_parallel": True})
    assert checks.problems(bundle, checks.Engine(**{**engine.__dict__, "num_speculative_tokens": 0})) == []
    [line] = checks.problems(bundle, engine)
    assert line.startswith("--speculative-config: vLLM has num_speculative_tokens 3, the bundle was compiled for 0 "
                           "(the plugin serves a dp > 1 bundle without speculation"), line


def test_an_expert_parallel_group_other_than_every_rank_is_refused():
    half = checks.Compiled(**{**DP2.__dict__, "dp": 4})  # ep 2 of 4 ranks: vLLM's EP group would hold all 4
    [line] = checks.problems(half, checks.Engine(**{**DP2_FITS.__dict__, "data_parallel_size": 4}))
    assert line.startswith("--enable-expert-parallel: vLLM has an expert-parallel group of 4, the bundle was "
                           "compiled for 2"), line


@pytest.mark.parametrize(("section", "message"), [
    ("artifacts/x", "--additional-config neffbuild: must be an object"),
    ({}, "--additional-config neffbuild.bundle: required"),
    ({"bundel": "x"}, "--additional-config neffbuild.bundel: unknown key; did you mean 'bundle'?"),
    ({"bundle": "x", "trusted_keys": "k.pub"}, "neffbuild.trusted_keys: a non-empty list of PEM public key paths"),
    ({"bundle": "x", "verify": "none"}, "neffbuild.verify: 'sizes' or 'full'"),
])
def test_settings_are_checked_with_the_key_path(section, message):
    with pytest.raises(InvalidInput, match=message.replace("(", r"\(").replace("?", r"\?")):
        from_additional_config({"neffbuild": section})


def test_settings_absent_leave_vllm_alone_and_present_are_read():
    assert from_additional_config(None) is None and from_additional_config({"other": 1}) is None
    got = from_additional_config({"neffbuild": {"bundle": "b", "trusted_keys": ["k.pub"], "verify": "full"}})
    assert got == PluginConfig("b", ("k.pub",), "full")
