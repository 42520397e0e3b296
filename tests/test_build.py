"""Build pipeline: artifacts vs eager, shared weights, cache, crash safety, failures, verify."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from neffbuild import recipe as R
from neffbuild.compiler.builder import compile_recipe
from neffbuild.compiler.cache import Cache
from neffbuild.compiler.graphs import build_graph, target_graph
from neffbuild.errors import BundleError, IncompatibleBundle
from neffbuild.models.gpt_oss.decode import GptOssDecode
from neffbuild.runtime.bundle.reader import check, open_bundle
from neffbuild.runtime.step import attn_metadata
from neffbuild.runtime.step.stepper import StepBatch
from neffbuild.serve.parts import block_rows
from neffbuild.serve.rank import open_rank
from neffbuild.serve.run import prometheus
from tests.helpers import POOL, ROOT, TINY, assert_failed_target, cache_key, cli, seed_cache, write_recipe

pytestmark = pytest.mark.slow


_cli = cli  # in-process (tests/helpers.py); the kill, Ctrl-C and concurrency tests below start real processes


def test_artifacts_match_eager_on_prefilled_cache(built):
    res = built.result
    b = open_bundle(res.bundle, verify="full")
    cfg = R.load(built.recipe).model.config
    eager = GptOssDecode(cfg, b.weights).eval()
    session = open_rank(b)
    blocks, kv = session.block_manager(), session.stepper.kv_caches
    prompts = [list(range(5, 100)), [3, 4, 5], [(i * 11) % 256 for i in range(60)]]
    for rid, p in enumerate(prompts):  # prefill, then one compiled step
        blocks.reserve(rid, len(p), len(p))
        session.prefill(p, kv, {g: t[0] for g, t in block_rows(blocks, [rid], [len(p)]).items()})
    computed = torch.tensor([len(p) for p in prompts])
    for rid, c in enumerate(computed.tolist()):
        blocks.reserve(rid, c + 1, c)
    tables = block_rows(blocks, range(3), computed + 1)
    out = session.stepper.step(StepBatch([[1], [2], [3]], computed.tolist(), tables))
    assert 'neffbuild_neff_execution_count{bucket="decode_b4"} 1' in prometheus([out.plan])
    assert "neffbuild_batch_padding_ratio 0.250000" in prometheus([out.plan])  # 3 live rows of 4
    computed += 1
    for rid, c in enumerate(computed.tolist()):
        blocks.reserve(rid, c + 1, c)
    tables = block_rows(blocks, range(3), computed + 1)
    checked = 0
    for label, entry in b.entries.items():
        if entry["batch"] < 3 or entry["ctx"] < int(computed.max()) + 1:
            continue
        inputs = attn_metadata.build(torch.tensor([[7], [8], [9]]), computed, tables["full"], tables["sliding"],
                                     batch=entry["batch"], ctx=entry["ctx"], block_size=b.kv_layout.block_size,
                                     num_swa=b.num_swa)
        kv_a = [t.clone() for t in kv]
        kv_b = [t.clone() for t in kv]
        with torch.no_grad():
            want = eager(*inputs.as_args(kv_a))
        got = b.artifact(label)(*inputs.as_args(kv_b))
        torch.testing.assert_close(got[:3], want[:3], atol=1e-5, rtol=1e-5)  # logits ~6: fp32 reduction order
        torch.testing.assert_close(kv_b[0], kv_a[0], atol=1e-5, rtol=0)  # KV written in place, same values
        checked += 1
    assert checked == 3  # decode_b4 at ctx 128, 256 and 512: every bucket >= needed (97)


def test_artifacts_share_one_weight_copy(built):
    """Bound as user-managed constants: editing the mmapped weights in place changes every artifact."""
    b = open_bundle(built.bundle)
    recipe = R.load(built.recipe)
    spec = target_graph(recipe, [t for t in __import__("neffbuild.grid").grid.targets(recipe)
                                 if t.label == "decode_b1_ctx128"][0])
    _, inputs = build_graph(spec)
    before = {lb: b.artifact(lb)(*inputs[:7], tuple(t.clone() for t in inputs[7])) for lb in ("decode_b1_ctx128",)}
    ptr = b.weights["lm_head"].data_ptr()
    b.weights["lm_head"].mul_(2.0)  # private mapping: copy-on-write, the file is untouched
    assert b.weights["lm_head"].data_ptr() == ptr
    after = b.artifact("decode_b1_ctx128")(*inputs[:7], tuple(t.clone() for t in inputs[7]))
    torch.testing.assert_close(after, before["decode_b1_ctx128"] * 2, rtol=1e-5, atol=1e-6)
    assert not check(built.bundle)  # the bundle on disk is unchanged


def test_second_compile_is_all_cache_hits_and_manifest_is_identical(built, build_cache, tmp_path):
    path, first = built.recipe, built.result
    manifest_1 = (first.bundle / "manifest.json").read_bytes()
    t0 = time.monotonic()
    res = compile_recipe(R.load(path), tmp_path / "again", jobs=2, cache_root=build_cache)
    wall = time.monotonic() - t0
    assert (res.built, res.cached, res.failed) == (0, 6, [])
    assert res.traced == 0  # pre-key hits: nothing traced, no worker started
    assert (res.bundle / "manifest.json").read_bytes() == manifest_1
    print(f"second compile: {wall:.1f}s, 0 compiler invocations, 0 traces")


def test_plan_explains_misses_and_one_bucket_change_rebuilds_num_seqs_targets(built, build_cache, compile_pool,
                                                                              small_checkpoint, tmp_path):
    path = write_recipe(tmp_path, small_checkpoint, ctx_buckets=[128, 384])
    res = _cli("plan", str(path), "--json", env=dict(os.environ, NEFFBUILD_CACHE_DIR=str(build_cache)))
    assert res.returncode == 0, res.stderr
    rows = {t["label"]: t for t in json.loads(res.stdout)["targets"]}
    to_build = sorted(lb for lb, t in rows.items() if t["cache"] == "build")
    assert to_build == ["decode_b1_ctx384", "decode_b4_ctx384"]
    assert "shape" in rows["decode_b1_ctx384"]["why"] or "no cached entry" in rows["decode_b1_ctx384"]["why"]
    assert rows["decode_b1_ctx384"]["estimate_s"] > 0
    res = compile_recipe(R.load(path), tmp_path / "out", cache_root=build_cache, executor=compile_pool)
    assert (res.built, res.cached) == (2, 4)  # |num_seqs| x 1 family


def test_plan_why_names_the_changed_flag(built, build_cache, small_checkpoint, tmp_path):
    """The b1 targets only (decode_b1_ctx128 and the fallback: the keys of the session bundle's b1 graphs, as
    the Ray build shows), so plan traces 2 graphs, not 6; the row checked is the same."""
    path = write_recipe(tmp_path, small_checkpoint, num_seqs_buckets=[1], ctx_buckets=[128], serving__max_num_seqs=1,
                        compiler__flags=["max_autotune=false"])
    res = _cli("plan", str(path), "--json", env=dict(os.environ, NEFFBUILD_CACHE_DIR=str(build_cache)))
    row = [t for t in json.loads(res.stdout)["targets"] if t["label"] == "decode_b1_ctx128"][0]
    assert row["cache"] == "build" and "flags" in row["why"] and "max_autotune=false" in row["why"]


def test_failing_target_is_classified_and_others_are_built(built, build_cache, small_checkpoint, tmp_path, failing_cxx):
    path = write_recipe(tmp_path, small_checkpoint, compiler__target_flags={"decode_b1_ctx128": ["cpp.threads=1"]})
    out = tmp_path / "out"
    res = _cli("compile", str(path), "-o", str(out), "--json", "--cache-dir", str(build_cache),
               env=dict(os.environ, **failing_cxx))  # the one changed target compiles, with a refusing compiler
    assert_failed_target(res, out, label="decode_b1_ctx128", cached=5, needle="failing-cxx")
    assert all(e["label"] != "decode_b1_ctx128" or "cpp.threads=1" not in str(e.get("fingerprint"))
               for e in Cache(build_cache).list())  # the failure was not cached


def _valid_cache(root: Path) -> None:
    entries = root / "v1" / "entries"
    for folder in entries.iterdir() if entries.is_dir() else []:
        assert Cache(root).get(folder.name) is not None, f"corrupt cache entry {folder}"


def test_kill_9_at_random_moments_then_resume(built, build_cache, small_checkpoint, tmp_path):
    """Kills while decode_b2_ctx512 compiles; decode_b4_ctx512 is the session bundle's entry (seeded), so the
    resume compiles one key, not a second copy of a key the session already built."""
    import random

    path = write_recipe(tmp_path, small_checkpoint, name="killme", num_seqs_buckets=[2, 4], ctx_buckets=[512])
    b4_key = cache_key(built.bundle, "decode_b4_ctx512")
    cache, out = seed_cache(build_cache, tmp_path / "cache", [b4_key]), tmp_path / "out"
    args = [sys.executable, "-m", "neffbuild.cli.main", "compile", str(path), "-o", str(out), "--cache-dir", str(cache),
            "--jobs", "2"]
    rng = random.Random(int(os.environ.get("NEFFBUILD_TEST_SEED", "7")))
    for delay in (rng.uniform(2, 8), rng.uniform(8, 14)):  # starting the pool; in the target's compile
        proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        time.sleep(delay)
        assert proc.poll() is None, "compile ended before the kill: the test would prove nothing"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        time.sleep(0.5)
        assert not (out / "killme-0.1.0").exists(), "a half-written bundle became visible"
        _valid_cache(cache)
    res = subprocess.run(args + ["--json"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert not check(out / "killme-0.1.0")
    assert cache_key(out / "killme-0.1.0", "decode_b4_ctx512") == b4_key  # the same graph as the session's
    assert not [p for p in out.iterdir() if p.name.startswith(".")], "temp folders were not swept"
    _valid_cache(cache)


def _copy(bundle: Path, tmp_path: Path) -> Path:
    dest = tmp_path / bundle.name
    shutil.copytree(bundle, dest)
    return dest


def _edit_manifest(b: Path, fn) -> None:
    """Edit the manifest and rewrite its digest, so the checks behind the digest are what is tested."""
    import hashlib

    m = json.loads((b / "manifest.json").read_text())
    fn(m)
    text = json.dumps(m)
    (b / "manifest.json").write_text(text)
    (b / "manifest.sha256").write_text(f"{hashlib.sha256(text.encode()).hexdigest()}  manifest.json\n")


def _flip(b):
    p = b / "artifacts" / "decode_b1_ctx128.pt2"
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))
    return "artifacts/decode_b1_ctx128.pt2"


def _truncate(b):
    p = b / "weights" / "model.safetensors"
    p.write_bytes(p.read_bytes()[:-100])
    return "weights/model.safetensors"


def _missing(b):
    (b / "artifacts" / "decode_b4_ctx512.pt2").unlink()
    return "artifacts/decode_b4_ctx512.pt2"


def _escape(rel):
    def edit(b):
        def fn(m):
            m["files"][rel] = {"sha256": "0" * 64, "bytes": 1}
        _edit_manifest(b, fn)
        return rel
    return edit


def _symlink(b):
    (b / "artifacts" / "link.pt2").symlink_to(b / "artifacts" / "decode_b1_ctx128.pt2")
    _escape("artifacts/link.pt2")(b)
    return "artifacts/link.pt2"


def _newer(b):
    _edit_manifest(b, lambda m: m.update(format_version=99))
    return "format_version 99"


@pytest.mark.parametrize("damage", [_flip, _truncate, _missing, _escape("../x"), _escape("/etc/passwd"), _symlink,
                                    _newer],
                         ids=["flipped-byte", "truncated-weights", "missing-file", "dotdot", "absolute", "symlink",
                              "newer-format"])
def test_verify_catches(built, tmp_path, damage):
    b = _copy(built.bundle, tmp_path)
    named = damage(b)
    res = _cli("verify", str(b))
    assert res.returncode == 1 and named in res.stderr and "Traceback" not in res.stderr, res.stderr
    with pytest.raises(BundleError, match=named.replace("/", ".").replace("..", r"\.\.")[:20]):
        open_bundle(b, verify="full")


def test_open_bundle_refuses_other_torch(built, tmp_path):
    b = _copy(built.bundle, tmp_path)
    _edit_manifest(b, lambda m: m["toolchain"].update(torch="2.11.0+cpu"))
    with pytest.raises(IncompatibleBundle, match=r"compiled by torch 2\.11\.0"):
        open_bundle(b)


def test_stdlib_reader_from_the_spec_parses_a_bundle(built):
    """Written from docs/bundle-format.md alone: json + hashlib + pathlib, ~30 lines."""
    import hashlib

    def read_bundle(root):
        root = Path(root)
        m = json.loads((root / "manifest.json").read_text())
        if m["format"] != "neffbuild-bundle" or m["format_version"] > 4:
            raise ValueError("unsupported bundle")
        for rel, info in m["files"].items():
            parts = Path(rel).parts
            if Path(rel).is_absolute() or ".." in parts or "\\" in rel:
                raise ValueError(f"unsafe path {rel}")
            p = root / rel
            if p.is_symlink() or p.stat().st_size != info["bytes"]:
                raise ValueError(f"bad size {rel}")
            if hashlib.sha256(p.read_bytes()).hexdigest() != info["sha256"]:
                raise ValueError(f"bad sha256 {rel}")
        for a in m["artifacts"]:
            assert a["file"] in m["files"]
        grid = sorted((a["batch"], a["ctx"]) for a in m["artifacts"])
        header_len = int.from_bytes((root / m["weights"]["file"]).read_bytes()[:8], "little")
        return m["name"], m["version"], grid, header_len

    name, version, grid, header_len = read_bundle(built.bundle)
    assert (name, version) == ("gpt-oss-test", "0.1.0") and header_len > 0
    assert grid == [(1, 128), (1, 256), (1, 512), (4, 128), (4, 256), (4, 512)]


def test_inspect_and_diff(built, tmp_path):
    res = _cli("inspect", str(built.bundle), "--json")
    doc = json.loads(res.stdout)
    assert doc["totals"]["artifacts"] == 6 and doc["name"] == "gpt-oss-test"
    b = _copy(built.bundle, tmp_path)
    _edit_manifest(b, lambda m: (m["artifacts"].pop(0), m["graph_inputs"].update(num_blocks=1024)))
    d = json.loads(_cli("diff", str(built.bundle), str(b), "--json").stdout)
    assert d["removed"] == ["decode_b1_ctx128"] and d["config"]["graph_inputs.num_blocks"] == [POOL, 1024]
    html = (built.bundle / "report.html").read_text()
    assert "decode_b4_ctx512" in html and "compile s" in html
    prom = (built.bundle / "metrics" / "compile.prom").read_text()
    assert 'neffbuild_compilation_time_seconds{bucket="decode_b4_ctx512"}' in prom


def test_diff_names_every_changed_recipe_field(built, build_cache, tmp_path):
    """Two builds of one grid that differ only in random weights and version: no artifact changed (6 cache
    hits: the graphs are the session bundle's), but diff names both fields and the weights."""
    bundles = []
    for seed, version in ((0, "0.1.0"), (1, "0.2.0")):
        raw = yaml.safe_load(Path(built.recipe).read_text())
        raw.update(version=version)
        model = yaml.safe_load(TINY.read_text())["model"]  # the checkpoint's config: small_checkpoint's 2 layers
        model["config"]["num_hidden_layers"] = 2
        raw["model"] = dict(model, random_seed=seed)
        path = tmp_path / f"seed{seed}.yaml"
        path.write_text(yaml.safe_dump(raw))
        res = compile_recipe(R.load(path), tmp_path / f"out{seed}", jobs=1, cache_root=build_cache)
        assert (res.built, res.cached, res.failed) == (0, 6, [])
        bundles.append(res.bundle)
    d = json.loads(_cli("diff", *bundles, "--json").stdout)
    assert d["changed"] == [] and d["weights_changed"] is True
    assert d["config"]["bundle.version"] == ["0.1.0", "0.2.0"]
    assert d["config"]["recipe.model.random_seed"] == [0, 1] and d["config"]["recipe.version"] == ["0.1.0", "0.2.0"]
    text = _cli("diff", *bundles).stdout
    assert "config recipe.model.random_seed: 0 -> 1" in text and "config bundle.version: '0.1.0' -> '0.2.0'" in text
    same = _cli("diff", bundles[0], bundles[0]).stdout
    assert "config: no field changed" in same and "weights changed: False" in same


def _read_lines(stream, into: list) -> threading.Thread:
    t = threading.Thread(target=lambda: into.extend(iter(stream.readline, "")), daemon=True)
    t.start()
    return t


def test_ctrl_c_stops_cleanly(small_checkpoint, tmp_path):
    """Ctrl-C while the target compiles (its progress line says so: stderr is a pipe, so progress comes as
    plain lines, before anything finishes): exit 130, nothing in the output folder, a valid cache."""
    path = write_recipe(tmp_path, small_checkpoint, name="interrupt", num_seqs_buckets=[4], ctx_buckets=[512])
    out = tmp_path / "out"
    # As a terminal's shell starts it: SIGINT handled, even when this suite runs as a background job
    # (which inherits SIGINT ignored, and the CLI would then never see the Ctrl-C).
    code = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "from neffbuild.cli.main import main; sys.argv = ['neffbuild', *sys.argv[1:]]; main()")
    proc = subprocess.Popen([sys.executable, "-c", code, "compile", str(path), "-o", str(out),
                             "--cache-dir", str(tmp_path / "cache")], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines: list[str] = []
    reader = _read_lines(proc.stderr, lines)
    deadline = time.monotonic() + 120
    while not any(line.rstrip().endswith("decode_b4_ctx512: started") for line in lines):
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
        time.sleep(0.2)
    time.sleep(1)
    assert proc.poll() is None, "compile ended before the interrupt"
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends
    proc.wait(timeout=60)
    reader.join(timeout=10)
    err = "".join(lines)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert [line.split("s  ", 1)[1] for line in err.splitlines() if line.startswith("compile")][:3] == [
        "loading weights", "1 targets (largest first)", "decode_b4_ctx512: started"], err
    assert not out.exists() or not list(out.iterdir()), "nothing may be left in the output folder"
    _valid_cache(tmp_path / "cache")


def test_concurrent_builds_share_a_cache_and_compile_each_key_once(small_checkpoint, tmp_path, built, build_cache):
    """Two processes, one cold key: the key's lock makes one compile and the other wait for its entry (the 2-layer
    model: what is under test is the lock around a real compile, not the graph). That cold compile and the session
    bundle's of the same key (decode_b4_ctx512), two independent compiles in different caches and processes, give
    byte-identical manifests: the manifest names artifacts only (timings differ, in build-info.json)."""
    path = write_recipe(tmp_path, small_checkpoint, name="twice", num_seqs_buckets=[4], ctx_buckets=[512])
    cache = tmp_path / "cache"
    procs = [subprocess.Popen([sys.executable, "-m", "neffbuild.cli.main", "compile", str(path), "-o",
                               str(tmp_path / f"out{n}"), "--cache-dir", str(cache), "--jobs", "1", "--json"],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in (0, 1)]
    docs = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
        docs.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted((d["built"], d["cached"]) for d in docs) == [(0, 1), (1, 0)]  # one compile, one hit
    _valid_cache(cache)
    a, b = (Path(d["bundle"]) / "manifest.json" for d in docs)
    assert a.read_bytes() == b.read_bytes()
    session_key = cache_key(built.bundle, "decode_b4_ctx512")
    assert cache_key(a.parent, "decode_b4_ctx512") == session_key
    seeded = seed_cache(build_cache, tmp_path / "seeded", [session_key])
    session = compile_recipe(R.load(path), tmp_path / "session-out", jobs=1, cache_root=seeded)
    assert (session.built, session.cached) == (0, 1)
    assert (session.bundle / "manifest.json").read_bytes() == a.read_bytes()
    info = json.loads((a.parent / "build-info.json").read_text())
    assert set(info["compile_seconds"]) <= {"decode_b4_ctx512"}  # per-build records stay out of the manifest


def test_timeout_is_classified(small_checkpoint, tmp_path):
    path = write_recipe(tmp_path, small_checkpoint, name="slow", num_seqs_buckets=[4], ctx_buckets=[512])
    res = _cli("compile", str(path), "-o", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"),
               "--timeout", "3", "--json")
    assert res.returncode == 1
    [fail] = json.loads(res.stdout.strip().splitlines()[-1])["failed"]
    assert fail["kind"] == "timeout" and "3s" in fail["error"]
    assert "timeout" in Path(fail["log"]).read_text()
    _valid_cache(tmp_path / "cache")


def test_cache_cli(built, build_cache, tmp_path):
    res = _cli("cache", "ls", "--json", "--cache-dir", str(build_cache))
    labels = {e["label"] for e in json.loads(res.stdout)}
    assert {"decode_b1_ctx128", "decode_b4_ctx512"} <= labels
    assert _cli("cache", "path", "--cache-dir", str(build_cache)).stdout.strip() == str(build_cache)
    copy = tmp_path / "c"
    shutil.copytree(build_cache, copy)
    n = len(Cache(copy).list())
    res = _cli("cache", "clear", "--yes", "--cache-dir", str(copy))
    # clear removes the cache's own versioned tree only (issue 25: a --cache-dir of $HOME must survive it)
    assert res.returncode == 0 and f"removed {n} entries" in res.stdout and n > 0
    assert not Cache(copy).base.exists() and copy.is_dir() and Cache(copy).list() == []


def test_packed_fp8_kv_bundle_matches_eager(fp8_built):
    """float8_e4m3fn KV with packed K survives export + AOTInductor: compiled tokens == eager tokens."""
    res = fp8_built.result
    assert not res.failed and res.built + res.cached == 1
    m = json.loads((res.bundle / "manifest.json").read_text())
    assert m["graph_inputs"]["kv_layout"]["dtype"] == "float8_e4m3fn" and m["graph_inputs"]["kv_layout"]["packed_k"]
    gen = _cli("generate", str(res.bundle), "--prompt-ids", ",".join(map(str, range(3, 70))), "--prompt-ids", "9,8,7",
               "--max-new-tokens", "24", "--check", "--json")
    assert gen.returncode == 0, gen.stderr
    assert json.loads(gen.stdout)["check"]["ok"]


@pytest.mark.parametrize("args,code,needle", [
    (["compile", "recipes/gpt-oss-tiny.yaml", "--backend", "neuron", "-o", "{tmp}"], 1, "needs the Neuron SDK"),
    (["inspect", "{tmp}"], 1, "not a neffbuild bundle"),
    (["verify", "{tmp}"], 1, "manifest.json"),
    (["generate", "{bundle}", "--prompt-ids", "1,x"], 2, "comma-separated token ids"),
    (["generate", "{bundle}", "--prompt-ids", "1,999"], 2, "outside the vocabulary"),
    (["generate", "{bundle}", "--prompt-ids", "1,2", "--max-new-tokens", "600"], 2,
     "exceeds the bundle's max_model_len"),
    (["compile", "/nope.yaml"], 2, "recipe file not found"),
])
def test_cli_errors_are_clear(built, tmp_path, args, code, needle):
    args = [a.format(tmp=tmp_path, bundle=built.bundle) for a in args]
    res = _cli(*args)
    assert res.returncode == code, res.stderr
    assert needle in res.stderr and "Traceback" not in res.stderr
