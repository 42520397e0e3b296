"""Bucket math and the compile grid: numeric examples and a property test."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neffbuild import grid
from neffbuild.errors import ShapeNotCovered
from neffbuild.runtime.step import buckets as B


@pytest.mark.parametrize("count,buckets,expected", [
    (1, [1, 2, 4], 1), (3, [1, 2, 4], 4), (4, [1, 2, 4], 4), (0, [2, 4], 2), (-5, [2, 4], 2), (2, [2], 2),
])
def test_bucket_for(count, buckets, expected):
    assert B.bucket_for(count, buckets) == expected


def test_bucket_for_fails_closed():
    with pytest.raises(ShapeNotCovered, match="above the largest bucket 4"):
        B.bucket_for(5, [1, 2, 4])
    with pytest.raises(ValueError):
        B.bucket_for(1, [])


@pytest.mark.parametrize("mns,expected", [(8, [1, 2, 4, 8]), (6, [1, 2, 4, 6]), (1, [1]), (5, [1, 2, 4, 5])])
def test_default_num_seqs(mns, expected):
    assert B.default_num_seqs_buckets(mns) == expected


@pytest.mark.parametrize("window,bs,mml,q,expected", [
    (128, 128, 131072, 1, 2), (128, 16, 128, 1, 8), (4096, 32, 131072, 1, 132), (128, 16, 1048576, 1, 16),
    (128, 128, 131072, 4, 3),  # EAGLE3 k=3: keys from n-127 to n+3 can touch 3 blocks of 128
    (130, 128, 131072, 1, 3),  # a window that is not a multiple of the block: 130 positions, 3 blocks
])
def test_num_swa_blocks(window, bs, mml, q, expected):
    assert B.num_swa_blocks(window, bs, mml, q) == expected


def test_needed_seq_and_ctx_bucket():
    assert B.needed_seq([10, 127, 3]) == 128
    assert B.needed_seq([10, 127], 3) == 131
    assert B.ctx_bucket_for(128, [128, 256], 512) == 128
    assert B.ctx_bucket_for(129, [128, 256], 512) == 256
    assert B.ctx_bucket_for(300, [128, 256], 512) == 512
    with pytest.raises(ShapeNotCovered):
        B.ctx_bucket_for(513, [128, 256], 512)
    assert B.table_width(129, 16) == 9 and B.table_width(128, 16) == 8


def test_grid_counts_and_labels():
    t = grid.enumerate_targets([1, 2, 4, 8], [4096, 8192, 16384], 131072)
    assert len(t) == 16
    assert t[0].label == "decode_b1_ctx4096" and t[3].label == "decode_b1_ctx131072"
    t3 = grid.enumerate_targets([1, 2, 4, 8], [4096, 8192, 16384], 131072, num_speculative_tokens=3)
    assert len(t3) == 48
    labels = {x.label for x in t3}
    assert {"decode_b4_s4_ctx2048".replace("2048", "4096"), "decode_b4_s1_ctx4096", "draft_b4_ctx4096"} <= labels
    spec = [x for x in t3 if x.family == "target_spec"][0]
    assert spec.query_len == 4 and [x for x in t3 if x.family == "target_nospec"][0].query_len == 1


def test_build_order_largest_first():
    t = grid.build_order(grid.enumerate_targets([1, 2], [128], 512))
    assert t[0].label == "decode_b2_ctx512" and t[-1].label == "decode_b1_ctx128"


@st.composite
def bucket_setup(draw):
    mml = draw(st.integers(1, 64)) * 128
    ctx = sorted(draw(st.sets(st.integers(1, mml // 128), max_size=6)))
    ctx = [c * 128 for c in ctx if c * 128 < mml]
    ns = sorted(draw(st.sets(st.integers(1, 64), min_size=1, max_size=5)))
    computed = draw(st.lists(st.integers(0, mml - 1), min_size=1, max_size=8))
    drafts = draw(st.integers(0, 3))
    return mml, ctx, ns, computed, drafts


@settings(max_examples=300, deadline=None)
@given(bucket_setup())
def test_ctx_bucket_is_compiled_and_minimal(setup):
    mml, ctx, ns, computed, drafts = setup
    needed = B.needed_seq(computed, drafts)
    compiled = {t.ctx for t in grid.enumerate_targets(ns, ctx, mml)}
    if needed > mml:
        with pytest.raises(ShapeNotCovered):
            B.ctx_bucket_for(needed, ctx, mml)
        return
    got = B.ctx_bucket_for(needed, ctx, mml)
    assert got in compiled and got >= needed
    assert not [c for c in compiled if needed <= c < got]
    batch = B.bucket_for(len(computed), ns) if len(computed) <= ns[-1] else None
    if batch is not None:
        assert any(t.batch == batch and t.ctx == got for t in grid.enumerate_targets(ns, ctx, mml))
