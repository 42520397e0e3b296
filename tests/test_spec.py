"""EAGLE3 speculative decoding: family rules, and greedy speculation is lossless (eager and compiled)."""

from __future__ import annotations

import pytest
import torch

from neffbuild.models.eagle3 import weights as dw
from neffbuild.models.eagle3.config import Eagle3Config
from neffbuild.models.eagle3.draft import Eagle3Draft
from neffbuild.models.gpt_oss.decode import GptOssDecode
from neffbuild.models.gpt_oss.harness import eager_runner as plain_runner
from neffbuild.models.gpt_oss.harness import greedy
from neffbuild.models.gpt_oss.weights import random_state_dict, stack
from neffbuild.runtime.decoder import Decoder
from neffbuild.runtime.dispatch import (
    TARGET_NOSPEC,
    TARGET_SPEC,
    GridSpec,
    must_run_without_spec,
    plan_draft,
    plan_spec_step,
)
from neffbuild.runtime.kv_cache import KVLayout
from neffbuild.serve.spec import SpecLoop, eager_runner

K = 3
GRID = GridSpec((1, 2, 4), (128,), 256, K)


@pytest.mark.parametrize("computed, drafts, veto", [
    ([10, 20], True, False),
    ([10, 20], False, True),  # a request without drafts
    ([10, 256 - K - 1], True, False),  # max_position + k + 1 == max_model_len: room
    ([10, 256 - K], True, True),  # no room for drafts
    ([], False, False),  # an idle rank vetoes nothing
])
def test_family_veto(computed, drafts, veto):
    assert must_run_without_spec(GRID, computed, all_have_drafts=drafts) is veto


def test_spec_plan_includes_drafts_and_shares_the_draft_bucket():
    p = plan_spec_step(GRID, batch_count=2, needed=125, without_spec=False, num_reqs=2)
    assert (p.family, p.query_len, p.needed_seq, p.ctx, p.label) == (TARGET_SPEC, 4, 128, 128, "decode_b2_s4_ctx128")
    p = plan_spec_step(GRID, batch_count=2, needed=126, without_spec=False, num_reqs=2)
    assert (p.needed_seq, p.ctx) == (129, 256)  # the drafts push it over the bucket boundary
    p = plan_spec_step(GRID, batch_count=1, needed=126, without_spec=True, num_reqs=1)
    assert (p.family, p.query_len, p.ctx, p.label) == (TARGET_NOSPEC, 1, 128, "decode_b1_s1_ctx128")
    d = plan_draft(GRID, num_reqs=2, max_computed=124)
    assert (d.label, d.query_len) == ("draft_b2_ctx128", 4)


@pytest.fixture(scope="module")
def models(tiny_cfg):
    stacked = stack(tiny_cfg, random_state_dict(tiny_cfg, 0))
    dcfg = Eagle3Config.from_hf_dict({}, tiny_cfg)
    weights = dict(stacked, **dw.draft_weights(dcfg, None, 1))
    target = GptOssDecode(tiny_cfg, stacked, aux_layers=dcfg.aux_layers).eval()
    draft = Eagle3Draft(dcfg, weights, num_speculative_tokens=K).eval()
    return dcfg, weights, target, draft


def _decoder(tiny_cfg, runner):
    layout = KVLayout(tiny_cfg.num_kv_buffers, 128, tiny_cfg.num_key_value_heads, 16, tiny_cfg.head_dim,
                      draft_kv_heads=tiny_cfg.num_key_value_heads, draft_head_dim=tiny_cfg.head_dim)
    return Decoder(layout=layout, spec=GRID, num_swa=8, runner=runner)


CASES = {  # prompts, new tokens, the context buckets the steps must use
    "bucket_boundary": ([[(i * 37) % 256 for i in range(110)], [(i * 11) % 256 for i in range(40)], [5, 6, 7]], 40,
                        {128, 256}),
    "max_model_len": ([[(i * 13) % 256 for i in range(226)]], 256 - 226, {256}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_eager_spec_equals_plain_greedy(tiny_cfg, models, case):
    """Random draft: the same tokens as plain greedy; at max_model_len the last steps go without spec."""
    prompts, n_new, ctxs = CASES[case]
    dcfg, weights, target, draft = models
    plain = greedy(_decoder(tiny_cfg, plain_runner(GptOssDecode(tiny_cfg, weights).eval())), tiny_cfg, weights,
                   prompts, n_new)
    loop = SpecLoop(_decoder(tiny_cfg, eager_runner(target, draft)), tiny_cfg, dcfg, weights)
    assert loop.generate(prompts, n_new) == plain
    fams = [s["family"] for s in loop.stats.steps]
    assert TARGET_SPEC in fams and {s["ctx"] for s in loop.stats.steps} == ctxs
    if case == "max_model_len":
        assert fams[-1] == TARGET_NOSPEC
