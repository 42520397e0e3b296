"""Disaggregated inference: the N-1 rule, and two-process DI (real NIXL) against single-process generate."""

import json
import subprocess
import sys

import pytest
import torch

from neffbuild.errors import KVTransferError
from neffbuild.runtime.di.prompt import DIPrompt, di_prompt, strip_leading_null, truncate, unwritten_reads
from neffbuild.runtime.kv.blocks import SLIDING_GROUP, BlockManager, kv_groups
from tests import engine_runs
from tests.conftest import ROOT
from tests.helpers import cli

W, BS = 32, 16  # the tiny model's sliding window and the test bundles' block size
# N % 16 in {0, 1, 15} and others; shorter than, equal to and longer than the window; 47 and 63 are the
# lengths where (N - W + 1) % BS == 0: without the rule the oldest window block is never transferred.
LENGTHS = [1, 5, 15, 16, 17, 31, 32, 33, 47, 49, 63, 100]  # three batches of the largest bucket (4)


# -- the rule itself


def test_n_minus_1_rule():
    p = di_prompt([4, 5, 6], W)
    assert (p.kv_len, p.truncated, p.first_position) == (2, True, 2)
    assert truncate(p, W) == p and truncate(truncate(p, W), W) == p  # idempotent
    assert di_prompt([4, 5, 6], None) == DIPrompt((4, 5, 6), 3)  # no sliding-window layers: unchanged
    assert di_prompt([4], W) == DIPrompt((4,), 1)  # one token: nothing to drop
    assert di_prompt([4, 5, 6], W, _n_minus_1=False).kv_len == 3


def test_strip_leading_null_and_unwritten_reads():
    assert strip_leading_null([0, 0, 7, 0, 9]) == [7, 0, 9]
    assert strip_leading_null([0, 0]) == [] and strip_leading_null([3]) == [3]
    # position 46, window 32: reads positions 15..46 = logical blocks 0..2
    assert unwritten_reads([0, 5, 6], 46, BS, W) == [0]
    assert unwritten_reads([4, 5, 6], 46, BS, W) == []
    assert unwritten_reads([0, 5, 6], 47, BS, W) == []  # position 47 reads 16..47: block 0 is out of its window
    assert unwritten_reads([4, 5], 46, BS) == [2]  # full attention: every block up to the position's


def _first_step_misses(n: int, rule: bool) -> list[int]:
    """Consumer-side accounting: admit the pull, then the first decode step's reservation at position n-1."""
    blocks = BlockManager(64, BS, kv_groups(W))
    kv_len = di_prompt(range(n), W, _n_minus_1=rule).kv_len
    blocks.reserve("r", kv_len, kv_len)
    blocks.reserve("r", n, n - 1)
    return unwritten_reads(blocks.tables["r"][SLIDING_GROUP], n - 1, BS, W)


def test_without_the_rule_the_block_manager_drops_a_block_the_first_step_reads():
    with_rule = {n: _first_step_misses(n, True) for n in range(1, 200)}
    without = {n: _first_step_misses(n, False) for n in range(1, 200)}
    assert not any(with_rule.values())
    broken = sorted(n for n, miss in without.items() if miss)
    assert broken == [n for n in range(W, 200) if (n - W + 1) % BS == 0]  # 47, 63, 79, ...
    assert all(n % BS == BS - 1 for n in broken)


@pytest.mark.parametrize("fp8", [False, True])
def test_prefill_last_logits_equal_a_decode_step_at_that_position(tiny_recipe, tiny_cfg, hf_checkpoint, fp8):
    """What DI relies on: prefill of N tokens and prefill of N-1 plus one decode step agree (FP8 KV too)."""
    from neffbuild.models.gpt_oss import weights
    from neffbuild.runtime.step.stepper import StepBatch
    from neffbuild.serve.parts import block_rows
    from tests.test_gpt_oss import eager_rank

    stacked = weights.stack(tiny_cfg, weights.load_checkpoint(hf_checkpoint))
    for n in (16, 47):
        prompt = _prompts([n])[0]
        whole = eager_rank(tiny_recipe, stacked, fp8=fp8, packed=fp8)
        blocks = whole.block_manager()
        blocks.reserve("a", n, n)
        rows = {g: t[0] for g, t in block_rows(blocks, ["a"], [n]).items()}
        want = whole.prefill(prompt, whole.stepper.kv_caches, rows)[-1]
        split = eager_rank(tiny_recipe, stacked, fp8=fp8, packed=fp8)
        blocks = split.block_manager()
        blocks.reserve("b", n - 1, n - 1)
        rows = {g: t[0] for g, t in block_rows(blocks, ["b"], [n - 1]).items()}
        split.prefill(prompt[:-1], split.stepper.kv_caches, rows)
        blocks.reserve("b", n, n - 1)
        got = split.stepper.step(StepBatch([[prompt[-1]]], [n - 1], block_rows(blocks, ["b"], [n]))).logits[0, -1]
        torch.testing.assert_close(got, want, atol=1e-4 * float(want.abs().max()), rtol=0)
        assert int(got.argmax()) == int(want.argmax())


