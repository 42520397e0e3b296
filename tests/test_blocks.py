"""KV block accounting: the one formula, and the block manager that must serve whatever it admits."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neffbuild.errors import KVPoolExhausted
from neffbuild.runtime.kv.blocks import (
    NULL_BLOCK,
    BlockManager,
    KVGroup,
    blocks_needed,
    group_blocks,
    kv_groups,
    lookahead,
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


def test_lookahead_is_what_the_pool_spares_for_num_seqs_at_max_model_len():
    """0 at the recipe's formula minimum; whole blocks; the most that fits (one block more does not); every
    position when the pool has room; a model without sliding layers holds no more for it (any pool at the
    formula gets every position)."""
    free = min_pool_blocks(512, 16, GROUPS, num_seqs=4) - 1  # the pool's blocks but the null block
    assert lookahead(free, 4, 512, 16, GROUPS) == 0
    for pool in (free + 3, free + 4, free + 40, 509):
        a = lookahead(pool, 4, 512, 16, GROUPS)
        assert a % 16 == 0 and 4 * blocks_needed(512, 16, GROUPS, 1 + a) <= pool
        assert a == 512 or 4 * blocks_needed(512, 16, GROUPS, 1 + a + 16) > pool
    assert lookahead(free + 4, 4, 512, 16, GROUPS) == 16  # one more sliding block per sequence: one block ahead
    assert lookahead(509, 4, 512, 16, GROUPS) == 512  # the tests' and tiny recipe's pool: every position
    assert lookahead(32 * 4, 4, 512, 16, kv_groups(None)) == 512


@settings(max_examples=60, deadline=None)
@given(bs=st.sampled_from([1, 4, 16]), window=st.one_of(st.none(), st.integers(1, 40)),
       blocks_ahead=st.integers(0, 6), prompt=st.integers(1, 60), new=st.integers(1, 80))
def test_reserving_ahead_stays_within_blocks_needed_with_the_longer_step(bs, window, blocks_ahead, prompt, new):
    """The engine's rule: one position a step, reserve only when the next one leaves the blocks held, then
    ``ahead`` positions more (to the sequence's last): the blocks held never exceed ``blocks_needed`` of the
    sequence with the step ``ahead`` tokens longer (admission's budget), and the tables change about once per
    ``ahead`` tokens."""
    groups, ahead, last = kv_groups(window), blocks_ahead * bs, prompt + new
    mgr = BlockManager(10_000, bs, groups)
    budget = blocks_needed(last, bs, groups, 1 + ahead)
    hold, changes = mgr.reserve("r", max(prompt, min(prompt + 1 + ahead, last)), prompt), 0
    for n in range(prompt, last):
        u = n + 1
        if u > hold[0]:
            hold = mgr.reserve("r", max(u, min(u + ahead, last)), n)
            changes += 1
        assert mgr.held("r") <= budget, (n, mgr.tables["r"])
    if ahead:
        assert changes <= -(-new // ahead) + 1


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


class _SlowManager(BlockManager):
    """The block manager without its no-op fast path: every reserve takes the full route."""

    def reserve(self, rid, upto, next_query=None):
        self._quick.pop(rid, None)
        return super().reserve(rid, upto, next_query)


@settings(max_examples=80, deadline=None)
@given(bs=st.sampled_from([1, 4, 16]), window=st.one_of(st.none(), st.integers(1, 70)),
       calls=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 30), st.integers(0, 24), st.booleans()),
                      min_size=1, max_size=60))
def test_reserve_fast_path_changes_exactly_what_the_full_route_changes(bs, window, calls):
    """Reserve's shortcut (no boundary crossed, nothing leaving the window) leaves the tables, the free
    list and the errors exactly as the full route does; a table change always moves ``version``; what
    reserve returns is ``hold_limits`` (an engine keeps it instead of asking). ``q`` up to 24: an engine's
    look-ahead reserves many positions past the step."""
    fast, slow = BlockManager(40, bs, kv_groups(window)), _SlowManager(40, bs, kv_groups(window))
    pos = {}
    for rid, step, q, release in calls:
        if release and rid in pos:
            want = fast._free + [b for t in fast.tables[rid].values() for b in reversed(t) if b != NULL_BLOCK]
            fast.release(rid), slow.release(rid)
            del pos[rid]
            assert fast.version(rid) == 0 and fast._free == want  # every held block back, in table order reversed
            continue
        n = pos.get(rid, 0) + step  # positions only move forward, as an engine's do
        before = (fast.version(rid), {g: list(t) for g, t in fast.tables.get(rid, {}).items()})
        outcomes = []
        for mgr in (fast, slow):
            try:
                got = mgr.reserve(rid, n + q, n)
                assert got == mgr.hold_limits(rid) and got[2] == mgr.version(rid)
                outcomes.append(None)
            except KVPoolExhausted as e:
                outcomes.append((e.needed, e.free))
        assert outcomes[0] == outcomes[1]
        if outcomes[0] is None:
            pos[rid] = n
        assert fast.tables == slow.tables and fast._free == slow._free
        after = {g: list(t) for g, t in fast.tables.get(rid, {}).items()}
        assert after == before[1] or fast.version(rid) != before[0]


@settings(max_examples=60, deadline=None)
@given(events=st.lists(st.tuples(st.sampled_from(["step", "join", "leave"]), st.integers(0, 5), st.integers(1, 40)),
                       min_size=1, max_size=80))
def test_engine_tables_kept_between_steps_equal_fresh_ones(events):
    """serve.parts.BlockRows (tables updated in place from step to step) equals block_rows built
    afresh, whatever joins, leaves, boundary crossings and sliding releases happen in between."""
    import torch

    from neffbuild.runtime.kv.tables import BlockTables
    from neffbuild.serve.parts import BlockRows, block_rows

    mgr = BlockManager(400, 4, kv_groups(9))
    rows, live, n = BlockRows(mgr, 3, 16), [], {}  # beyond 3 rows or 16 columns: fresh tensors
    for kind, who, amount in events:
        if kind == "join" and who not in live and len(live) < 5:
            mgr.reserve(who, amount, amount)
            live.append(who)
            n[who] = amount
        elif kind == "leave" and who in live:
            live.remove(who)
            mgr.release(who)
        for k in live:
            n[k] += 1 if kind == "step" else 0
            mgr.reserve(k, n[k] + 1, n[k])
        upto = [n[k] + 1 for k in live]
        wide = amount % 20  # the engine asks for its context bucket's width: any width at least the rows'
        got, want = rows(live, upto, width=wide), block_rows(mgr, live, upto, wide)
        assert set(got) == set(want) and all(torch.equal(got[g], want[g]) for g in want)
        if live and isinstance(got, BlockTables):  # the null columns the step check reads instead of the tensors
            first_null, start, end = got.checked(len(live), 400)
            for r, (frow, srow) in enumerate(zip(want["full"].tolist(), want["sliding"].tolist(), strict=True)):
                assert first_null[r] == (frow.index(0) if 0 in frow else len(frow))
                held = [c for c, b in enumerate(srow) if b]  # the engine's sliding rows: one run of blocks
                assert held == list(range(start[r], end[r])) and (held or start[r] == end[r] == 0)


@pytest.mark.parametrize("ids,why", [([1.5, 2], "integers"), (["3"], "integers"), ([2**63], "integers"),
                                     ([], "1..4"), ([1] * 5, "1..4"), (None, "integers")])
def test_table_buffer_refuses_a_row_it_cannot_hold_and_keeps_the_old_one(ids, why):
    """runtime/kv/tables.py checks a row when it is written: what it cannot store as int64 ids of a width
    the buffer holds is a StepInputError naming the row, and the buffer (tensor and lists) is unchanged."""
    import torch

    from neffbuild.errors import StepInputError
    from neffbuild.runtime.kv.tables import TableBuffer

    buf = TableBuffer(["full", "sliding"], 2, 4)
    buf.write(1, 1, [3, 4, 0])
    view = buf.view(2, 3)
    with pytest.raises(StepInputError, match=f"row 1 \\(sliding\\).*{why}"):
        buf.write(1, 1, ids)
    assert view["sliding"][1].tolist() == [3, 4, 0]
    # (min id, max id, width, first null column, the columns of its run of blocks)
    assert (buf.lo[1][1], buf.hi[1][1], buf.width[1][1], buf.first_null[1][1]) == (0, 4, 3, 2)
    assert (buf.run_start[1][1], buf.run_end[1][1]) == (0, 2)
    assert view.checked(2, 10) is None  # rows never written at width 3
    for r in range(2):
        buf.write(0, r, [7, 0, 0])
    buf.write(1, 0, [0, 2, 5])
    # (first null column of each full row, first and end column of each sliding row's blocks)
    assert view.checked(2, 10) == ([1, 1], [1, 0], [3, 2])
    assert view.checked(2, 5) is None  # id 5 is outside a pool of 5 blocks
    buf.write(0, 1, [7, 3, 9])
    buf.write(1, 1, [3, 0, 4])  # two runs of blocks: no run the check can trust, (0, 0)
    assert view.checked(2, 10) == ([1, 3], [1, 0], [3, 0])  # the verdict follows writes
    buf.write(1, 1, [0, 0, 0])
    assert view.checked(2, 10) == ([1, 3], [1, 0], [3, 0])
    assert torch.equal(view["sliding"], torch.tensor([[0, 2, 5], [0, 0, 0]]))
    assert torch.equal(view["full"], torch.tensor([[7, 0, 0], [7, 3, 9]]))


def test_table_buffer_row_reads_as_its_ids_then_nulls_at_any_width():
    """A write nulls the columns a longer earlier write of the row left, so a view of any width over rows written
    at other widths is exact and trusted (a new context bucket is a new view, not a rewrite of every row)."""
    import torch

    from neffbuild.runtime.kv.tables import TableBuffer

    buf = TableBuffer(["full"], 2, 6)
    buf.write(0, 0, [9, 9, 9, 9, 9, 9])
    buf.write(0, 0, [4, 5])  # shorter: columns 2..5 go back to the null block
    buf.write(0, 1, [7, 8, 3, 2])
    wide, narrow = buf.view(2, 5), buf.view(2, 3)
    assert torch.equal(wide["full"], torch.tensor([[4, 5, 0, 0, 0], [7, 8, 3, 2, 0]]))
    assert torch.equal(narrow["full"], torch.tensor([[4, 5, 0], [7, 8, 3]]))
    # the rows' own first null columns (2, and 4 past the narrow view: the step check also compares with the width)
    assert wide.checked(2, 10) == narrow.checked(2, 10) == ([2, 4], None, None)
    assert narrow.checked(2, 9) == ([2, 4], None, None)  # the 9s written once are gone: a pool of 9 holds the rows
    assert narrow.checked(2, 8) is None  # id 8 is outside a pool of 8 blocks


def test_table_buffer_run_claim_is_checked_not_trusted():
    """Exhaustive at width 4: a row written with the writer's word for its run of blocks (``run``, as BlockRows
    passes the block manager's) keeps exactly what the same row written without it keeps, for every claim, true
    or false, in range or not: the claim only skips a scan when the ids confirm it."""
    import itertools

    from neffbuild.runtime.kv.tables import TableBuffer

    W, seen = 4, 0
    plain, claimed = TableBuffer(["full"], 1, W), TableBuffer(["full"], 1, W)
    claims = [None, (5, 2), (-1, 2), (0, 5)] + [(a, b) for a in range(W + 1) for b in range(a, W + 1)]
    for ids in itertools.product([0, 3, -1], repeat=W):
        plain.write(0, 0, list(ids))
        want = (plain.lo[0][0], plain.hi[0][0], plain.first_null[0][0], plain.run_start[0][0], plain.run_end[0][0])
        for claim in claims:
            claimed.write(0, 0, list(ids), claim)
            got = (claimed.lo[0][0], claimed.hi[0][0], claimed.first_null[0][0], claimed.run_start[0][0],
                   claimed.run_end[0][0])
            assert got == want, (ids, claim)
            seen += claim is not None and claim[0] < claim[1] and all(
                (ids[c] != 0) == (claim[0] <= c < claim[1]) for c in range(W))
    assert seen > 10  # true claims were among them (the skipped scan ran)


@pytest.mark.parametrize("bs,window,q", [(4, 9, 1), (16, 32, 1), (4, 8, 4), (1, 3, 2)])
def test_reserve_fast_path_at_every_position_of_a_decode(bs, window, q):
    """One position at a time through every block boundary and window edge: fast == full route."""
    fast, slow = BlockManager(800, bs, kv_groups(window)), _SlowManager(800, bs, kv_groups(window))
    for mgr in (fast, slow):
        mgr.reserve("r", 5, 5)
    for n in range(5, 300):
        for mgr in (fast, slow):
            mgr.reserve("r", n + q, n)
        assert fast.tables == slow.tables and fast._free == slow._free, n


@pytest.mark.parametrize("group", ["full", "sliding"])
def test_checked_rows_agree_with_the_reference_at_every_position_and_null_column(group):
    """Exhaustive on a small table: a TableBuffer view (step_ok's checked-rows path) with the null block in one
    column (or none), every position and query length: step_ok never says yes where the reference refuses
    (runtime/step/checks.py), so a null block in a live column, even the only one, is never let through; and on
    the rows a block manager writes it says yes exactly where the reference takes the step."""
    from types import SimpleNamespace

    from neffbuild.runtime.kv.tables import TableBuffer
    from neffbuild.runtime.step import checks as step_checks

    bs, W, nb, mml = 4, 4, 9, 16
    layout = SimpleNamespace(block_size=bs, num_blocks=nb)
    for null in (None, 0, 1, 2, 3):
        buf = TableBuffer(["full", "sliding"], 1, W)
        for gi, g in enumerate(("full", "sliding")):
            buf.write(gi, 0, [0 if (g == group and c == null) else c + 1 for c in range(W)])
        view = buf.view(1, W)
        for n in range(mml + 1):
            for q in (1, 2):
                tokens, computed = [[5] * q], [n]
                fast = step_checks.step_ok(tokens, computed, view, 1, 256, bs, nb, mml)
                ref = step_checks._step_reference(tokens, computed, view, k=1, vocab=256, layout=layout,
                                                  max_model_len=mml)
                if fast:
                    assert ref is None, (null, n, q)  # never lets a malformed step through
                # exact for the rows a block manager writes: a sliding row's blocks in one run of columns (the null
                # block at either end, or none); a null between two runs is left to the reference
                if group == "full" or null in (None, 0, W - 1):
                    assert fast == (ref is None), (null, n, q, ref)
