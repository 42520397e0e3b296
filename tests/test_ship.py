"""push / pull against a real S3 server (moto, server mode, on 127.0.0.1) through boto3 (issue 22).

Round trip (push, pull into an empty folder, verify --trust, generate --check), weights shared by
two versions stored once, immutable versions, pull by digest, and a pull killed with SIGKILL half
way (through a throttling TCP proxy, so the kill lands mid-file) that leaves no bundle and resumes.
Reuses the session bundle `built` (copied); compiles nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.helpers import run_cli
from tests.s3_server import s3_server  # noqa: F401 - the session fixture
from tests.test_sign import _keypair

pytest.importorskip("cryptography")


@pytest.fixture
def aws(monkeypatch, s3_server):  # noqa: F811
    for k, v in s3_server.env("rw").items():
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "NEFFBUILD_TRUSTED_KEYS"):
        monkeypatch.delenv(k, raising=False)
    return s3_server


@pytest.fixture(scope="module")
def shipped(built, tmp_path_factory):
    """(signed copy of the session bundle, private key, public key)."""
    folder = tmp_path_factory.mktemp("ship")
    priv, pub = _keypair(folder, "ci")
    root = folder / "src" / built.bundle.name
    shutil.copytree(built.bundle, root)
    code, _, err, _ = run_cli("sign", str(root), "--key", str(priv))
    assert code == 0, err
    return root, priv, pub


def _json(args) -> dict:
    code, out, err, exc = run_cli(*args, "--json")
    assert exc is None and code == 0, err
    return json.loads(out)


def _new_version(src: Path, dest_parent: Path, version: str, priv: Path) -> Path:
    """The same bundle as another version: only manifest.json, its digest and the signature change."""
    from neffbuild.bundle import manifest as manifest_mod
    from neffbuild.bundle import signing

    root = dest_parent / f"{src.name.rsplit('-', 1)[0]}-{version}"
    shutil.copytree(src, root)
    m = json.loads((root / "manifest.json").read_text())
    m["version"] = version
    text = manifest_mod.dumps(m)
    (root / "manifest.json").write_text(text)
    (root / "manifest.sha256").write_text(f"{hashlib.sha256(text.encode()).hexdigest()}  manifest.json\n")
    signing.sign(root, priv)
    return root


def test_round_trip_pull_verify_generate(aws, shipped, tmp_path):
    root, _, pub = shipped
    url = aws.url()
    doc = _json(["push", str(root), url])
    total = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    assert not doc["noop"] and doc["uploaded_bytes"] + doc["skipped_bytes"] == doc["bytes"] == total
    keys = aws.keys(url)
    name_key = [k for k in keys if k.endswith(f"bundles/{root.name}.json")]
    assert name_key and any("/blobs/sha256/" in k for k in keys)
    again = _json(["push", str(root), url])  # the same bytes: a no-op
    assert again["noop"] and again["uploaded_bytes"] == 0 and aws.keys(url) == keys

    dest = tmp_path / "serving"
    got = _json(["pull", f"{url}/{root.name}", str(dest), "--trust", str(pub)])
    pulled = dest / root.name
    assert Path(got["bundle"]) == pulled and got["signature"]["key"] == str(pub)
    assert got["downloaded_bytes"] == total and sorted(p.name for p in dest.iterdir()) == [root.name]
    assert {p.relative_to(pulled).as_posix(): p.read_bytes() for p in pulled.rglob("*") if p.is_file()} == \
        {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    code, _, err, _ = run_cli("verify", str(pulled), "--trust", str(pub))
    assert code == 0, err
    gen = subprocess.run([sys.executable, "-m", "neffbuild.cli.main", "generate", str(pulled), "--prompt-ids",
                          "1,2,3", "--max-new-tokens", "4", "--check", "--trust", str(pub), "--json"],
                         capture_output=True, text=True, cwd=ROOT)
    assert gen.returncode == 0, gen.stderr
    assert json.loads(gen.stdout)["check"]["ok"]

    by_digest = _json(["pull", got["url"].rsplit("/", 1)[0] + "/sha256:" +
                       hashlib.sha256((root / "manifest.json").read_bytes()).hexdigest(), str(tmp_path / "d2")])
    assert Path(by_digest["bundle"]).name == root.name and by_digest["signature"] is None
    assert _json(["pull", f"{url}/{root.name}", str(dest)])["noop"]  # already there, same bytes


def test_second_version_uploads_no_weight_bytes(aws, shipped, tmp_path):
    root, priv, _ = shipped
    url = aws.url()
    _json(["push", str(root), url])
    before = aws.keys(url)
    v2 = _new_version(root, tmp_path, "0.2.0", priv)
    doc = _json(["push", str(v2), url])
    changed = {"manifest.json", "manifest.sha256", "model.sig"}
    assert doc["uploaded_blobs"] == len(changed)
    assert doc["uploaded_bytes"] == sum((v2 / rel).stat().st_size for rel in changed)
    weights = (root / "weights" / "model.safetensors").stat().st_size
    assert doc["skipped_bytes"] == doc["bytes"] - doc["uploaded_bytes"] and doc["skipped_bytes"] > weights
    blobs = [k for k in aws.keys(url) if "/blobs/" in k]
    assert len(blobs) == len([k for k in before if "/blobs/" in k]) + len(changed)  # weights stored once


def test_a_version_is_immutable(aws, shipped, tmp_path):
    root, priv, _ = shipped
    url = aws.url()
    _json(["push", str(root), url])
    other = tmp_path / root.name
    shutil.copytree(root, other)
    (other / "report.html").write_text("<html>another build of the same inputs</html>\n")
    from neffbuild.bundle import signing

    signing.sign(other, priv)
    code, _, err, exc = run_cli("push", str(other), url)
    assert exc is None and code == 1 and "already exists with other bytes" in err and "immutable" in err


def test_pull_of_a_missing_bundle_and_a_bad_url(aws, tmp_path):
    code, _, err, exc = run_cli("pull", f"{aws.url()}/nothing-0.1.0", str(tmp_path / "d"))
    assert exc is None and code == 1 and "no such bundle" in err and not (tmp_path / "d" / "nothing-0.1.0").exists()
    code, _, err, exc = run_cli("pull", "http://x/y", str(tmp_path / "d"))
    assert exc is None and code == 2 and "s3://" in err


class Throttle:
    """A TCP proxy to the S3 server that sends responses at ``rate`` bytes/s (so a pull takes seconds)."""

    def __init__(self, upstream: str, rate: int):
        host, port = upstream.rsplit("//", 1)[1].split(":")
        self.up, self.rate = (host, int(port)), rate
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.endpoint = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(self.up)
            threading.Thread(target=self._pump, args=(client, server, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, self.rate), daemon=True).start()

    @staticmethod
    def _pump(src, dst, rate):
        with contextlib.suppress(OSError):
            while data := src.recv(16384):
                dst.sendall(data)
                if rate:
                    time.sleep(len(data) / rate)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self):
        self.sock.close()


def test_killed_pull_leaves_no_bundle_and_resumes(aws, shipped, tmp_path):
    root, _, pub = shipped
    url = aws.url()
    _json(["push", str(root), url])
    proxy = Throttle(aws.endpoint, rate=1 << 20)  # ~15 s for the bundle
    dest = tmp_path / "serving"
    env = dict(aws.env("rw"), AWS_ENDPOINT_URL_S3=proxy.endpoint)
    env.pop("NEFFBUILD_TRUSTED_KEYS", None)
    proc = subprocess.Popen([sys.executable, "-m", "neffbuild.cli.main", "pull", f"{url}/{root.name}", str(dest),
                             "--json"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    tmp = dest / f".{root.name}.pull"
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:  # kill once the second file is partly down
            parts = list(tmp.rglob("*.part")) if tmp.exists() else []
            done = list(tmp.rglob("*.pt2")) if tmp.exists() else []
            if done and parts and parts[0].stat().st_size > 64 * 1024:
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        proxy.close()
    assert proc.returncode == -signal.SIGKILL
    assert not (dest / root.name).exists() and tmp.is_dir()
    partial = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file())
    total = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    assert 0 < partial < total
    got = _json(["pull", f"{url}/{root.name}", str(dest), "--trust", str(pub)])
    assert got["resumed_bytes"] > 0 and got["reused_bytes"] > 0
    assert got["downloaded_bytes"] + got["resumed_bytes"] + got["reused_bytes"] == total
    assert got["resumed_bytes"] + got["reused_bytes"] == partial  # nothing already on disk is fetched again
    assert not tmp.exists() and sorted(p.name for p in dest.iterdir()) == [root.name]
    code, _, err, _ = run_cli("verify", str(dest / root.name), "--trust", str(pub))
    assert code == 0, err


def test_pull_refuses_a_bundle_signed_by_another_key(aws, shipped, tmp_path):
    root, _, _ = shipped
    url = aws.url()
    _json(["push", str(root), url])
    _, other = _keypair(tmp_path, "other")
    code, _, err, exc = run_cli("pull", f"{url}/{root.name}", str(tmp_path / "d"), "--trust", str(other))
    assert exc is None and code == 1 and "not a trusted key" in err
    assert not (tmp_path / "d" / root.name).exists()


def _put_index(aws, url: str, key: str, index: dict) -> None:
    c = aws.client()
    c.put_object(Bucket=aws.bucket, Key=f"{url.split('/', 3)[3]}/{key}", Body=json.dumps(index).encode())


def _index(aws, url: str, name: str) -> dict:
    c = aws.client()
    return json.loads(c.get_object(Bucket=aws.bucket, Key=f"{url.split('/', 3)[3]}/bundles/{name}.json")["Body"]
                      .read())


def test_pull_refuses_an_index_naming_another_version(aws, shipped, tmp_path):
    """An index planted at NAME-0.2.0 listing the signed 0.1.0 bundle: a rollback the signature does not catch."""
    root, _, pub = shipped
    url = aws.url()
    _json(["push", str(root), url])
    name = root.name.rsplit("-", 1)[0]
    idx = dict(_index(aws, url, root.name), version="0.2.0")
    _put_index(aws, url, f"bundles/{name}-0.2.0.json", idx)
    code, _, err, exc = run_cli("pull", f"{url}/{name}-0.2.0", str(tmp_path / "d"), "--trust", str(pub))
    assert exc is None and code == 1 and "rollback" in err, err
    assert not (tmp_path / "d" / f"{name}-0.2.0").exists()


def test_pull_by_digest_checks_the_manifest_hashes_to_it(aws, shipped, tmp_path):
    root, _, _ = shipped
    url = aws.url()
    _json(["push", str(root), url])
    fake = "ab" * 32
    _put_index(aws, url, f"digests/{fake}.json", _index(aws, url, root.name))
    code, _, err, exc = run_cli("pull", f"{url}/sha256:{fake}", str(tmp_path / "d"))
    assert exc is None and code == 1 and "the digest that was asked for" in err, err
    assert not list((tmp_path / "d").glob("*")) if (tmp_path / "d").exists() else True


def test_pull_index_with_a_file_that_is_also_a_folder(aws, shipped, tmp_path):
    root, _, _ = shipped
    url = aws.url()
    _json(["push", str(root), url])
    idx = _index(aws, url, root.name)
    idx["files"]["manifest.json/x"] = dict(idx["files"]["manifest.json"])
    _put_index(aws, url, f"bundles/{root.name}.json", idx)
    code, _, err, exc = run_cli("pull", f"{url}/{root.name}", str(tmp_path / "d"))
    assert exc is None and code == 1 and "as a file and as the folder" in err, err


@pytest.mark.parametrize("where", ["tmp", "final", "lock"])
def test_pull_never_follows_a_planted_symlink(aws, shipped, tmp_path, where):
    root, _, _ = shipped
    url = aws.url()
    _json(["push", str(root), url])
    dest, victim = tmp_path / "serving", tmp_path / "victim"
    dest.mkdir()
    victim.mkdir()
    (victim / "precious.txt").write_text("mine")
    link = {"tmp": dest / f".{root.name}.pull", "final": dest / root.name,
            "lock": dest / f".{root.name}.pull.lock"}[where]
    link.symlink_to(victim / "lockfile" if where == "lock" else victim)
    code, _, err, exc = run_cli("pull", f"{url}/{root.name}", str(dest))
    assert exc is None and code == 1 and "link" in err, err
    assert sorted(p.name for p in victim.iterdir()) == ["precious.txt"] and link.is_symlink()
    assert (victim / "precious.txt").read_text() == "mine"


def test_push_replaces_a_same_size_blob_with_other_bytes(aws, shipped, tmp_path):
    """A same-size blob of zeros at the weights' address is read back and replaced, so the version pulls."""
    root, _, _ = shipped
    url = aws.url()
    weights = root / "weights" / "model.safetensors"
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    key = f"{url.split('/', 3)[3]}/blobs/sha256/{digest}"
    aws.client().put_object(Bucket=aws.bucket, Key=key, Body=b"\0" * weights.stat().st_size)
    doc = _json(["push", str(root), url])
    assert doc["replaced_blobs"] == 1
    assert aws.client().get_object(Bucket=aws.bucket, Key=key)["Body"].read() == weights.read_bytes()
    got = _json(["pull", f"{url}/{root.name}", str(tmp_path / "d")])
    assert Path(got["bundle"]).is_dir()
