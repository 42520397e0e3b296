"""needed_seq histogram (runtime) and `neffbuild recommend`: exact optimum against brute force."""

import itertools
import json
from fractions import Fraction

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from neffbuild.cli.main import _register, cli
from neffbuild.recommend import Constraints, cost, optimise, report
from neffbuild.runtime.step.histogram import NeededSeqHistogram, parse_csv, read_csv

_register()

rows_st = st.lists(st.tuples(st.integers(1, 1100), st.integers(0, 9)), min_size=1, max_size=7).filter(
    lambda rows: sum(n for _, n in rows) > 0)


def brute_force(rows, mml, k, tile, min_bucket):
    """Least cost over every set of <= k valid buckets (all multiples of tile, not only candidates)."""
    valid = [b for b in range(tile, mml, tile) if b >= min_bucket]
    return min(cost(rows, s, mml) for r in range(k + 1) for s in itertools.combinations(valid, r))


@settings(max_examples=120, deadline=None)
@given(rows=rows_st, mml=st.sampled_from([128, 300, 640, 1152]), k=st.integers(0, 3),
       tile=st.sampled_from([128, 256]), min_bucket=st.sampled_from([0, 256]))
def test_dp_equals_brute_force(rows, mml, k, tile, min_bucket):
    rows = [(min(s, mml), n) for s, n in rows]
    answers = optimise(rows, mml, k, tile=tile, min_bucket=min_bucket)
    for j, a in enumerate(answers):
        assert len(a.buckets) <= j
        assert all(b % tile == 0 and min_bucket <= b < mml for b in a.buckets)
        assert list(a.buckets) == sorted(set(a.buckets))
        assert a.cost == cost(rows, a.buckets, mml) == brute_force(rows, mml, j, tile, min_bucket)


@settings(max_examples=60, deadline=None)
@given(rows=rows_st, k=st.integers(1, 4))
def test_reported_tokens_per_step_equal_a_direct_recomputation(rows, k):
    mml = 1152
    rows = [(min(s, mml), n) for s, n in rows]
    out = report(rows, Constraints(mml, num_seqs_buckets=3, families=1), k, current=(256,))
    total = sum(n for _, n in rows)

    def direct(buckets):  # per step: each step reads the smallest chosen bucket (or mml) >= its needed_seq
        per_step = [min([b for b in buckets if b >= s] + [mml]) for s, n in rows for _ in range(n)]
        return round(float(Fraction(sum(per_step), total)), 3)

    assert out["expected_tokens_per_step"] == direct(out["buckets"])
    assert out["recipe_tokens_per_step"] == direct([256])
    assert out["fallback_only_tokens_per_step"] == mml
    assert [r["expected_tokens_per_step"] for r in out["table"]] == [direct(r["buckets"]) for r in out["table"]]
    assert out["neffs"] == 3 * (len(out["buckets"]) + 1)
    costs = [r["expected_tokens_per_step"] for r in out["table"]]
    assert costs == sorted(costs, reverse=True)


