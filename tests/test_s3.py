"""neffbuild.s3 against a real S3 server (moto, server mode, IAM enforced) through boto3."""

from __future__ import annotations

import pytest

from neffbuild import s3
from neffbuild.errors import InvalidInput
from tests.s3_server import closed_endpoint


@pytest.mark.parametrize("url,bucket,prefix", [
    ("s3://my-cache", "my-cache", ""),
    ("s3://my-cache/", "my-cache", ""),
    ("s3://my-cache/a/b/", "my-cache", "a/b"),
])
def test_parse_url(url, bucket, prefix):
    u = s3.parse_url(url)
    assert (u.bucket, u.prefix) == (bucket, prefix)
    assert u.key("k", "x.json") == "/".join(p for p in (prefix, "k", "x.json") if p)


@pytest.mark.parametrize("url,needle", [
    ("http://x/y", "expected s3://BUCKET/PREFIX"),
    ("s3://", "not a valid bucket name"),
    ("s3://Upper/x", "not a valid bucket name"),
    ("s3://ok-bucket/a//b", "empty, '.' or '..' part"),
    ("s3://ok-bucket/a/../b", "empty, '.' or '..' part"),
])
def test_parse_url_errors(url, needle):
    with pytest.raises(InvalidInput, match="--cache-remote") as exc:
        s3.parse_url(url)
    assert needle in str(exc.value)


def _remote(monkeypatch, server, who):
    for k, v in server.env(who).items():
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    return s3.open_remote(server.url())


def test_create_only_ranged_get_list(monkeypatch, s3_server):
    r = _remote(monkeypatch, s3_server, "rw")
    k = r.url.key("entries", "a.bin")
    assert r.put_if_absent(k, b"0123456789") is True
    assert r.put_if_absent(k, b"other") is False  # If-None-Match: the first writer wins
    assert r.get(k, limit=10) == b"0123456789" and r.get(k, limit=3, byte_range=(2, 4)) == b"234"
    assert r.get(r.url.key("missing"), limit=1) is None and r.head(r.url.key("missing")) is None
    assert r.head(k)["size"] == 10
    assert [o["key"] for o in r.list("entries")] == [k]


def test_read_only_credentials_are_denied_writes(monkeypatch, s3_server):
    rw = _remote(monkeypatch, s3_server, "rw")
    k = rw.url.key("x")
    rw.put(k, b"x")
    ro_env = s3_server.env("ro")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ro_env["AWS_ACCESS_KEY_ID"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", ro_env["AWS_SECRET_ACCESS_KEY"])
    ro = s3.S3Remote(rw.url)
    assert ro.get(k, limit=1) == b"x"
    with pytest.raises(s3.RemoteError) as exc:
        ro.put_if_absent(rw.url.key("y"), b"y")
    assert exc.value.kind == s3.DENIED and exc.value.status == 403
    assert ro_env["AWS_SECRET_ACCESS_KEY"] not in str(exc.value)
    assert ro_env["AWS_ACCESS_KEY_ID"] not in str(exc.value)
    assert rw.get(rw.url.key("y"), limit=1) is None


def test_unknown_key_and_closed_port_are_classified(monkeypatch, s3_server):
    r = _remote(monkeypatch, s3_server, "none")
    with pytest.raises(s3.RemoteError) as exc:
        r.get(r.url.key("x"), limit=1)
    assert exc.value.kind == s3.DENIED and "not-a-secret" not in str(exc.value)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", closed_endpoint())
    r = s3.open_remote("s3://neffbuild-test/p", connect_timeout=1, attempts=1)
    with pytest.raises(s3.RemoteError) as exc:
        r.get(r.url.key("x"), limit=1)
    assert exc.value.kind == s3.UNREACHABLE and "cannot reach http://127.0.0.1:" in str(exc.value)
