"""cache prune / cache ls: least recently used first, last use recorded on hits, refused while a build holds
the cache (no compile: entries are published from small files through the cache's own publish)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from neffbuild.compiler.cache import Cache
from neffbuild.compiler.prune import parse_size, prune
from neffbuild.errors import InvalidInput, NeffbuildError
from tests.conftest import ROOT


def _entry(cache: Cache, key: str, size: int, used_at: float):
    tmp = cache.new_tmp(key)
    (tmp / "artifact.pt2").write_bytes(b"x" * size)
    cache.publish(key, tmp, tmp / "artifact.pt2", {"label": f"t_{key[:4]}", "compile_seconds": 1.0})
    assert cache.get(key) is not None  # a use: touches the record
    os.utime(cache.entries_dir / key / "used", (used_at, used_at))


@pytest.fixture
def cache(tmp_path):
    c = Cache(tmp_path / "c").ensure()
    now = time.time()
    for i, (size, age_days) in enumerate([(3000, 10), (2000, 1), (1000, 5)]):
        _entry(c, f"{i:064x}", size, now - age_days * 86400)
    return c


K0, K1, K2 = (f"{i:064x}" for i in range(3))


def test_max_size_removes_least_recently_used_first(cache):
    dry = prune(cache, max_bytes=2500, dry_run=True)
    assert [e["key"] for e in dry["removed"]] == [K0, K2] and len(cache.list()) == 3  # dry run changes nothing
    res = prune(cache, max_bytes=2500)
    assert [e["key"] for e in res["removed"]] == [K0, K2] and [e["key"] for e in cache.list()] == [K1]


def test_unused_for_and_a_hit_records_use(cache):
    assert cache.get(K0) is not None  # used now: no longer the oldest
    res = prune(cache, unused_for_s=2 * 86400)
    assert [e["key"] for e in res["removed"]] == [K2]
    assert sorted(e["key"] for e in cache.list()) == [K0, K1]


def test_refused_while_a_build_holds_the_cache(cache):
    with cache.hold(), pytest.raises(NeffbuildError, match="a build is using"):
        prune(cache, max_bytes=0)
    assert len(cache.list()) == 3


@pytest.mark.parametrize("text,want", [("500M", 500 << 20), ("2G", 2 << 30), ("1.5GiB", int(1.5 * (1 << 30))),
                                       ("1048576", 1048576)])
def test_parse_size(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("text", ["lots", "5Q", "-1G"])
def test_parse_size_errors(text):
    with pytest.raises(InvalidInput, match="--max-size"):
        parse_size(text)


def test_cli_ls_and_prune(cache):
    run = lambda *a: subprocess.run([sys.executable, "-m", "neffbuild.cli.main", "cache", *a, "--cache-dir",
                                     str(cache.root)], capture_output=True, text=True, cwd=ROOT)
    ls = run("ls")
    assert ls.returncode == 0 and "used 10.0 days ago" in ls.stdout and "MB" in ls.stdout
    doc = json.loads(run("prune", "--unused-for", "7", "--dry-run", "--json").stdout)
    assert [e["key"] for e in doc["removed"]] == [K0] and doc["dry_run"]
    bad = run("prune")
    assert bad.returncode == 2 and "give --max-size SIZE and/or --unused-for DAYS" in bad.stderr
    assert "Traceback" not in bad.stderr
