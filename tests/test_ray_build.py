"""Builds on Ray (a local 2-CPU cluster): same cache keys, same manifest, same decoding as local builds."""

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from neffbuild.runtime.bundle.reader import check, open_bundle
from neffbuild.serve.rank import open_rank
from tests.engine_runs import greedy
from tests.helpers import ROOT, assert_failed_target, cache_key, cli, seed_cache, write_recipe

pytestmark = pytest.mark.slow


def _cli(*args, env=None):
    """A process: this one already joined the session's Ray instance (and --executor ray would join it again)."""
    return cli(*args, env=dict(os.environ, **(env or {})), process=True)


def _decode(bundle_path, prompt, new_tokens):
    """Greedy tokens and every step's logits through the bundle's artifacts."""
    session = open_rank(open_bundle(bundle_path))
    logits = []
    gen = greedy(session, [prompt], new_tokens,
                 on_step=lambda plan, lg: logits.append(lg.clone()))
    return gen.tokens, logits, [p.label for p in gen.plans]


@pytest.fixture(scope="module")
def ray_built(ray_cluster, small_checkpoint, tmp_path_factory, built, build_cache):
    """The tiny test model, 2 targets (b1 x ctx 128 + fallback), built on Ray by ``compile --json --executor ray``
    into a cache holding only the session bundle's fallback (the same key): Ray compiles ctx 128 (one compile, not
    two) and the fallback is a hit. Its whole stdout is one JSON document: a Ray build that compiles
    (tests/test_json_output.py holds every other command to it). (recipe, folder, the document)."""
    folder = tmp_path_factory.mktemp("ray")
    path = write_recipe(folder, small_checkpoint, num_seqs_buckets=[1], ctx_buckets=[128], serving__max_num_seqs=1)
    seed_cache(build_cache, folder / "cache", [cache_key(built.bundle, "decode_b1_ctx512")])
    out = _cli("compile", str(path), "-o", str(folder / "out"), "--cache-dir", str(folder / "cache"), "--json",
               "--executor", "ray", "--address", ray_cluster)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout)  # the whole stdout: a log line from Ray or a build before or after fails here
    assert doc["failed"] == [], doc
    return path, folder, SimpleNamespace(built=doc["built"], cached=doc["cached"], bundle=ROOT / doc["bundle"])


def test_ray_bundle_verifies_and_decodes_like_the_local_build(ray_built, built):
    _, _, res = ray_built
    assert (res.built, res.cached) == (1, 1)
    assert check(res.bundle) == []
    ray_m = json.loads((res.bundle / "manifest.json").read_text())
    local_m = json.loads((built.bundle / "manifest.json").read_text())
    local_keys = {a["label"]: a["cache_key"] for a in local_m["artifacts"]}
    assert {a["label"]: a["cache_key"] for a in ray_m["artifacts"]} == {
        lb: local_keys[lb] for lb in ("decode_b1_ctx128", "decode_b1_ctx512")}
    assert "node" not in json.dumps(ray_m) and "built_on" not in json.dumps(ray_m)
    info = json.loads((res.bundle / "build-info.json").read_text())
    assert info["executor"] == "ray" and sorted(info["built_on"]) == ["decode_b1_ctx128"]  # the hit was not built
    # The local bundle also has ctx 256: compare on prompts whose steps run the same labels in both.
    for length, label in ((100, "decode_b1_ctx128"), (300, "decode_b1_ctx512")):
        prompt = [(5 * i + 1) % 256 for i in range(length)]
        toks, logits, labels = _decode(res.bundle, prompt, 6)
        ref_toks, ref_logits, ref_labels = _decode(built.bundle, prompt, 6)
        assert labels == ref_labels == [label] * 5
        assert toks == ref_toks
        assert all(torch.equal(a, b) for a, b in zip(logits, ref_logits, strict=True))