# -- two processes, real NIXL, compiled bundles


def _prompts(lengths):
    return [[(7 * i + 3 * n) % 250 + 1 for i in range(n)] for n in lengths]


def _single_process(session, prompts, new):
    return engine_runs.greedy(session, prompts, new).tokens


def _di_vs_single(bundle_path, lengths, new=4):
    from neffbuild.runtime.bundle.reader import open_bundle
    from neffbuild.serve.prefill_worker import PrefillGroup
    from neffbuild.serve.rank import open_rank

    session = open_rank(open_bundle(bundle_path))
    out = []
    with PrefillGroup(bundle_path) as worker:
        for i in range(0, len(lengths), 4):  # the bundles' largest batch bucket
            prompts = _prompts(lengths[i:i + 4])
            ref = _single_process(session, prompts, new)
            gen = engine_runs.di(session, worker.port, prompts, new)
            out += list(zip(lengths[i:i + 4], gen.tokens, ref, gen.transfers, strict=True))
    return out


@pytest.mark.slow
def test_generate_di_equals_single_process(built):
    rows = _di_vs_single(built.bundle, LENGTHS)
    assert [n for n, di, ref, _ in rows if di != ref] == []
    kv = {n: t["kv_len"] for n, _, _, t in rows}
    assert kv == {n: max(n - 1, 1) for n in LENGTHS}  # the tiny model has sliding layers: N-1 travels
    assert all(t["bytes"] > 0 for *_, t in rows)


@pytest.mark.slow
def test_generate_di_equals_single_process_packed_fp8(built_fp8):
    rows = _di_vs_single(built_fp8.bundle, [15, 16, 17, 47])
    assert [n for n, di, ref, _ in rows if di != ref] == []


@pytest.mark.slow
def test_n_minus_1_rule_is_needed(built):
    """Rule off on both sides: the first step reads a block never transferred (checked),
    or, unchecked, tokens differ."""
    from neffbuild.runtime.bundle.reader import open_bundle
    from neffbuild.serve.prefill_worker import PrefillGroup
    from neffbuild.serve.rank import open_rank

    path = built.bundle
    session = open_rank(open_bundle(path))
    lengths = [16, 17, 47, 63]
    prompts = _prompts(lengths)
    ref = _single_process(session, prompts, 6)
    # A decode pool holds whatever earlier requests left there: large noise here, so a read of a block that was
    # never transferred shows in the tokens whatever the model's depth (on the 2-layer test model one stale key of
    # one sliding layer's 32 moved no greedy token), while every block that was transferred is overwritten.
    g = torch.Generator().manual_seed(0)
    for buf in session.stepper.kv_caches:
        buf.copy_(torch.randn(buf.shape, generator=g, dtype=buf.dtype) * 100)
    with PrefillGroup(path, _n_minus_1=False) as worker:
        with pytest.raises(KVTransferError, match=r"position 46 reads sliding-group logical blocks \[0\]"):
            engine_runs.di(session, worker.port, prompts, 6, _n_minus_1=False)
        gen = engine_runs.di(session, worker.port, prompts, 6, _n_minus_1=False, check_reads=False)
    differ = [n for n, di, r in zip(lengths, gen.tokens, ref, strict=True) if di != r]
    assert 47 in differ or 63 in differ
    assert 16 not in differ and 17 not in differ  # other residues are unaffected


_cli = cli  # in-process (tests/helpers.py); --di starts its prefill worker process itself


@pytest.mark.slow
def test_generate_di_cli_matches_generate(built):
    args = ["generate", str(built.bundle), "--max-new-tokens", "3", "--json"]
    for p in _prompts([47, 3]):
        args += ["--prompt-ids", ",".join(map(str, p))]
    plain, di = _cli(*args), _cli(*args, "--di")
    assert plain.returncode == 0 and di.returncode == 0, di.stderr
    out = json.loads(di.stdout)
    assert out["tokens"] == json.loads(plain.stdout)["tokens"]
    assert [t["kv_len"] for t in out["transfers"]] == [46, 2]


def test_generate_di_without_nixl_names_the_extra(tmp_path):
    code = ("import sys; sys.modules['nixl_cu12'] = None; sys.modules['nixl'] = None; "
            "from neffbuild.cli.main import main; sys.argv = ['neffbuild'] + sys.argv[1:]; main()")
    res = subprocess.run([sys.executable, "-c", code, "generate", str(tmp_path), "--prompt-ids", "1,2", "--di"],
                         check=False, capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 1, res.stderr
    assert "pip install 'neffbuild[nixl]'" in res.stderr and "Traceback" not in res.stderr


def test_generate_needs_prompts_or_a_request_file(tmp_path):
    res = _cli("generate", str(tmp_path), "--di")  # --di --dp is served now (tests/test_engine.py)
    assert res.returncode == 2 and "--prompt-ids ... or as --requests" in res.stderr
