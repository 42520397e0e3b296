"""The serving engine (neffbuild/serve/engine.py): continuous batching, queueing, every mix of parts.

Oracles: each request's tokens equal a solo run of it (greedy is per-request deterministic),
and the unsharded eager model (``--check``). Compiled tests reuse the session bundles.
"""

from __future__ import annotations

import itertools
import json

import pytest

from neffbuild.runtime.step.dispatch import TARGET_NOSPEC, TARGET_SPEC, Grid
from neffbuild.serve.engine import Engine
from neffbuild.serve.parts import LocalPrefill, Request
from tests.conftest import ROOT
from tests.helpers import cli

# id, prompt length, max_new_tokens, arrival: one long request crosses 256 and leaves early,
# six requests for a largest bucket of 4 (two wait), short ones stay to the end
SCHEDULE = [("a", 20, 30, 0), ("long", 240, 24, 2), ("b", 10, 40, 4), ("c", 30, 8, 4), ("d", 50, 12, 5),
            ("e", 5, 45, 6)]


def _requests(schedule=SCHEDULE):
    return [Request(rid, [(7 * i + 3 * n) % 250 + 1 for i in range(n)], new, at, index=k)
            for k, (rid, n, new, at) in enumerate(schedule)]


def _lines(reqs) -> str:
    return "".join(json.dumps({"id": r.id, "prompt_ids": r.prompt, "max_new_tokens": r.max_new_tokens,
                               "arrival": r.arrival}) + "\n" for r in reqs)


_cli = cli  # in-process (tests/helpers.py): no torch import per call; --dp/--di start their processes themselves


def _smallest_bucket_every_step(steps, spec: Grid):
    for s in steps:
        ctx = min(c for c in (*spec.ctx_buckets, spec.max_model_len) if c >= s["needed_seq"])
        batch = min(b for b in spec.num_seqs_buckets if b >= s["num_reqs"])
        assert (s["ctx"], s["batch"]) == (ctx, batch), s


def assert_continuous_batching(steps, reqs: list[dict], spec: Grid):
    """Batch buckets 1 and 4, the batch coming down, the context coming down once the long request left."""
    _smallest_bucket_every_step(steps, spec)
    batches = [s["batch"] for s in steps]
    assert set(batches) == {1, 4}
    assert any(a > b for a, b in itertools.pairwise(batches))  # the batch bucket comes down
    long = next(r for r in reqs if r["id"] == "long")
    ctx_before = {s["ctx"] for s in steps if s["step"] == long["last_step"]}
    ctx_after = {s["ctx"] for s in steps if s["step"] == long["last_step"] + 1}
    assert ctx_before == {512} and ctx_after == {128}
    waited = [r for r in reqs if r["first_step"] > r["arrival"]]
    assert waited, "more requests than the largest bucket: some must wait"
    assert max(s["num_reqs"] for s in steps) == 4


def _serve(session, reqs):
    engine = Engine(session.stepper, session.block_manager(),
                    LocalPrefill(session.prefill, session.stepper.kv_caches))
    engine.run(reqs)
    return engine.stats


