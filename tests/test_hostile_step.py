"""Hostile step input: every step input native code touches is checked first (the step API, engine KV buffers,
EAGLE3 draft calls, one DP rank's bad input).

Each case ends in a clean error (or correct output), never a crash."""

import pytest
import torch

from neffbuild.errors import InvalidInput, StepInputError
from neffbuild.runtime import StepBatch, Stepper
from neffbuild.runtime.bundle.reader import open_bundle
from neffbuild.runtime.kv.blocks import BlockManager, KVGroup
from tests.conftest import POOL, TINY

# -- the runtime library: every step input native code touches is checked first ----------
# Each case runs on the compiled tiny bundle in this process: before the checks, the out-of-pool
# cases aborted it (SIGABRT inside the artifact's OpenMP region); a signal here fails the suite.


VOCAB = 256  # recipes/gpt-oss-tiny.yaml


def _good():
    """Two requests at positions 20 and 40 (block 16): full blocks 1..4 / 5..8, sliding 9..12 / 13..16."""
    full = torch.arange(1, 9).reshape(2, 4)
    return [[5], [7]], [20, 40], {"full": full, "sliding": full + 8}


def _set(group, r, c, value):
    def edit(toks, comp, tables):
        tables[group] = tables[group].clone()
        tables[group][r, c] = value
        return toks, comp, tables
    return edit


def _tokens(row, value):
    def edit(toks, comp, tables):
        toks[row] = [value]
        return toks, comp, tables
    return edit


def _computed(row, value):
    def edit(toks, comp, tables):
        comp[row] = value
        return toks, comp, tables
    return edit


def _table(group, fn):
    def edit(toks, comp, tables):
        tables[group] = fn(tables.get(group))
        return toks, comp, tables
    return edit


STEP_CASES = [  # (id, edit, needle); "+" marks cases the fuzz run did not try
    ("read-column-outside-pool", _set("full", 0, 0, POOL), f"block id {POOL}; block ids must be in [0, {POOL})"),
    ("written-column-outside-pool", _set("full", 1, 2, 10**6), "block id 1000000"),
    ("negative-block-id", _set("full", 0, 1, -1), "block id -1"),
    ("null-block-for-live-position", _set("full", 0, 1, 0), "request 0 has the null block (0) in column 1"),
    ("table-narrower-than-position", _table("full", lambda t: t[:, :2]), "needs 3 columns"),
    ("token-minus-one", _tokens(0, -1), "holds -1; token ids must be integers in [0, 256)"),
    ("token-at-vocab", _tokens(1, VOCAB), "holds 256; token ids"),
    ("num-computed-float", _computed(0, 3.9), "num_computed[0] is 3.9"),
    ("num-computed-string", _computed(1, "3"), "num_computed[1] is '3'"),
    ("table-as-list", _table("full", lambda t: t.tolist()), "must be a torch.Tensor"),
    ("table-on-another-device", _table("full", lambda t: t.to("meta")), "must be on the CPU"),
    ("+ sliding-written-column-null", _set("sliding", 1, 2, 0), "request 1 has the null block (0) in column 2"),
    ("+ sliding-read-column-outside-pool", _set("sliding", 0, 0, POOL + 3), f"block id {POOL + 3}"),
    ("+ token-bool", _tokens(0, True), "holds True"),
    ("+ token-float", _tokens(0, 5.0), "holds 5.0"),
    ("+ table-float", _table("full", lambda t: t.float()), "must hold integer block ids"),
    ("+ table-1d", _table("full", lambda t: t[0]), "must be [R=2, W>=1]"),
    ("+ unknown-group", _table("draft", lambda t: torch.ones(2, 4, dtype=torch.long)), "unknown KV group 'draft'"),
    ("+ no-full-group", lambda toks, comp, tables: (toks, comp, {"sliding": tables["sliding"]}), "lacks the 'full'"),
    ("+ num-computed-negative", _computed(0, -4), "num_computed[0] is -4"),
]


@pytest.fixture(scope="module")
def tiny_stepper(built):
    step = Stepper(open_bundle(built.bundle))
    assert step.step(StepBatch(*_good())).logits.shape == (2, 1, VOCAB)
    return step


