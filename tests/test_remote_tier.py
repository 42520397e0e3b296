"""RemoteCache push/fetch rules on small entries (no compile), against the moto S3 server through boto3."""

from __future__ import annotations

import json

import pytest

from neffbuild.compiler.cache import Cache
from neffbuild.compiler.jobs import Job
from neffbuild.compiler.remote_cache import RemoteCache
from neffbuild.compiler.remote_tier import for_worker, parse_shard, shard_slice
from neffbuild.errors import InvalidInput

KEY = "ab" * 32


def _env(monkeypatch, server, who="rw"):
    for k, v in server.env(who).items():
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)


def _local(root, data: bytes = b"compiled bytes", key: str = KEY):
    cache = Cache(root).ensure()
    tmp = cache.new_tmp(key)
    (tmp / "artifact.pt2").write_bytes(data)
    return cache, cache.publish(key, tmp, tmp / "artifact.pt2", {"label": "t", "compile_seconds": 1.0,
                                                                 "input_signature": [], "ext": "pt2"})


def test_push_then_fetch_into_a_fresh_cache(monkeypatch, s3_server, tmp_path):
    _env(monkeypatch, s3_server)
    url = s3_server.url()
    _, entry = _local(tmp_path / "a")
    rc = RemoteCache(url)
    assert rc.push(entry, pre="cd" * 32) == "pushed" and rc.push(entry) == "present"
    assert rc.stats.pushes == 1
    fresh = Cache(tmp_path / "b").ensure()
    rc2 = RemoteCache(url)
    got = rc2.fetch_pre(fresh, "cd" * 32)
    assert got is not None and got.path.read_bytes() == b"compiled bytes" and rc2.stats.hits == 1
    assert fresh.get(KEY) is not None and fresh.get_pre("cd" * 32) is not None


def test_corrupt_object_is_a_counted_miss_and_is_kept(monkeypatch, s3_server, tmp_path):
    _env(monkeypatch, s3_server)
    url = s3_server.url()
    _, entry = _local(tmp_path / "a")
    RemoteCache(url).push(entry)
    art = [k for k in s3_server.keys(url) if k.endswith(".pt2")][0]
    s3_server.client().put_object(Bucket=s3_server.bucket, Key=art, Body=b"compiled bytez")
    rc = RemoteCache(url)
    assert rc.fetch(Cache(tmp_path / "b").ensure(), KEY) is None
    assert rc.stats.errors == 1 and "does not match the sha256" in rc.stats.warnings[0]
    assert s3_server.client().get_object(Bucket=s3_server.bucket, Key=art)["Body"].read() == b"compiled bytez"
    assert not list((tmp_path / "b" / "v1" / "tmp").iterdir())  # the download left nothing behind
    assert rc.rejected == {KEY} and rc.fetch(Cache(tmp_path / "c").ensure(), KEY) is None
    assert rc.stats.errors == 1  # a rejected key is not fetched (nor counted) again in this process
    job = Job("t", None, {}, str(tmp_path), str(tmp_path / "log"), remote=(url, "auto"))
    assert for_worker(rc, job).remote_skip == (KEY,)  # the worker is told not to try it again
    rc.down = "unreachable"
    assert for_worker(rc, job).remote is None  # a remote found down is not asked by the workers either


def test_lost_race_with_other_bytes_says_not_reproducible(monkeypatch, s3_server, tmp_path):
    _env(monkeypatch, s3_server)
    url = s3_server.url()
    _, mine = _local(tmp_path / "a", b"my bytes")
    rc = RemoteCache(url)
    art = rc._key("entries", KEY, "artifact.pt2")
    s3_server.client().put_object(Bucket=s3_server.bucket, Key=art, Body=b"their bytes")  # the winner, mid-push
    assert rc.push(mine) == "lost-race" and rc.stats.pushes == 0
    assert "not reproducible" in rc.stats.warnings[0]
    assert not any(k.endswith("meta.json") for k in s3_server.keys(url))  # no record for someone else's bytes


def test_auto_mode_turns_read_only_once(monkeypatch, s3_server, tmp_path):
    _env(monkeypatch, s3_server, "ro")
    url = s3_server.url()
    _, entry = _local(tmp_path / "a")
    rc = RemoteCache(url, "auto")
    assert rc.push(entry) == "skipped" and rc.state == "read-only" and rc.stats.errors == 0
    assert rc.push(entry) == "skipped" and len(rc.stats.warnings) == 1
    rw = RemoteCache(url, "rw")
    assert rw.push(entry) == "error" and rw.stats.errors == 1 and rw.state == "read-write"
    assert RemoteCache(url, "ro").push(entry) == "skipped"
    assert s3_server.keys(url) == {}


def test_shards_are_disjoint_and_cover_the_grid():
    targets = list(range(9))
    slices = [shard_slice(targets, i, 4) for i in range(1, 5)]
    assert sorted(t for s in slices for t in s) == targets and slices[0] == [0, 4, 8]
    assert parse_shard("2/3") == (2, 3)
    for bad in ("0/2", "3/2", "x", "1/2/3"):
        with pytest.raises(InvalidInput, match="--shard"):
            parse_shard(bad)


class Silent:
    """A TCP server that accepts connections and never answers (a hung remote)."""

    def __init__(self):
        import socket
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.held = []
        self.endpoint = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                self.held.append(self.sock.accept()[0])
            except OSError:
                return

    def close(self):
        for c in self.held:
            c.close()
        self.sock.close()


@pytest.fixture
def silent(monkeypatch, s3_server):
    server = Silent()
    _env(monkeypatch, s3_server)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", server.endpoint)
    yield server
    server.close()


def test_a_remote_that_never_answers_is_found_down_in_seconds(silent, capfd):
    import time

    from neffbuild.s3_probe import PROBE_CONNECT_S, PROBE_READ_S

    rc = RemoteCache("s3://neffbuild-test/hung")
    t0 = time.monotonic()
    assert rc.probe() is False
    took = time.monotonic() - t0
    assert took < PROBE_CONNECT_S + PROBE_READ_S + 5 and rc.state == "unreachable" and rc.client is None
    assert "waiting for the remote cache s3://neffbuild-test/hung" in capfd.readouterr().err
    assert any("building without it" in w for w in rc.stats.warnings)


def test_cache_remote_check_of_a_hung_remote_says_it_waits(silent):
    import time

    from tests.helpers import cli

    t0 = time.monotonic()
    res = cli("cache", "remote", "check", "s3://neffbuild-test/hung", "--json", process=True, timeout=120)
    assert res.returncode == 1 and time.monotonic() - t0 < 40, res.stderr
    assert "waiting for s3://neffbuild-test/hung" in res.stderr and "Traceback" not in res.stderr
    doc = json.loads(res.stdout)
    assert doc["readable"] is False and doc["errors"]
