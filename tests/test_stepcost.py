"""Step cost follows the bucket, not the KV pool: the generated code and the measured step time."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from torch import nn

from neffbuild.compiler.backends.inductor import InductorBackend
from neffbuild.compiler.codegen import buffer_shapes, loop_bounds, pool_loops
from neffbuild.fsutil import sha256_file
from neffbuild.runtime.bundle.reader import load_aoti, open_bundle
from tests.conftest import POOL, ROOT
from tests.helpers import cache_key, cli


class _ViewWrite(nn.Module):
    def forward(self, cache, idx, v):  # cache [2, nb, 8]
        cache[0][idx] = v  # through a view of the input: functionalized into whole-buffer copies
        return cache[1][idx].sum()


@pytest.mark.slow
def test_codegen_check_flags_a_write_through_a_view(tmp_path):
    """The check itself fails on the known-bad pattern (the real artifacts below must pass it)."""
    backend = InductorBackend()
    inputs = (torch.zeros(2, POOL, 8), torch.tensor([3, 7]), torch.ones(2, 8))
    path = backend.compile(backend.export(_ViewWrite(), inputs), tmp_path)
    assert pool_loops(path, POOL), loop_bounds(path)
    cache = torch.zeros(2, POOL, 8)
    load_aoti(path, {})(cache, inputs[1], inputs[2])
    assert cache[0, [3, 7]].eq(1).all() and cache.sum() == 16  # the write reached the caller's tensor


@pytest.mark.slow
def test_no_generated_loop_spans_the_kv_pool(built, fp8_built):
    """Every artifact (unpacked KV, and packed FP8 K) writes and reads only the rows and blocks of its step."""
    checked = 0
    for res in (built.result, fp8_built.result):
        bundle = open_bundle(res.bundle)
        assert bundle.kv_layout.num_blocks == POOL
        for entry in bundle.entries.values():
            path = res.bundle / entry["file"]
            assert loop_bounds(path), f"{path}: no loops parsed; the codegen reader is out of date"
            assert pool_loops(path, POOL) == [], f"{entry['label']}: loops over the whole KV pool"
            checked += 1
    assert checked == 7


class _GatheredAttention(nn.Module):
    """The pre-issue-24 read: the named blocks copied into [B, h, T, d], then two einsums over the copy."""

    def forward(self, q, cache, table):  # q [B, 2, h, d]: two query rows, so no matmul is a plain dot
        from neffbuild.runtime.kv.access import gather_blocks

        k, v = (gather_blocks(cache, half, table, False, q.dtype) for half in (0, 1))
        p = torch.einsum("bshd,bhtd->bhst", q, k).softmax(-1)
        return torch.einsum("bhst,bhtd->bshd", p, v)


def _gathered_copies(shapes, batch: int, heads: int, block: int, head_dim: int, tokens: set[int]) -> list:
    """Buffers shaped as a gather of T tokens (T in tokens) takes: [B, W, h, bs, d], [B, h, W, bs, d],
    [B, h, T, d], or the batched-matmul operands [B*h, T, d] and [B*h, d, T] (size-1 dims dropped)."""
    forms = set()
    for t in tokens:
        w = t // block
        forms |= {(batch, w, heads, block, head_dim), (batch, heads, w, block, head_dim), (batch, heads, t, head_dim),
                  (batch * heads, t, head_dim), (batch * heads, head_dim, t)}
    forms = {tuple(n for n in f if n != 1) for f in forms}
    return [s for s in shapes if tuple(n for n in s if n != 1) in forms]


@pytest.mark.slow
def test_attention_reads_blocks_in_place_no_gathered_copy(built, fp8_built, eagle3_built, tmp_path):
    """No plain-decode artifact of a float cache allocates a buffer the size of the gathered KV ([B, h, T, d]
    of either table): attention reads each block through the table inside its loops (target and draft).
    Several query rows (target_spec) and an FP8 cache keep the copy-once read, faster on CPU there
    (kernels/attention.py): those artifacts must show the copy, so the check sees both reads.
    The check flags the old gather-then-einsum read (one small graph compiled here)."""
    backend = InductorBackend()
    q, cache, table = torch.randn(2, 2, 2, 16), torch.randn(2, POOL, 2, 16, 16), torch.tensor([[3, 9], [4, 1]])
    bad = backend.compile(backend.export(_GatheredAttention(), (q, cache, table)), tmp_path)
    assert len(_gathered_copies(buffer_shapes(bad), 2, 2, 16, 16, {32})) >= 2, buffer_shapes(bad)  # K and V copies
    checked, copied = 0, 0
    for res in (built.result, fp8_built.result, eagle3_built.result):
        bundle = open_bundle(res.bundle)
        for entry in bundle.entries.values():
            shapes = buffer_shapes(res.bundle / entry["file"])
            assert shapes, f"{entry['label']}: no buffers parsed; the codegen reader is out of date"
            layout, B = bundle.kv_layout, entry["batch"]
            if entry["family"] == "draft":
                copies = _gathered_copies(shapes, B, layout.draft_kv_heads, layout.block_size, layout.draft_head_dim,
                                          {entry["ctx"]})
            else:
                tokens = {entry["ctx"], bundle.num_swa * layout.block_size}
                copies = _gathered_copies(shapes, B, layout.kv_heads, layout.block_size, layout.head_dim, tokens)
            if entry["query_len"] > 1 or layout.fp8:
                assert copies, f"{entry['label']}: no copy-once gather of the KV {shapes}"
                copied += 1
                continue
            assert copies == [], f"{entry['label']}: buffers of the gathered KV size {copies}"
            checked += 1
    assert (checked, copied) == (8, 5)  # copied: the FP8 bundle and the EAGLE3 target_spec artifacts


@pytest.mark.slow
def test_artifact_that_cannot_load_is_a_load_error_and_no_bundle_appears(built, build_cache, tmp_path):
    """A cache entry whose artifact is damaged (its meta rewritten to match) passes every cache check,
    so only the smoke run can catch it: that target fails as load_error, the others build, no bundle."""
    path, _ = built.recipe, built.result
    cache_copy = tmp_path / "cache"
    shutil.copytree(build_cache, cache_copy)
    meta_file = cache_copy / "v1" / "entries" / cache_key(built.bundle, "decode_b1_ctx128") / "meta.json"
    meta = json.loads(meta_file.read_text())
    artifact = meta_file.parent / meta["file"]
    artifact.write_bytes(artifact.read_bytes()[: meta["bytes"] // 2])
    meta.update(bytes=artifact.stat().st_size, sha256=sha256_file(artifact))
    meta_file.write_text(json.dumps(meta))
    out = tmp_path / "out"
    res = cli("compile", path, "-o", out, "--json", "--cache-dir", cache_copy)
    assert res.returncode == 1, res.stderr
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    [fail] = doc["failed"]
    assert fail["label"] == "decode_b1_ctx128" and fail["kind"] == "load_error", fail
    assert "decode_b1_ctx128" in fail["error"] and "decode_b1_ctx128" in res.stderr
    assert doc["bundle"] is None and doc["cached"] == 5 and not list(out.glob("gpt-oss-test-*/manifest.json"))


@pytest.mark.bench
def test_4x_pool_changes_step_time_by_less_than_1_2x(tiny_recipe, tmp_path):
    """The same decode graph compiled for a pool and a 4x pool: the bucketed step costs the same (interleaved)."""
    import statistics
    import time

    from neffbuild.compiler.graphs import build_graph, target_graph
    from neffbuild.grid import Target
    from neffbuild.models.gpt_oss.weights import model_weights

    cfg = tiny_recipe.model.config
    weights = model_weights(cfg, None, 0)
    backend, runs = InductorBackend(), {}
    for nb in (4099, 4 * 4099):  # a whole-pool copy per step would cost ms here; the step is about 1 ms
        spec = target_graph(tiny_recipe.replace(num_blocks=nb), Target("decode", 1, 128, 1, "decode_b1_ctx128"))
        module, inputs = build_graph(spec)
        (tmp_path / str(nb)).mkdir()
        path = backend.compile(backend.export(module, inputs), tmp_path / str(nb))
        runs[nb] = (load_aoti(path, weights), (*inputs[:5], torch.tensor([21]), torch.tensor([37]), inputs[7]))
    torch.set_num_threads(1)
    samples = {nb: [] for nb in runs}
    for rnd in range(60):
        for nb, (fn, inputs) in runs.items():
            t0 = time.perf_counter()
            fn(*inputs)
            if rnd >= 5:
                samples[nb].append(time.perf_counter() - t0)
    small, big = (statistics.median(samples[nb]) for nb in runs)
    print(f"bucketed step: {small * 1e3:.3f} ms (pool 4099) vs {big * 1e3:.3f} ms (pool 16396): x{big / small:.3f}")
    assert big / small < 1.2


@pytest.mark.slow
def test_bench_cli_reports_every_context_and_plots(built, tmp_path):
    """`neffbuild bench --json --plot`: four contexts, bucketed never reads more than the fallback, a PNG."""
    png = tmp_path / "steps.png"
    res = subprocess.run([sys.executable, "-m", "neffbuild.cli.main", "bench", str(built.bundle), "--json",
                          "--plot", str(png), "--repeat", "3", "--no-dynamic", "--no-startup", "--no-dp"],
                         capture_output=True, text=True, cwd=ROOT, check=False)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    rows = doc["steps"]["rows"]
    assert [r["context"] for r in rows] == [16, 64, 256, 512]  # 1/32, 1/8, 1/2, 1 of max_model_len
    assert [r["ctx_bucket"] for r in rows] == [128, 128, 256, 512]
    for r in rows:
        assert r["bucketed"]["median_ms"] > 0 and r["fallback"]["p90_ms"] >= r["fallback"]["median_ms"]
        assert r["bytes"]["bucketed"] <= r["bytes"]["fallback"] and r["fraction_of_bound"] > 0
        assert "eager" in r and "dynamic" not in r
    assert rows[-1]["bytes"]["bucketed"] == rows[-1]["bytes"]["fallback"]
    assert doc["copy_bandwidth_gbs"] > 0 and doc["plan"]["plan_plus_metadata_us"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
