"""The engine's scheduler (neffbuild/serve/scheduler.py) without a compiled bundle: a real BlockManager and a grid.

A "step" here is what the engine does around the artifact: ``admit`` + ``join`` (a local source's prefill is
played by setting ``computed``/``next``/the first token), ``schedule``, then the requests that reached their
``max_new_tokens`` ``finish``. Only public names are read.
"""

from __future__ import annotations

import pytest

from neffbuild.errors import InvalidInput
from neffbuild.runtime.kv.blocks import BlockManager, blocks_needed, kv_groups
from neffbuild.runtime.step.dispatch import Grid
from neffbuild.serve.parts import Request
from neffbuild.serve.scheduler import Scheduler

BS = 16
GRID = Grid((1, 2), (128,), 256)


def _sched(num_blocks=64, max_batch=None, ahead=0, window=None):
    return Scheduler(BlockManager(num_blocks, BS, kv_groups(window)), GRID, max_batch=max_batch, ahead=ahead)


def _req(rid, n, new, arrival=0, index=0):
    return Request(rid, list(range(1, n + 1)), new, arrival, index=index)


def _prefill(reqs):
    """What a local KV source does at admission: the prompt's KV in place, its first token emitted."""
    for r in reqs:
        r.computed, r.next = len(r.prompt), 7
        r.tokens.append(7)


def _step(s: Scheduler, t: int):
    """admit + join + schedule; then every row emits one token and the done ones finish. (admitted ids, decision)."""
    admitted = s.admit(t)
    _prefill(admitted)
    s.join(admitted)
    d = s.schedule(t)
    for r in d.rows:
        r.tokens.append(7)
        r.computed += 1
    s.finish([r for r in d.rows if r.done])
    return [r.id for r in admitted], d


def test_admission_is_arrival_then_file_order_and_a_row_per_request():
    s = _sched(max_batch=2)
    reqs = [_req("late", 10, 5, arrival=1, index=0), _req("b", 10, 5, index=2), _req("a", 10, 5, index=1)]
    s.add(reqs)
    assert [r.id for r in s.waiting] == ["a", "b", "late"]
    ids, d = _step(s, 0)
    assert ids == ["a", "b"] and [r.id for r in d.rows] == ["a", "b"]  # two rows: the largest batch bucket
    assert d.batch.num_computed == [10, 10] and [list(t) for t in d.batch.tokens] == [[7], [7]]
    ids, _ = _step(s, 1)
    assert ids == [] and [r.id for r in s.waiting] == ["late"]  # arrived, but no row is free


def test_a_request_waits_on_a_full_pool_and_nothing_jumps_the_queue():
    need = blocks_needed(50 + 10, BS, kv_groups(None))  # 4 blocks at its longest
    s = _sched(num_blocks=need + 2, max_batch=2)  # the pool budgets one such request (and a small one)
    big, big2, small = _req("big", 50, 10, index=0), _req("big2", 50, 10, index=1), _req("small", 4, 2, index=2)
    s.add([big, big2, small])
    ids, _ = _step(s, 0)
    assert ids == ["big"] and s.used == need  # big2 waits for blocks, and small waits behind it
    for t in range(1, 9):
        assert _step(s, t)[0] == []
    assert big.done and s.used == 0 and s.blocks.held("req-0") == 0  # big left: its budget and blocks came back
    assert _step(s, 9)[0] == ["big2", "small"]  # in queue order, now that the pool holds both


def test_a_joiner_takes_the_row_a_leaver_freed():
    s = _sched(max_batch=2)
    short, long_, joiner = _req("short", 8, 2, index=0), _req("long", 8, 20, index=1), _req("j", 8, 5, 2, index=2)
    s.add([short, long_, joiner])
    _, d = _step(s, 0)
    assert [r.id for r in d.rows] == ["short", "long"]
    assert short.done and s.rows == [None, long_]  # row 0 is free after short left
    ids, d = _step(s, 2)
    assert ids == ["j"] and [r.id for r in d.rows] == ["j", "long"]  # j took row 0; long kept its row


def test_a_free_row_nobody_takes_is_closed_up_from_the_end():
    s = _sched(max_batch=2)
    a, b = _req("a", 8, 2, index=0), _req("b", 8, 9, index=1)
    s.add([a, b])
    _step(s, 0)
    _, d = _step(s, 1)
    assert [r.id for r in d.rows] == ["b"] and d.batch.num_computed == [9]  # b moved up into row 0


def test_idle_steps_skip_to_the_first_arrival_and_an_empty_step_says_there_is_more():
    s = _sched()
    s.add([_req("x", 8, 3, arrival=5)])
    assert s.idle_until(0) == 5  # nothing live: the next step that can run
    d = s.schedule(0)  # a DP rank steps through the idle steps: an empty batch, work still to come
    assert d.rows == [] and list(d.batch.tokens) == [] and d.more
    assert _step(s, 5)[0] == ["x"] and s.idle_until(6) == 6  # something live: no skipping


def test_more_is_false_on_the_last_token_of_the_last_request():
    s = _sched()
    s.add([_req("x", 8, 2)])
    admitted = s.admit(0)
    _prefill(admitted)
    s.join(admitted)
    assert not s.schedule(0).more  # its one token to go is this step's


def test_reserves_hold_the_look_ahead_within_the_budget():
    s = Scheduler(BlockManager(200, BS, kv_groups(32)), GRID, max_batch=2, ahead=32)
    r = _req("x", 20, 40)
    s.add([r])
    _step(s, 0)
    limit = s.blocks.hold_limits("req-0")[0]
    assert limit >= 20 + 1 + 32 - BS  # whole blocks past the step, as far as ahead reaches
    assert s.blocks.held("req-0") <= s.seqs["req-0"].need


def test_a_request_no_pool_could_hold_is_refused_naming_it():
    s = _sched(num_blocks=4)
    with pytest.raises(InvalidInput, match=r"request 'huge': needs \d+ KV blocks at its longest, the bundle's pool "
                                           r"holds 3"):
        s.add([_req("huge", 200, 50)])


@pytest.mark.parametrize("bad", [-1, True, 1.5])
def test_ahead_must_be_a_whole_number_of_tokens(bad):
    with pytest.raises(InvalidInput, match="ahead must be an integer >= 0"):
        _sched(ahead=bad)