@pytest.mark.parametrize("edit,needle", [c[1:] for c in STEP_CASES], ids=[c[0] for c in STEP_CASES])
def test_malformed_step_is_a_step_input_error_before_native_code(tiny_stepper, edit, needle):
    toks, comp, tables = edit(*_good())
    before = [t.clone() for t in tiny_stepper.kv_caches]
    with pytest.raises(StepInputError) as err:
        tiny_stepper.step(StepBatch(toks, comp, tables))
    assert needle in str(err.value)
    assert all(torch.equal(a, b) for a, b in zip(before, tiny_stepper.kv_caches, strict=True))  # KV untouched


def test_integral_step_inputs_of_other_types_run(tiny_stepper):
    import numpy as np

    toks, comp, tables = _good()
    want = tiny_stepper.step(StepBatch(toks, comp, tables)).logits
    got = tiny_stepper.step(StepBatch([[np.int64(5)], [torch.tensor(7)]], [np.int32(20), torch.tensor(40)],
                                      {k: v.int() for k, v in tables.items()})).logits
    torch.testing.assert_close(got, want)


def _kv(kv):
    return [b.clone() for b in kv]


TEST_KV_BUFFERS = 1  # the session bundles' 2-layer model: layers 0 and 1 share buffer 0
KV_CASES = [  # (id, engine buffers from the right ones, needle)
    ("one-block-instead-of-pool", lambda kv: [b[:, :1].clone() for b in kv], "the bundle's KV layout is"),
    ("fewer-blocks", lambda kv: [b[:, : POOL - 9].clone() for b in kv], "the bundle's KV layout is"),
    ("float16", lambda kv: [b.half() for b in kv], "dtype torch.float16"),
    ("int8", lambda kv: [b.to(torch.int8) for b in kv], "dtype torch.int8"),
    ("transposed", lambda kv: [b.transpose(3, 4) for b in kv], "not contiguous"),  # block 16 = head_dim 16
    ("non-contiguous", lambda kv: [torch.zeros(*b.shape[:-1], 2 * b.shape[-1])[..., ::2] for b in kv],
     "not contiguous"),
    ("meta", lambda kv: [b.to("meta") for b in kv], "meta tensor"),
    ("a-buffer-short", lambda kv: kv[:-1], f"{TEST_KV_BUFFERS - 1} buffers given"),
    ("a-buffer-extra", lambda kv: kv + kv[:1], f"{TEST_KV_BUFFERS + 1} buffers given"),
    ("+ a-tensor-not-a-list", lambda kv: kv[0], "must be a list"),
    ("+ a-list-of-lists", lambda kv: [[0.0]] * len(kv), "must be a torch.Tensor"),
]


@pytest.mark.parametrize("make,needle", [c[1:] for c in KV_CASES], ids=[c[0] for c in KV_CASES])
def test_engine_kv_buffers_are_checked_at_construction(built, make, needle):
    bundle = open_bundle(built.bundle)
    good = Stepper(bundle).kv_caches
    assert len(good) == TEST_KV_BUFFERS
    with pytest.raises(StepInputError, match="kv_caches") as err:
        Stepper(bundle, kv_caches=make(good))
    assert needle in str(err.value)
    assert Stepper(bundle, kv_caches=good).kv_caches[0] is good[0]  # the engine's own buffers, used in place


def test_fp8_bundle_refuses_float32_kv_buffers(fp8_built):
    bundle = open_bundle(fp8_built.bundle)
    with pytest.raises(StepInputError, match="float8_e4m3fn"):
        Stepper(bundle, kv_caches=[torch.zeros(bundle.kv_layout.buffer_shape)] * bundle.kv_layout.num_buffers)


@pytest.mark.parametrize("args,needle", [
    ((64, 0, [KVGroup("full")]), "block_size must be an integer >= 1"),
    ((1, 16, [KVGroup("full")]), "num_blocks must be an integer >= 2"),  # +
    ((64, 16.0, [KVGroup("full")]), "block_size"),  # +
    ((64, 16, []), "groups must be KVGroups"),  # +
    ((64, 16, [KVGroup("sliding", 0)]), "window None or >= 1"),  # +
], ids=["block-size-0", "+ one-block", "+ float-block-size", "+ no-groups", "+ window-0"])
def test_block_manager_refuses_bad_sizes(args, needle):
    with pytest.raises(InvalidInput, match=needle):
        BlockManager(*args)


# -- EAGLE3 draft calls: the same rules; the aux width comes from the bundle, never the caller

