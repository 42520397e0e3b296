"""The remote cache's trust model on small entries (no compile), against the moto S3 server through boto3.

A reader with trusted keys uses only entries one of them signed over that key, those bytes and that
toolchain (compiler/entry_sig.py); a fetched entry passes its check (the smoke run in a child
process) before anything is published locally. The poisoned-model end-to-end case, with real
compiles and generated tokens, is in tests/test_remote_cache.py.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from neffbuild.bundle.signing import load_private_key
from neffbuild.compiler.cache import Cache
from neffbuild.compiler.entry_sig import ENTRY_SIG, load_trusted
from neffbuild.compiler.remote_cache import RemoteCache
from neffbuild.compiler.remote_tier import open_tier
from neffbuild.compiler.smoke import LoadFailed
from neffbuild.errors import InvalidInput
from tests.test_sign import _keypair as key_files

pytest.importorskip("cryptography")
KEY = "ef" * 32


def _env(monkeypatch, server, who="rw"):
    for k, v in server.env(who).items():
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)


def _keypair(folder: Path, name: str):
    """(private key object, public key PEM path): the signing tests' key files, the private one loaded."""
    priv, pub = key_files(folder, name)
    return load_private_key(priv), pub


@pytest.fixture(scope="module")
def ci(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cikeys")
    return {"ci": _keypair(folder, "ci"), "other": _keypair(folder, "other")}


def _local(root, data: bytes = b"genuine artifact bytes", key: str = KEY, fingerprint=None):
    cache = Cache(root).ensure()
    tmp = cache.new_tmp(key)
    (tmp / "artifact.pt2").write_bytes(data)
    return cache.publish(key, tmp, tmp / "artifact.pt2", {"label": "t", "compile_seconds": 1.0, "ext": "pt2",
                                                          "input_signature": [],
                                                          "fingerprint": fingerprint or {"torch": "2.13"}})


def _reader(url, ci, *names):
    return RemoteCache(url, trusted=load_trusted([ci[n][1] for n in names]))


def _poison(server, url, data: bytes, key: str = KEY) -> None:
    """Replace the entry's artifact and rewrite its meta's sha256 and size to match (what a bucket writer can do)."""
    c = server.client()
    prefix = url.split("/", 3)[3]
    base = f"{prefix}/v1/entries/{key}/"
    meta = json.loads(c.get_object(Bucket=server.bucket, Key=base + "meta.json")["Body"].read())
    meta.update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    c.put_object(Bucket=server.bucket, Key=base + "artifact.pt2", Body=data)
    c.put_object(Bucket=server.bucket, Key=base + "meta.json", Body=json.dumps(meta).encode())


def test_signed_entry_is_accepted_by_a_trusting_reader(monkeypatch, s3_server, tmp_path, ci):
    _env(monkeypatch, s3_server)
    url = s3_server.url()
    entry = _local(tmp_path / "a")
    assert RemoteCache(url, sign_key=ci["ci"][0]).push(entry) == "pushed"
    assert any(k.endswith("/" + ENTRY_SIG) for k in s3_server.keys(url))
    rc = _reader(url, ci, "other", "ci")
    got = rc.fetch(Cache(tmp_path / "b").ensure(), KEY)
    assert got is not None and got.path.read_bytes() == b"genuine artifact bytes" and rc.stats.errors == 0


@pytest.mark.parametrize("case", ["poisoned", "unsigned", "other-key", "other-toolchain", "other-entry-sig"])
def test_untrusted_entry_is_rejected_and_nothing_is_published(monkeypatch, s3_server, tmp_path, ci, case):
    _env(monkeypatch, s3_server)
    url = s3_server.url()
    signer = None if case == "unsigned" else ci["other" if case == "other-key" else "ci"][0]
    entry = _local(tmp_path / "a")
    RemoteCache(url, sign_key=signer).push(entry)
    c = s3_server.client()
    base = f"{url.split('/', 3)[3]}/v1/entries/{KEY}/"
    if case == "poisoned":  # another artifact, with its digest rewritten into meta.json: the signature tells
        _poison(s3_server, url, b"another model's artifact")
    elif case == "other-toolchain":
        meta = json.loads(c.get_object(Bucket=s3_server.bucket, Key=base + "meta.json")["Body"].read())
        c.put_object(Bucket=s3_server.bucket, Key=base + "meta.json",
                     Body=json.dumps(dict(meta, fingerprint={"torch": "2.0"})).encode())
    elif case == "other-entry-sig":  # a genuine signature of another key's entry, copied next to this one
        other = _local(tmp_path / "o", key="12" * 32)
        RemoteCache(url, sign_key=ci["ci"][0]).push(other)
        sig = c.get_object(Bucket=s3_server.bucket, Key=base.replace(KEY, "12" * 32) + ENTRY_SIG)["Body"].read()
        c.put_object(Bucket=s3_server.bucket, Key=base + ENTRY_SIG, Body=sig)
    fresh = Cache(tmp_path / "b").ensure()
    rc = _reader(url, ci, "ci")
    assert rc.fetch(fresh, KEY) is None
    assert rc.rejected == {KEY} and rc.stats.errors == 1 and rc.stats.hits == 0
    assert "remote entry rejected, rebuilt" in rc.stats.warnings[0]
    assert fresh.get(KEY) is None and not list(fresh.tmp_dir.iterdir())
    unchecked = RemoteCache(url)  # without keys the bucket is trusted as is: the same entry is a hit
    if case not in ("other-toolchain",):
        assert unchecked.fetch(Cache(tmp_path / "c").ensure(), KEY) is not None


def test_reader_without_keys_says_once_that_the_bucket_is_trusted(monkeypatch, s3_server):
    _env(monkeypatch, s3_server)
    tier = open_tier(s3_server.url())
    tier.warn(tier.stats.warnings[0])  # a worker's report folds the same line in again
    assert len(tier.stats.warnings) == 1 and "trusted as is" in tier.stats.warnings[0]
    assert open_tier(s3_server.url(), trusted=(b"pem",)).stats.warnings == []


def test_failed_check_rejects_before_local_publish(monkeypatch, s3_server, tmp_path):
    _env(monkeypatch, s3_server)
    url = s3_server.url()
    RemoteCache(url).push(_local(tmp_path / "a"))
    seen = []

    def crashing(artifact):
        seen.append(artifact.read_bytes())
        raise LoadFailed("the smoke run died of signal 11 (SIGSEGV)")

    fresh = Cache(tmp_path / "b").ensure()
    rc = RemoteCache(url)
    assert rc.fetch(fresh, KEY, crashing) is None
    assert seen == [b"genuine artifact bytes"]  # checked on the downloaded bytes, before any publish
    assert fresh.get(KEY) is None and "SIGSEGV" in rc.stats.warnings[0] and rc.rejected == {KEY}


def test_smoke_in_child_survives_a_crashing_artifact(tmp_path, tiny_recipe):
    """A real child process: garbage bytes as the artifact fail there (LoadFailed), never in this process."""
    import torch
    from safetensors.torch import save_file

    from neffbuild import grid
    from neffbuild.compiler.builder import backend_kwargs
    from neffbuild.compiler.graphs import target_graph
    from neffbuild.compiler.smoke_child import smoke_in_child

    bad = tmp_path / "artifact.pt2"
    bad.write_bytes(b"\0" * 4096)
    weights = tmp_path / "w.safetensors"
    save_file({"x": torch.zeros(1)}, str(weights))
    recipe = tiny_recipe
    target = grid.targets(recipe)[0]
    with pytest.raises(LoadFailed, match="smoke run failed"):
        smoke_in_child(backend_kwargs(recipe), bad, target_graph(recipe, target), str(weights))
    with pytest.raises(LoadFailed, match="smoke run failed"):  # the same child answers the next check
        smoke_in_child(backend_kwargs(recipe), bad, target_graph(recipe, target), str(weights))


def test_smoke_child_killed_by_a_signal_is_named(tmp_path, tiny_recipe, monkeypatch):
    """A real child that dies of SIGSEGV (a stand-in interpreter that kills itself): LoadFailed naming it."""
    import sys

    from neffbuild import grid
    from neffbuild.compiler import smoke_child
    from neffbuild.compiler.builder import backend_kwargs
    from neffbuild.compiler.graphs import target_graph
    from neffbuild.compiler.smoke_child import smoke_in_child

    crash = tmp_path / "python"
    crash.write_text("#!/bin/sh\nkill -SEGV $$\n")
    crash.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(crash))
    monkeypatch.setattr(smoke_child, "_CHILD", [])  # a fresh child, started from the stand-in interpreter
    with pytest.raises(LoadFailed, match=r"signal 11 \(SIGSEGV\)"):
        smoke_in_child(backend_kwargs(tiny_recipe), tmp_path / "a.pt2", target_graph(tiny_recipe,
                       grid.targets(tiny_recipe)[0]), str(tmp_path / "w"))


