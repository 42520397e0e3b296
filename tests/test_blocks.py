"""KV block accounting: the one formula, and the block manager that must serve whatever it admits."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neffbuild.errors import KVPoolExhausted
from neffbuild.runtime.blocks import (
    NULL_BLOCK,
    BlockManager,
    KVGroup,
    blocks_needed,
    group_blocks,
    kv_groups,
    min_pool_blocks,
)

GROUPS = kv_groups(32)  # the tiny recipe: full + sliding window 32


@pytest.mark.parametrize("tokens,bs,window,q,want", [
    (512, 16, None, 1, 32),
    (511, 16, None, 1, 32),
    (1, 16, None, 1, 1),
    (512, 16, 32, 1, 3),  # 32 positions can straddle 3 blocks of 16
    (512, 16, 16, 1, 2),
    (512, 16, 32, 4, 4),  # 1+k = 4: window + 3 positions
    (20, 16, 32, 1, 2),  # never more than the sequence has
    (131072, 128, 128, 4, 3),
])
def test_group_blocks(tokens, bs, window, q, want):
    assert group_blocks(tokens, bs, window, q) == want


def test_tiny_recipe_numbers():
    assert blocks_needed(512, 16, GROUPS) == 35
    assert min_pool_blocks(512, 16, GROUPS) == 36  # + the null block
    assert min_pool_blocks(512, 16, GROUPS, num_seqs=4) == 141


def _serve(mgr, rid, prompt, total, accept):
    """Prefill then decode steps of up to q tokens, as serve/ and spec decoding call reserve; peak held."""
    mgr.reserve(rid, prompt, prompt)
    n, peak, i = prompt, mgr.held(rid), 0
    while n < total:
        q = min(accept[i % len(accept)], total - n)
        mgr.reserve(rid, n + q, n)
        peak = max(peak, mgr.held(rid))
        n, i = n + q, i + 1
    return peak


@settings(max_examples=60, deadline=None)
@given(bs=st.sampled_from([1, 2, 8, 16, 32]), window=st.integers(1, 200), total=st.integers(1, 600),
       prompt_frac=st.floats(0, 1), k=st.integers(0, 3), accept=st.lists(st.integers(1, 4), min_size=1, max_size=5))
def test_pool_at_formula_minimum_serves_any_run(bs, window, total, prompt_frac, k, accept):
    """Whatever validates must serve: a pool of min_pool_blocks never runs dry, and the peak equals the formula."""
    groups = kv_groups(window)
    prompt = max(1, int(total * prompt_frac))
    accept = [min(a, 1 + k) for a in accept]
    mgr = BlockManager(min_pool_blocks(total, bs, groups, 1 + k), bs, groups)
    peak = _serve(mgr, "r", prompt, total, accept)
    assert peak <= blocks_needed(total, bs, groups, 1 + k)
    full = mgr.tables["r"]["full"]
    assert len(full) == -(-total // bs) and NULL_BLOCK not in full
    mgr.release("r")
    assert mgr.num_free == min_pool_blocks(total, bs, groups, 1 + k) - 1


def test_formula_is_tight_for_single_token_steps():
    for window, bs in [(32, 16), (128, 128), (7, 4), (16, 16)]:
        groups = kv_groups(window)
        mgr = BlockManager(10_000, bs, groups)
        assert _serve(mgr, 0, 1, 2000, [1]) == blocks_needed(2000, bs, groups)


def test_sliding_blocks_return_to_the_pool_and_become_null():
    mgr = BlockManager(100, 16, GROUPS)
    mgr.reserve(0, 100, 100)  # prefill of 100 tokens: keep what a query at 100 reads (69..99)
    assert mgr.tables[0]["full"] == [1, 2, 3, 4, 5, 6, 7]
    assert mgr.tables[0]["sliding"] == [0, 0, 0, 0, 8, 9, 10]  # blocks 4..6 only
    free = mgr.num_free
    for n in range(100, 140):
        mgr.reserve(0, n + 1, n)
    swa = mgr.tables[0]["sliding"]
    assert [i for i, b in enumerate(swa) if b != NULL_BLOCK] == [6, 7, 8]  # keys from 108 on: blocks 6..8
    assert mgr.tables[0]["sliding"][:6] == [0] * 6 and len(mgr.tables[0]["full"]) == 9
    assert free - mgr.num_free == 2  # full grew by 2 blocks; sliding took 2 and gave 2 back


def test_exhaustion_is_typed_and_changes_nothing():
    mgr = BlockManager(8, 16, GROUPS)  # 7 usable blocks
    mgr.reserve("a", 64, 64)  # 4 full + 2 sliding (keys 33..63: blocks 2 and 3)
    assert mgr.num_free == 1
    before = (mgr.num_free, {k: dict(v) for k, v in mgr.tables.items()})
    with pytest.raises(KVPoolExhausted, match=r"needed \d+ blocks, \d+ free; raise serving.num_blocks") as exc:
        mgr.reserve("b", 64, 64)
    assert exc.value.needed > exc.value.free
    assert (mgr.num_free, {k: dict(v) for k, v in mgr.tables.items()}) == before and "b" not in mgr.tables
    mgr.release("a")
    assert mgr.num_free == 7


def test_groups_are_generic():
    """A third group (an EAGLE3 draft's KV, full attention) is one more entry, no code change."""
    groups = (*GROUPS, KVGroup("draft"))
    mgr = BlockManager(200, 16, groups)
    mgr.reserve(0, 40, 40)
    assert set(mgr.tables[0]) == {"full", "sliding", "draft"} and len(mgr.row(0, "draft", 5)) == 5
    assert blocks_needed(512, 16, groups) == 32 + 3 + 32
