"""The remote compile-cache tier against a real S3 server (moto, IAM enforced) through boto3.

Compiles are the cost: this file adds 2 AOTInductor compiles (the first push, the rebuild
after a corrupted object); every other build starts from a copy of a cache built here or by the
session (the shard recipe's second target is the session bundle's ``decode_b1_ctx128``), or from
the remote. They are of the 2-layer test model (``small_checkpoint``): the tier moves, checks and
pushes whole entries, whatever graph they hold.
The in-process builds with the read-write user run on one warm pool (``rc_pool``), as one long-lived
build service would: a fresh pool per build paid its worker's start (torch, inductor) every time.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from neffbuild import recipe as R
from neffbuild.compiler.builder import compile_recipe
from tests.conftest import ROOT, write_recipe
from tests.helpers import cache_key, seed_cache
from tests.s3_server import closed_endpoint

pytestmark = pytest.mark.slow
FALLBACK_ONLY = {"num_seqs_buckets": [1], "ctx_buckets": [512], "serving__max_num_seqs": 1}  # 1 target: b1, ctx 512
TWO = {"num_seqs_buckets": [1], "ctx_buckets": [128], "serving__max_num_seqs": 1}  # 2 targets


def _env(monkeypatch, server, who="rw", endpoint=None):
    for k, v in server.env(who).items():
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)
    if endpoint:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)


def _cli(env, *args):
    return subprocess.run([sys.executable, "-m", "neffbuild.cli.main", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=900)


def _doc(res) -> dict:
    return json.loads(res.stdout.strip().splitlines()[-1])


def _seeded(dest: Path, *caches: Path) -> Path:
    """A copy of caches built here (local hits without compiling)."""
    for c in caches:
        shutil.copytree(c, dest, ignore=shutil.ignore_patterns("*.lock", "tmp"), dirs_exist_ok=True)
    return dest


def _bundle_bytes(bundle: Path) -> dict[str, bytes]:
    return {str(p.relative_to(bundle)): p.read_bytes() for p in sorted(bundle.rglob("*"))
            if p.is_file() and p.parts[len(bundle.parts)] in ("artifacts", "weights")}


def _entry_keys(server, url: str) -> dict[str, int]:
    return {k: v for k, v in server.keys(url).items() if "/entries/" in k}


@pytest.fixture(scope="module")
def rc_recipe(tmp_path_factory, small_checkpoint):
    folder = tmp_path_factory.mktemp("rc")
    return write_recipe(folder, small_checkpoint, name="rc", **FALLBACK_ONLY)


@pytest.fixture(scope="module")
def rc_pool(s3_server):
    """One warm 1-worker local pool for this file's in-process read-write builds. Its worker is spawned with the
    rw user's credentials in its environment (a worker keeps the environment it started with; its remote tier
    reads them there: a fetch or a push from the worker uses them), so only builds as that user take it."""
    from neffbuild.compiler.executor import LocalExecutor

    mp = pytest.MonkeyPatch()
    pool = LocalExecutor(1, keep_warm=True)
    try:
        _env(mp, s3_server)
        pool._start()  # now, under the rw environment (run() would start it under the caller's)
    finally:
        mp.undo()
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def first_push(tmp_path_factory, rc_recipe, s3_server, rc_pool):
    """One cold build (1 compile: the key is in no cache) pushing into a fresh prefix: (url, cache dir, BuildResult)."""
    mp = pytest.MonkeyPatch()
    try:
        _env(mp, s3_server)
        folder = tmp_path_factory.mktemp("push")
        url = s3_server.url()
        res = compile_recipe(R.load(rc_recipe), folder / "out", jobs=1, cache_root=folder / "cache", remote=url,
                             executor=rc_pool)
    finally:
        mp.undo()
    assert not res.failed, res.failed
    return url, folder / "cache", res


def test_second_fresh_cache_compiles_nothing_and_is_byte_identical(first_push, rc_recipe, s3_server, tmp_path,
                                                                   monkeypatch, rc_pool):
    url, _, first = first_push
    doc = first.to_json()
    assert (doc["misses"], doc["pushes"], doc["remote_hits"], doc["remote_errors"]) == (1, 1, 0, 0)
    keys = _entry_keys(s3_server, url)
    assert len(keys) == 2 and any(k.endswith("/meta.json") for k in keys)  # artifact + its record
    _env(monkeypatch, s3_server)
    second = compile_recipe(R.load(rc_recipe), tmp_path / "out", jobs=1, cache_root=tmp_path / "cache", remote=url,
                            executor=rc_pool)
    doc = second.to_json()
    assert (doc["built"], doc["traced"], doc["remote_hits"], doc["local_hits"], doc["pushes"]) == (0, 0, 1, 0, 0)
    assert _bundle_bytes(second.bundle) == _bundle_bytes(first.bundle)
    assert json.loads((second.bundle / "manifest.json").read_text())["artifacts"] == \
        json.loads((first.bundle / "manifest.json").read_text())["artifacts"]


def test_corrupted_remote_object_is_a_miss_and_stays(first_push, rc_recipe, s3_server, tmp_path,
                                                     monkeypatch, rc_pool):
    src_url, _, _ = first_push
    url = s3_server.url()
    c = s3_server.client()
    src_prefix, prefix = src_url.split("/", 3)[3], url.split("/", 3)[3]
    for key in s3_server.keys(src_url):  # a copy of the first push's prefix, then corrupt its artifact
        c.copy_object(Bucket=s3_server.bucket, Key=prefix + key[len(src_prefix):],
                      CopySource={"Bucket": s3_server.bucket, "Key": key})
    [art] = [k for k in _entry_keys(s3_server, url) if k.endswith(".pt2")]
    size = c.head_object(Bucket=s3_server.bucket, Key=art)["ContentLength"]
    bad = b"\0" * size  # same size, other bytes: only the digest can tell
    c.put_object(Bucket=s3_server.bucket, Key=art, Body=bad)
    _env(monkeypatch, s3_server)
    res = compile_recipe(R.load(rc_recipe), tmp_path / "out", jobs=1, cache_root=tmp_path / "cache", remote=url,
                         executor=rc_pool)
    doc = res.to_json()
    assert not res.failed and res.bundle is not None
    # the driver rejects the bad entry (pre-key); the worker is told so and does not fetch it again
    assert (doc["built"], doc["remote_hits"], doc["remote_errors"]) == (1, 0, 1)
    assert any("does not match the sha256" in w and "left as it is" in w for w in doc["remote"]["warnings"])
    assert c.get_object(Bucket=s3_server.bucket, Key=art)["Body"].read() == bad  # never deleted or overwritten


def test_key_hit_without_a_pre_key_is_fetched_by_the_worker(first_push, rc_recipe, s3_server, tmp_path,
                                                             monkeypatch, rc_pool):
    """Only the entries, no pre-key records: the driver misses, the worker traces, and its publish
    fetches the entry from the remote instead of compiling (jobs.publish's produce)."""
    src_url, _, first = first_push
    url = s3_server.url()
    c = s3_server.client()
    src_prefix, prefix = src_url.split("/", 3)[3], url.split("/", 3)[3]
    for key in _entry_keys(s3_server, src_url):
        c.copy_object(Bucket=s3_server.bucket, Key=prefix + key[len(src_prefix):],
                      CopySource={"Bucket": s3_server.bucket, "Key": key})
    _env(monkeypatch, s3_server)
    res = compile_recipe(R.load(rc_recipe), tmp_path / "out", jobs=1, cache_root=tmp_path / "cache", remote=url,
                         executor=rc_pool)
    doc = res.to_json()
    assert (doc["built"], doc["traced"], doc["remote_hits"], doc["remote_errors"]) == (0, 1, 1, 0)
    assert [r.remote_hit for r in res.results] == [True] and res.results[0].push is None
    assert _bundle_bytes(res.bundle) == _bundle_bytes(first.bundle)


def test_read_only_credentials_read_and_never_write(first_push, rc_recipe, s3_server, tmp_path,
                                                    monkeypatch):
    src_url, seed, _ = first_push
    _env(monkeypatch, s3_server, "ro")
    hit = compile_recipe(R.load(rc_recipe), tmp_path / "o1", jobs=1, cache_root=tmp_path / "c1", remote=src_url)
    assert (hit.to_json()["remote_hits"], hit.built) == (1, 0)  # reading works with read-only keys
    env = dict(s3_server.env("ro"), NEFFBUILD_LOG="DEBUG")  # botocore's debug logs sign with the key id
    url = s3_server.url()  # empty: a local hit the remote lacks would be pushed with write access
    res = _cli(env, "compile", str(rc_recipe), "-o", str(tmp_path / "o2"), "--cache-dir",
               str(_seeded(tmp_path / "c2", seed)), "--cache-remote", url, "--json")
    assert res.returncode == 0, res.stderr
    doc = _doc(res)
    assert (doc["built"], doc["pushes"], doc["remote"]["state"]) == (0, 0, "read-only")
    assert "read-only for the rest of this run" in res.stderr and "remote " + url + " read-only" in res.stderr
    assert s3_server.keys(url) == {}
    written = [p.read_bytes() for p in (tmp_path / "o2").rglob("*") if p.is_file()]  # logs, manifest, report
    for secret in s3_server.creds["ro"]:
        assert secret not in res.stderr + res.stdout and not any(secret.encode() in b for b in written)
    assert "Traceback" not in res.stderr


def test_remote_down_build_succeeds_and_says_so(first_push, rc_recipe, s3_server, tmp_path):
    env = s3_server.env("rw")
    env.update(AWS_ENDPOINT_URL_S3=closed_endpoint(), NEFFBUILD_CACHE_REMOTE="s3://neffbuild-test/down")
    res = _cli(env, "compile", str(rc_recipe), "-o", str(tmp_path / "o"), "--cache-dir",
               str(_seeded(tmp_path / "c", first_push[1])))
    assert res.returncode == 0, res.stderr
    assert "remote s3://neffbuild-test/down unreachable" in res.stderr and "building without it" in res.stderr
    assert "1 remote errors" in res.stderr and "Traceback" not in res.stderr


def test_concurrent_compiles_push_each_key_once(first_push, rc_recipe, s3_server, tmp_path):
    """Both builds hold every entry locally (copies of one cache), so both race to push the same key."""
    url = s3_server.url()
    env = s3_server.env("rw")
    procs = [subprocess.Popen([sys.executable, "-m", "neffbuild.cli.main", "compile", str(rc_recipe), "-o",
                               str(tmp_path / f"o{n}"), "--cache-dir", str(_seeded(tmp_path / f"c{n}", first_push[1])),
                               "--cache-remote", url, "--json"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for n in (0, 1)]
    docs = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
        docs.append(json.loads(out.strip().splitlines()[-1]))
    assert sum(d["pushes"] for d in docs) == 1 and all(d["remote_errors"] == 0 for d in docs)
    keys = _entry_keys(s3_server, url)
    assert len([k for k in keys if k.endswith("/meta.json")]) == 1 and len(keys) == 2


def test_shards_then_assembling_compile_builds_nothing(first_push, small_checkpoint, s3_server, tmp_path,
                                                       monkeypatch, rc_pool, built, build_cache):
    """Each shard holds both entries locally (first_push's and the session bundle's: the same keys), so what it
    does with its slice is what is under test: push it, publish no bundle; a compile-then-push is first_push's."""
    path = write_recipe(tmp_path, small_checkpoint, name="shards", **TWO)
    session = seed_cache(build_cache, tmp_path / "session", [cache_key(built.bundle, "decode_b1_ctx128")])
    url = s3_server.url()
    env = s3_server.env("rw")
    procs = [subprocess.Popen([sys.executable, "-m", "neffbuild.cli.main", "compile", str(path), "-o",
                               str(tmp_path / f"o{i}"), "--cache-dir",
                               str(_seeded(tmp_path / f"c{i}", first_push[1], session)),
                               "--cache-remote", url, "--shard", f"{i}/2", "--json"], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in (1, 2)]
    docs = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
        docs.append(json.loads(out.strip().splitlines()[-1]))
    assert [d["bundle"] for d in docs] == [None, None] and [d["shard"] for d in docs] == ["1/2", "2/2"]
    assert [d["built"] for d in docs] == [0, 0]  # both slices were local hits: the seeds hold the recipe's keys
    pushed = [d["remote"]["pushed"] for d in docs]
    assert all(len(p) == 1 for p in pushed) and len({lb for p in pushed for lb in p}) == 2  # disjoint, whole grid
    assert not list((tmp_path / "o1").glob("*/manifest.json"))
    _env(monkeypatch, s3_server)
    final = compile_recipe(R.load(path), tmp_path / "final", jobs=1, cache_root=tmp_path / "fresh", remote=url,
                           executor=rc_pool)
    assert (final.built, final.to_json()["remote_hits"]) == (0, 2)
    both = _seeded(tmp_path / "s", tmp_path / "c1", tmp_path / "c2")  # every entry the shards built or held
    one_shot = compile_recipe(R.load(path), tmp_path / "one", jobs=1, cache_root=both, executor=rc_pool)
    assert _bundle_bytes(final.bundle) == _bundle_bytes(one_shot.bundle)
    a, b = (json.loads((x.bundle / "manifest.json").read_text()) for x in (final, one_shot))
    assert a["artifacts"] == b["artifacts"] and a["toolchain"] == b["toolchain"]


def test_plan_marks_local_remote_build(first_push, rc_recipe, s3_server, tmp_path, monkeypatch):
    from neffbuild import grid
    from neffbuild.compiler.planner import cache_states

    url, cache, _ = first_push
    _env(monkeypatch, s3_server)
    r = R.load(rc_recipe)
    tgts = grid.targets(r)
    states = [cache_states(r, tgts, cache_root=root, remote=u)[tgts[0].label]["cache"]
              for root, u in ((cache, url), (tmp_path / "empty", url), (tmp_path / "empty", s3_server.url()))]
    assert states == ["local", "remote", "build"]


def test_remote_check(s3_server, tmp_path):
    url = s3_server.url()
    rows = {}
    for who, env in (("rw", s3_server.env("rw")), ("ro", s3_server.env("ro")),
                     ("down", dict(s3_server.env("rw"), AWS_ENDPOINT_URL_S3=closed_endpoint()))):
        res = _cli(env, "cache", "remote", "check", url, "--json")
        d = _doc(res)
        rows[who] = (res.returncode, d["reachable"], d["readable"], d["writable"])
        assert all(s not in res.stdout + res.stderr for s in s3_server.creds[who if who != "down" else "rw"])
    assert rows == {"rw": (0, True, True, True), "ro": (0, True, True, False), "down": (1, False, False, False)}
    bad = _cli(dict(os.environ), "cache", "remote", "check", "http://nope")
    assert bad.returncode == 2 and "expected s3://BUCKET/PREFIX" in bad.stderr


def _tokens(bundle: Path) -> list:
    from tests.helpers import cli

    res = cli("generate", str(bundle), "--prompt-ids", "3,14,15,92", "--max-new-tokens", "6", "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)["tokens"]


def _ci_key(folder: Path) -> tuple[object, Path]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    pub = folder / "ci.pub.pem"
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                  serialization.PublicFormat.SubjectPublicKeyInfo))
    return key, pub


def test_poisoned_entry_is_rebuilt_by_a_trusting_reader(first_push, rc_recipe, s3_server, tmp_path, monkeypatch,
                                                         rc_pool, tiny_cfg):
    """A bucket writer replaces a CI-signed entry's artifact with another model's (same input signature: only
    swiglu_limit differs) and rewrites meta.json's digest and size. A reader trusting the CI key rebuilds that
    target and gets the genuine tokens; a reader without keys is told once that the bucket is trusted as is."""
    pytest.importorskip("cryptography")
    from neffbuild.compiler.entry_sig import load_trusted
    from neffbuild.models.gpt_oss.config import GptOssConfig
    from tests.conftest import _save_hf

    _, seed, first = first_push
    genuine = _tokens(first.bundle)
    key, pub = _ci_key(tmp_path)
    _env(monkeypatch, s3_server)
    url = s3_server.url()
    ci = compile_recipe(R.load(rc_recipe), tmp_path / "ci", jobs=1, cache_root=_seeded(tmp_path / "ci-cache", seed),
                        remote=url, executor=rc_pool, remote_sign_key=key)  # a local hit the remote lacks: pushed
    assert (ci.built, ci.to_json()["pushes"]) == (0, 1)
    assert any(k.endswith("/entry.sig") for k in _entry_keys(s3_server, url))
    hf = dict(tiny_cfg.to_hf_dict(), num_hidden_layers=2, swiglu_limit=0.25)  # same shapes, another graph
    hf.pop("layer_types")
    other_ckpt = _save_hf(tmp_path / "other-ckpt", GptOssConfig.from_hf_dict(hf))
    other = compile_recipe(R.load(write_recipe(tmp_path, other_ckpt, name="rc", **FALLBACK_ONLY)), tmp_path / "oth",
                           jobs=1, cache_root=tmp_path / "other-cache", executor=rc_pool)  # 1 compile
    [art] = [k for k in _entry_keys(s3_server, url) if k.endswith(".pt2")]
    poison = (other.bundle / "artifacts" / Path(art).name.replace("artifact", "decode_b1_ctx512")).read_bytes()
    c = s3_server.client()
    meta_key = art.rsplit("/", 1)[0] + "/meta.json"
    meta = json.loads(c.get_object(Bucket=s3_server.bucket, Key=meta_key)["Body"].read())
    assert poison != c.get_object(Bucket=s3_server.bucket, Key=art)["Body"].read()
    import hashlib

    meta.update(sha256=hashlib.sha256(poison).hexdigest(), bytes=len(poison))
    c.put_object(Bucket=s3_server.bucket, Key=art, Body=poison)
    c.put_object(Bucket=s3_server.bucket, Key=meta_key, Body=json.dumps(meta).encode())

    trusting = compile_recipe(R.load(rc_recipe), tmp_path / "t", jobs=1, cache_root=tmp_path / "t-cache", remote=url,
                              executor=rc_pool, remote_trust=load_trusted([pub]))  # 1 compile: the rebuild
    doc = trusting.to_json()
    assert (doc["built"], doc["remote_hits"]) == (1, 0), doc
    assert any("remote entry rejected, rebuilt" in w for w in doc["remote"]["warnings"])
    assert _tokens(trusting.bundle) == genuine
    assert (trusting.bundle / "artifacts" / "decode_b1_ctx512.pt2").read_bytes() != poison

    res = _cli(s3_server.env("rw"), "compile", str(rc_recipe), "-o", str(tmp_path / "u"), "--cache-dir",
               str(tmp_path / "u-cache"), "--cache-remote", url, "--json")
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("trusted as is") == 1 and _doc(res)["remote_hits"] == 1  # the hazard, said once


def test_a_remote_entry_that_fails_its_smoke_run_is_rejected_and_never_cached(first_push, rc_recipe, s3_server,
                                                                               tmp_path, monkeypatch, rc_pool):
    """An entry whose artifact cannot run (bytes a loader rejects, digest rewritten to match) was published locally
    before its smoke run: the compile failed, and every later compile on that machine too. Now it is smoke-run in a
    child process first: rejected, rebuilt, and the local cache holds the rebuilt entry."""
    import hashlib

    from neffbuild.compiler.cache import Cache

    src_url, _, first = first_push
    url = s3_server.url()
    c = s3_server.client()
    src_prefix, prefix = src_url.split("/", 3)[3], url.split("/", 3)[3]
    for key in s3_server.keys(src_url):
        c.copy_object(Bucket=s3_server.bucket, Key=prefix + key[len(src_prefix):],
                      CopySource={"Bucket": s3_server.bucket, "Key": key})
    [art] = [k for k in _entry_keys(s3_server, url) if k.endswith(".pt2")]
    bad = b"PK\x03\x04" + b"\0" * 4096  # a zip header, then nothing a loader can use
    meta_key = art.rsplit("/", 1)[0] + "/meta.json"
    meta = json.loads(c.get_object(Bucket=s3_server.bucket, Key=meta_key)["Body"].read())
    meta.update(sha256=hashlib.sha256(bad).hexdigest(), bytes=len(bad))
    c.put_object(Bucket=s3_server.bucket, Key=art, Body=bad)
    c.put_object(Bucket=s3_server.bucket, Key=meta_key, Body=json.dumps(meta).encode())
    _env(monkeypatch, s3_server)
    res = compile_recipe(R.load(rc_recipe), tmp_path / "out", jobs=1, cache_root=tmp_path / "cache", remote=url,
                         executor=rc_pool)  # 1 compile: the rebuild
    doc = res.to_json()
    assert not res.failed and (doc["built"], doc["remote_hits"]) == (1, 0), doc
    assert any("smoke run in a child process" in w and "rebuilt" in w for w in doc["remote"]["warnings"])
    key = art.split("/")[-2]
    entry = Cache(tmp_path / "cache").get(key)
    assert entry is not None and entry.path.read_bytes() != bad
    assert _bundle_bytes(res.bundle) == _bundle_bytes(first.bundle)


def test_a_rewritten_pre_key_record_cannot_serve_another_graph(rc_recipe, s3_server, tmp_path, monkeypatch, rc_pool,
                                                               tiny_cfg, build_cache):
    """Issue 54: CI signs two models' entries (same shapes: only swiglu_limit differs) and their pre-key records; a
    bucket writer copies the other model's signed record over this target's. Today's tree followed it: exit 0 with
    the other model's artifact. Now the record is not followed (its signature names another pre-key): the target
    is traced, its own signed entry fetched, and the bundle holds the genuine artifact and gives its tokens.
    Both CI builds use the session cache (compiled once per cache)."""
    pytest.importorskip("cryptography")
    from neffbuild.compiler.entry_sig import load_trusted
    from neffbuild.models.gpt_oss.config import GptOssConfig
    from tests.conftest import _save_hf

    key, pub = _ci_key(tmp_path)
    _env(monkeypatch, s3_server)
    url = s3_server.url()
    genuine = compile_recipe(R.load(rc_recipe), tmp_path / "g", jobs=1, cache_root=build_cache, remote=url,
                             executor=rc_pool, remote_sign_key=key)
    prekeys = lambda: {k for k in s3_server.keys(url) if "/prekeys/" in k}
    [pre_a] = prekeys()
    hf = dict(tiny_cfg.to_hf_dict(), num_hidden_layers=2, swiglu_limit=0.25)
    hf.pop("layer_types")
    other_ckpt = _save_hf(tmp_path / "other-ckpt", GptOssConfig.from_hf_dict(hf))
    other = compile_recipe(R.load(write_recipe(tmp_path, other_ckpt, name="rc", **FALLBACK_ONLY)), tmp_path / "o",
                           jobs=1, cache_root=build_cache, remote=url, executor=rc_pool, remote_sign_key=key)
    assert not genuine.failed and not other.failed
    [pre_b] = prekeys() - {pre_a}
    c = s3_server.client()
    signed_b = c.get_object(Bucket=s3_server.bucket, Key=pre_b)["Body"].read()
    assert "signature" in json.loads(signed_b)
    c.put_object(Bucket=s3_server.bucket, Key=pre_a, Body=signed_b)  # A's record now names B's signed entry

    trusting = compile_recipe(R.load(rc_recipe), tmp_path / "t", jobs=1, cache_root=tmp_path / "t-cache", remote=url,
                              executor=rc_pool, remote_trust=load_trusted([pub]))
    doc = trusting.to_json()
    assert (doc["built"], doc["remote_hits"]) == (0, 1), doc
    art = Path("artifacts") / "decode_b1_ctx512.pt2"
    assert (trusting.bundle / art).read_bytes() != (other.bundle / art).read_bytes()  # today's tree: the other's
    assert (trusting.bundle / art).read_bytes() == (genuine.bundle / art).read_bytes()
    assert any("pre-key record" in w and "another pre-key" in w for w in doc["remote"]["warnings"]), doc
    assert _tokens(trusting.bundle) == _tokens(genuine.bundle)