def _draft_rows(bundle):
    A = bundle.aux_hidden_size
    return [([3, 4], torch.zeros(2, A), 30), ([9], torch.zeros(1, A), 50)], torch.arange(1, 11).reshape(2, 5), 51


DRAFT_CASES = [
    ("block-id-outside-pool", lambda rows, t, m: (rows, t.index_fill(1, torch.tensor([0]), POOL), m), "block id"),
    ("token-minus-one", lambda rows, t, m: ([([-1, 4], rows[0][1], 30), rows[1]], t, m), "holds -1"),
    ("position-beyond-max-model-len", lambda rows, t, m: ([([3], rows[0][1][:1], 600)], t[:1], 601),
     "max_model_len is 256"),
    ("row-count-mismatch", lambda rows, t, m: (rows, t[:1], m), "must be [R=2, W>=1]"),
    ("aux-rows-mismatch", lambda rows, t, m: ([([3, 4], rows[1][1], 30), rows[1]], t, m), "aux is [1, "),
    ("aux-width-from-caller", lambda rows, t, m: ([([3, 4], torch.zeros(2, 7), 30), rows[1]], t, m), "aux is [2, 7]"),
    ("+ first-position-float", lambda rows, t, m: ([([3, 4], rows[0][1], 30.5), rows[1]], t, m), "30.5"),
    ("+ beyond-max-computed", lambda rows, t, m: (rows, t, 40), "beyond max_computed 40"),
    ("+ aux-float64", lambda rows, t, m: ([([3, 4], rows[0][1].double(), 30), rows[1]], t, m), "float32"),
    ("+ null-block-for-live-position", lambda rows, t, m: (rows, t.index_fill(1, torch.tensor([1]), 0), m),
     "null block (0) in column 1"),
]


@pytest.fixture(scope="module")
def eagle3_stepper(eagle3_built):
    step = Stepper(open_bundle(eagle3_built.bundle))
    rows, table, mc = _draft_rows(step.artifacts)
    _, drafts = step.draft(rows, table, max_computed=mc)
    assert drafts.shape == (2, step.grid.num_speculative_tokens)
    return step


@pytest.mark.parametrize("edit,needle", [c[1:] for c in DRAFT_CASES], ids=[c[0] for c in DRAFT_CASES])
def test_malformed_draft_call_is_a_step_input_error(eagle3_stepper, edit, needle):
    rows, table, mc = edit(*_draft_rows(eagle3_stepper.artifacts))
    before = eagle3_stepper.draft_cache.clone()
    with pytest.raises(StepInputError) as err:
        eagle3_stepper.draft(rows, table, max_computed=mc)
    assert needle in str(err.value)
    assert torch.equal(before, eagle3_stepper.draft_cache)

# -- DP: one rank's out-of-pool block id; both ranks raise on the same step (one collective each)

def _dp_out_of_pool_rank(rank, world):
    import torch.distributed as dist

    from neffbuild import recipe as R
    from neffbuild.models.gpt_oss.weights import model_weights
    from neffbuild.runtime.kv.cache import KVLayout
    from neffbuild.runtime.step.dispatch import Grid
    from neffbuild.serve.rank import eager_artifacts

    cfg = R.load(TINY).model.config
    layout = KVLayout(cfg.num_kv_buffers, 40, cfg.num_key_value_heads, 16, cfg.head_dim)
    step = Stepper(eager_artifacts(cfg, model_weights(cfg, None, 0), Grid((1, 2), (128,), 256), layout, 8),
                   group=dist.group.WORLD)
    before = step.collectives
    for i in range(4):
        table = torch.arange(1, 17)[None].clone()
        if rank == 1 and i == 2:
            table[0, 0] = 40  # the pool is 40 blocks: id 40 is outside it
        try:
            step.step(StepBatch([[3]], [10 + i], {"full": table}))
        except StepInputError as exc:
            return {"step": i, "message": str(exc), "collectives": step.collectives - before}
    return {"step": None}


def test_dp2_out_of_pool_block_raises_on_both_ranks_same_step():
    from tests.dist_util import run_ranks

    r0, r1 = run_ranks(_dp_out_of_pool_rank, 2)
    assert r0["step"] == r1["step"] == 2 and r0["collectives"] == r1["collectives"] == 3
    assert "block id 40; block ids must be in [0, 40)" in r1["message"]
    assert "another DP rank" in r0["message"]