def test_second_ray_build_is_all_cache_hits_and_traces_nothing(ray_built, ray_cluster):
    path, folder, first = ray_built
    out = _cli("compile", str(path), "-o", str(folder / "again"), "--cache-dir", str(folder / "cache"), "--json",
               "--executor", "ray", "--address", ray_cluster)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)  # an all-hits Ray build prints one document too (tests/test_json_output.py's rule)
    assert (doc["built"], doc["cached"], doc["failed"]) == (0, 2, [])
    assert doc["traced"] == 0  # the first Ray build recorded every pre-key in the driver's cache: nothing traced
    assert (Path(doc["bundle"]) / "manifest.json").read_bytes() == (first.bundle / "manifest.json").read_bytes()


def test_failing_target_on_ray_is_reported_like_a_local_failure(ray_built, ray_cluster, small_checkpoint, tmp_path,
                                                               failing_cxx):
    _, folder, _ = ray_built
    path = write_recipe(tmp_path, small_checkpoint, num_seqs_buckets=[1], ctx_buckets=[128], serving__max_num_seqs=1,
                        compiler__target_flags={"decode_b1_ctx128": ["cpp.threads=1"]})
    out_dir = tmp_path / "out"
    res = _cli("compile", str(path), "-o", str(out_dir), "--cache-dir", str(folder / "cache"), "--json",
               "--executor", "ray", "--address", ray_cluster, env=failing_cxx)  # CXX reaches the Ray workers
    assert_failed_target(res, out_dir, label="decode_b1_ctx128", cached=1, needle="failing-cxx")


def test_missing_ray_names_the_extra(tmp_path):
    fake = tmp_path / "noray" / "ray"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named ray')\n")
    res = _cli("compile", "recipes/gpt-oss-tiny.yaml", "-o", str(tmp_path / "out"), "--executor", "ray",
               env={"PYTHONPATH": os.pathsep.join([str(fake.parent), str(ROOT)])})
    assert res.returncode == 1
    assert "neffbuild[ray]" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_memory_estimate_uses_past_peaks_of_the_same_graph(tiny_recipe):
    from neffbuild import grid
    from neffbuild.compiler.graphs import target_graph
    from neffbuild.compiler.ray_executor import BASE_MEMORY, estimate_memory, graph_bytes
    from neffbuild.compiler.worker import Job, graph_summary

    small, big = (t for t in grid.targets(tiny_recipe) if t.label in ("decode_b1_ctx128", "decode_b4_ctx512"))
    jobs = [Job(t.label, target_graph(tiny_recipe, t), {}, "", "") for t in (small, big)]
    assert graph_bytes(jobs[1]) > graph_bytes(jobs[0]) > 0
    assert estimate_memory(jobs[0], []) > BASE_MEMORY
    past = [{"label": small.label, "graph": graph_summary(jobs[0].graph), "peak_rss_bytes": 4 << 30},
            {"label": big.label, "graph": dict(graph_summary(jobs[1].graph), num_blocks=1), "peak_rss_bytes": 9 << 30}]
    assert estimate_memory(jobs[0], past) == int(1.25 * (4 << 30))
    assert estimate_memory(jobs[1], past) == estimate_memory(jobs[1], [])  # another graph's peak does not count


def test_an_address_where_no_cluster_answers_is_refused_first(tmp_path):
    """Before any work, even when every target would be a cache hit (no task would ever connect)."""
    from tests.helpers import TINY, cli
    from tests.s3_server import closed_endpoint

    address = closed_endpoint().removeprefix("http://")
    res = cli("compile", str(TINY), "-o", str(tmp_path / "o"), "--cache-dir", str(tmp_path / "c"),
              "--executor", "ray", "--address", address)
    assert res.returncode == 2 and "no Ray cluster answers there" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and not list((tmp_path / "o").glob("*/manifest.json"))
    res = cli("compile", str(TINY), "-o", str(tmp_path / "o"), "--executor", "ray", "--address", "bogus")
    assert res.returncode == 2 and "HOST:PORT" in res.stderr