@pytest.mark.slow
def test_continuous_batching_equals_solo_runs(built, tmp_path):
    """generate --requests: staggered arrivals, different lengths, two requests waiting; each request's tokens
    are a solo run's; the buckets follow the live batch down as well as up."""
    from neffbuild.runtime.bundle.reader import open_bundle
    from neffbuild.serve.rank import open_rank

    path = tmp_path / "reqs.jsonl"
    path.write_text(_lines(_requests()))
    res = _cli("generate", str(built.bundle), "--requests", str(path), "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    session = open_rank(open_bundle(built.bundle, preload=True))
    for r, got in zip(_requests(), out["requests"], strict=True):
        alone = Request(r.id, r.prompt, r.max_new_tokens)
        _serve(session, [alone])
        assert (got["id"], got["arrival"], got["tokens"]) == (r.id, r.arrival, alone.tokens), r.id
        assert got["arrival"] <= got["first_step"] <= got["last_step"]
    assert_continuous_batching(out["steps"], out["requests"], session.stepper.grid)
    assert "metrics" not in out and "neffbuild_neff_execution_count" not in res.stderr  # only when asked


def _over_budget(engine) -> list:
    """(key, blocks held, budget) of every live request holding more than admission budgeted for it."""
    held = engine.blocks.held
    return [(k, held(k), seq.need) for k, seq in engine.scheduler.seqs.items() if held(k) > seq.need]


@pytest.mark.slow
def test_look_ahead_changes_tables_less_often_within_each_requests_budget(built):
    """``Scheduler.ahead``: every reserve holds whole blocks past the step, as far as the pool can spare for
    max_batch requests at max_model_len. The tokens and step log equal the engine without it; every request
    holds at most its admission budget at every step (a sliding group keeps more blocks, within it); the
    tables change far less often (the block manager's ``tick``). A pool at the recipe's formula minimum
    gets no look-ahead."""
    from neffbuild.runtime.bundle.reader import open_bundle
    from neffbuild.runtime.kv.blocks import BlockManager, min_pool_blocks
    from neffbuild.serve.rank import open_rank

    session = open_rank(open_bundle(built.bundle, preload=True))
    runs, over = {}, []
    for ahead in (0, None):
        reqs, blocks = _requests(), session.block_manager()
        engine = Engine(session.stepper, blocks, LocalPrefill(session.prefill, session.stepper.kv_caches), ahead=ahead)
        engine.on_step = lambda plan, out, e=engine: over.extend(_over_budget(e))
        engine.run(reqs)
        runs[ahead] = ([r.tokens for r in reqs], [(s["label"], s["num_reqs"], s["step"]) for s in engine.stats.steps],
                       blocks.tick, engine.scheduler.ahead)
    assert not over, over[:3]
    assert runs[None][:2] == runs[0][:2]
    assert runs[None][3] > 0 and runs[None][3] % blocks.block_size == 0
    assert runs[None][2] * 2 <= runs[0][2], (runs[None][2], runs[0][2])  # table changes at least halved
    grid, groups = session.stepper.grid, blocks.groups
    tight = min_pool_blocks(grid.max_model_len, blocks.block_size, groups, num_seqs=grid.num_seqs_buckets[-1])
    assert Engine(session.stepper, BlockManager(tight, blocks.block_size, groups), None).scheduler.ahead == 0


@pytest.mark.parametrize("line, needle", [
    ("not json", ":2: not a JSON object"),
    ('{"id": "x", "prompt_ids": []}', ":2: field 'prompt_ids'"),
    ('{"id": "x", "prompt_ids": [1], "max_new_tokens": 0}', ":2: field 'max_new_tokens'"),
    ('{"id": "x", "prompt_ids": [1], "arrival": -1}', ":2: field 'arrival'"),
    ('{"id": "x", "prompt_ids": [1], "colour": 1}', ":2: unknown field 'colour'"),
    ('{"id": "a", "prompt_ids": [1]}', ":2: field 'id': 'a' repeats line 1's id"),
])
def test_bad_request_line_exits_2_naming_line_and_field(tmp_path, line, needle):
    path = tmp_path / "reqs.jsonl"
    path.write_text('{"id": "a", "prompt_ids": [1, 2]}\n' + line + "\n")
    res = _cli("generate", str(tmp_path), "--requests", str(path), "--json")  # no bundle there: refused first
    assert res.returncode == 2, res.stderr
    assert needle in json.loads(res.stdout)["error"]["message"] and "Traceback" not in res.stderr


def _prompt_args(prompts):
    return [a for p in prompts for a in ("--prompt-ids", ",".join(map(str, p)))]


EIGHT = [[(5 * i + 11 * n) % 250 + 1 for i in range(n)] for n in (3, 40, 7, 90, 12, 1, 60, 25)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", [[], ["--spec"]], ids=["plain", "spec"])
def test_eight_prompts_on_a_largest_bucket_of_two(eagle3_built, mode):
    """eagle3_built's largest batch bucket is 2: eight prompts queue, all complete with their solo tokens."""
    bundle = str(eagle3_built.bundle)
    res = _cli("generate", bundle, *_prompt_args(EIGHT), "--max-new-tokens", "9", "--json", "--check", *mode)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    assert out["check"]["ok"] and [len(t) for t in out["tokens"]] == [9] * 8
    assert max(s["num_reqs"] for s in out["steps"]) == 2
    solo = [json.loads(_cli("generate", bundle, *_prompt_args([p]), "--max-new-tokens", "9", "--json").stdout)
            ["tokens"][0] for p in EIGHT[:3]]  # the reference above is the batch-independent oracle; spot-check solo
    assert out["tokens"][:3] == solo


def assert_nospec_after_each_transfer(out, dp: int):
    """On every rank, a transferred request's first step carries no drafts of its own (no aux states yet): the step
    runs target_nospec, unless a request that joined earlier is still running and carries drafts, when it runs
    target_spec with the new request's row padded (the runtime's per-row drafts rule); later steps speculate."""
    for r in out["ranks"]:
        fam = {s["step"]: s["family"] for s in r["steps"]}
        mine = out["requests"][r["dp_rank"]::dp]
        assert mine
        for q in mine:
            older = [o for o in mine if o["first_step"] < q["first_step"] <= o["last_step"]]
            assert fam[q["first_step"]] == TARGET_NOSPEC or (fam[q["first_step"]] == TARGET_SPEC and older), q
        assert TARGET_SPEC in fam.values()


@pytest.mark.slow
def test_spec_di_dp2_on_an_unsharded_bundle_equals_plain(eagle3_built):
    """--spec --di --dp 2: each DP rank pulls its own requests' KV; the first step after a transfer runs
    without spec, later ones with; the tokens are plain greedy's."""
    args = [str(eagle3_built.bundle), *_prompt_args(EIGHT[:4]), "--max-new-tokens", "12", "--json"]
    plain, mixed = _cli("generate", *args), _cli("generate", *args, "--spec", "--di", "--dp", "2")
    assert plain.returncode == 0 and mixed.returncode == 0, mixed.stderr[-3000:]
    plain, mixed = json.loads(plain.stdout), json.loads(mixed.stdout)
    assert mixed["tokens"] == plain["tokens"]
    assert [t["id"] for t in mixed["transfers"]] == ["0", "1", "2", "3"]
    assert_nospec_after_each_transfer(mixed, 2)


PRODUCTION_SPEC = ["--requests", str(ROOT / "docs" / "examples" / "production-requests.jsonl"), "--spec", "--json"]


@pytest.fixture(scope="module")
def production_spec(production_built):
    """`generate --requests --spec --check` of the production bundle, run once (greedy: the same tokens every run,
    --check only adds the eager reference after): what the greedy test checks and the reference of both DI
    variants below."""
    res = _cli("generate", str(production_built), *PRODUCTION_SPEC, "--check")
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout)


@pytest.mark.slow
def test_production_tiny_spec_equals_unsharded_greedy(production_spec):
    """tp 2 x dp 2 x ep 4, EAGLE3, packed FP8: --requests --spec gives the unsharded model's greedy tokens."""
    out = production_spec
    assert out["check"]["ok"], out["check"]
    assert len(out["ranks"]) == 4 and all(TARGET_SPEC in {s["family"] for s in r["steps"]} for r in out["ranks"])
    labels = [[s["label"] for s in r["steps"]] for r in out["ranks"]]
    assert all(x == labels[0] for x in labels)  # every rank ran the same artifact every step


@pytest.mark.slow
def test_production_tiny_spec_di(production_built, production_spec):
    """--spec --di on the sharded bundle: the tokens of --spec; per rank the first step after a transfer is
    target_nospec and later steps include target_spec. (A prefill TP other than the decode's, 1 into tp 2, is
    tests/test_di_hetero.py's, on the tp 2 bundle: here it would run the 4-rank production job a third time.)"""
    di = _cli("generate", str(production_built), *PRODUCTION_SPEC, "--di", "--prefill-tp", "2")
    assert di.returncode == 0, di.stderr[-3000:]
    spec, di = production_spec, json.loads(di.stdout)
    assert di["tokens"] == spec["tokens"]
    assert_nospec_after_each_transfer(di, 2)