@pytest.mark.parametrize("bad", ["dir", "fifo", "notakey", "private"])
def test_bad_trust_key_is_invalid_input(tmp_path, ci, bad):
    import os

    path = tmp_path / "k.pem"
    if bad == "dir":
        path.mkdir()
    elif bad == "fifo":
        os.mkfifo(path)
    elif bad == "notakey":
        path.write_text("hello")
    else:
        from cryptography.hazmat.primitives import serialization

        path.write_bytes(ci["ci"][0].private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption()))
    with pytest.raises(InvalidInput, match="--cache-trust"):
        load_trusted([path])


@pytest.mark.parametrize("drop", ["ext", "compile_seconds"])
def test_a_remote_meta_without_what_a_hit_reads_is_a_miss(monkeypatch, s3_server, tmp_path, drop):
    """A hit's result reads meta ext and compile_seconds: a meta without them failed the build (KeyError)."""
    _env(monkeypatch, s3_server)
    url = s3_server.url()
    RemoteCache(url).push(_local(tmp_path / "a"))
    c = s3_server.client()
    key = f"{url.split('/', 3)[3]}/v1/entries/{KEY}/meta.json"
    meta = json.loads(c.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read())
    meta.pop(drop)
    c.put_object(Bucket=s3_server.bucket, Key=key, Body=json.dumps(meta).encode())
    rc = RemoteCache(url)
    assert rc.fetch(Cache(tmp_path / "b").ensure(), KEY) is None and "malformed" in rc.stats.warnings[0]