def test_histogram_csv_round_trip_and_prometheus_parses(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    h = NeededSeqHistogram(max_model_len=512)
    for s in [3, 3, 129, 200, 512]:
        h.record(s)
    back = read_csv(h.write_csv(tmp_path / "h.csv"))
    assert back.rows() == [(3, 2), (129, 1), (200, 1), (512, 1)]
    assert (tmp_path / "h.csv").read_text().splitlines()[0] == "needed_seq,count"
    fam = next(text_string_to_metric_families(h.to_prometheus()))
    assert fam.type == "histogram"
    samples = {(s.name, s.labels.get("le")): s.value for s in fam.samples}
    assert samples[("neffbuild_decode_needed_seq_bucket", "128")] == 2
    assert samples[("neffbuild_decode_needed_seq_bucket", "256")] == 4
    assert samples[("neffbuild_decode_needed_seq_bucket", "512")] == 5
    assert samples[("neffbuild_decode_needed_seq_bucket", "+Inf")] == 5
    assert samples[("neffbuild_decode_needed_seq_sum", None)] == 3 + 3 + 129 + 200 + 512


BAD = [
    ("", "empty file"),
    ("needed_seq\n5\n", "missing column(s) count"),
    ("needed_seq,count\n5,-1\n", "line 2: count -1 must be >= 0"),
    ("needed_seq,count\n5,1.5\n", "line 2: count '1.5' is not an integer"),
    ("needed_seq,count\nabc,1\n", "line 2: needed_seq 'abc' is not an integer"),
    ("needed_seq,count\n0,1\n", "line 2: needed_seq 0 must be >= 1"),
    ("needed_seq,count\n5,1\n600,2\n", "needed_seq 600 is above max_model_len 512"),
    ("needed_seq,count\n", "no decode steps recorded"),
    ("needed_seq,count\n5,0\n", "no decode steps recorded"),
    ("needed_seq,count\n5,1,7\n", "line 2: expected 2 fields, got 3"),
]


@pytest.mark.parametrize("text,message", BAD)
def test_bad_histogram_exits_2_naming_the_problem(tmp_path, text, message):
    path = tmp_path / "h.csv"
    path.write_text(text)
    res = CliRunner().invoke(cli, ["recommend", "--histogram", str(path), "--max-model-len", "512"])
    assert res.exit_code == 2, res.output
    assert message in res.output and str(path) in res.output
    assert "Traceback" not in res.output


def test_recommend_needs_max_model_len_and_checks_the_recipe(tmp_path):
    from tests.conftest import TINY

    path = tmp_path / "h.csv"
    path.write_text("needed_seq,count\n5,1\n")
    res = CliRunner().invoke(cli, ["recommend", "--histogram", str(path)])
    assert res.exit_code == 2 and "--max-model-len" in res.output
    args = ["recommend", "--histogram", str(path), "--recipe", str(TINY), "--max-model-len", "999"]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2 and "disagrees" in res.output


def test_recommend_with_recipe_json_and_snippet(tmp_path):
    from tests.conftest import TINY

    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    a.write_text("needed_seq,count\n5,10\n300,7\n")
    b.write_text("count,needed_seq\n3,130\n2,260\n")  # column order is free; files add up
    args = ["recommend", "--histogram", str(a), "--histogram", str(b), "--recipe", str(TINY), "--max-buckets", "3"]
    out = json.loads(CliRunner().invoke(cli, args + ["--json"]).output)
    rows = [(5, 10), (300, 7), (130, 3), (260, 2)]
    assert out["buckets"] == [128, 256, 384]  # SWA width of the tiny recipe is 128: nothing smaller is allowed
    assert out["expected_tokens_per_step"] == round(cost(rows, [128, 256, 384], 512) / 22, 3)
    assert out["recipe_tokens_per_step"] == round(cost(rows, [128, 256], 512) / 22, 3)
    assert out["neffs"] == 3 * 4 * 1 and out["recipe_neffs"] == 3 * 3
    assert out["neuron_config"] == {"decode_context_length_buckets": [128, 256, 384]}
    text = CliRunner().invoke(cli, args).output
    assert "decode_context_length_buckets: [128, 256, 384]" in text


@pytest.mark.slow
def test_generate_histogram_feeds_recommend(built, tmp_path):
    """The CSV that generate writes counts every decode step at its synced needed_seq."""
    recipe_path, res = built.recipe, built.result
    hist = tmp_path / "gen.csv"
    prompts = ["--prompt-ids", ",".join(["7"] * 140), "--prompt-ids", "1,2,3"]
    r = CliRunner().invoke(cli, ["generate", str(res.bundle), *prompts, "--max-new-tokens", "4",
                                 "--histogram", str(hist), "--json"])
    assert r.exit_code == 0, r.output
    steps = json.loads(r.output.splitlines()[-1])["steps"]
    assert len(steps) == 3
    assert read_csv(hist).rows() == [(141, 1), (142, 1), (143, 1)] == sorted(
        (s["needed_seq"], 1) for s in steps)
    out = CliRunner().invoke(cli, ["recommend", "--histogram", str(hist), "--recipe", str(recipe_path), "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["buckets"] == [256]


def test_parse_csv_sums_duplicate_rows():
    assert parse_csv("needed_seq,count\n5,1\n5,2\n").rows() == [(5, 3)]
