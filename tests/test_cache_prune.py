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


def test_prune_leaves_folders_that_are_not_entries(cache, tmp_path):
    """Only key-named entry folders are pruned: a stranger's folder under entries/ and a link stay."""
    stranger = cache.entries_dir / "photos"
    stranger.mkdir()
    (stranger / "a.jpg").write_bytes(b"jpg")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("mine")
    (cache.entries_dir / ("f" * 64)).symlink_to(outside, target_is_directory=True)
    res = prune(cache, max_bytes=parse_size("100G"))
    assert res["removed"] == [] and (stranger / "a.jpg").read_bytes() == b"jpg"
    assert (outside / "keep").read_text() == "mine" and (cache.entries_dir / ("f" * 64)).is_symlink()


def test_prune_refuses_a_folder_that_is_not_a_cache(tmp_path):
    home = tmp_path / "home"
    (home / "v1" / "entries" / ("a" * 64)).mkdir(parents=True)  # a cache-like path, no marker
    (home / "v1" / "thesis.tex").write_text("years of work")
    with pytest.raises(InvalidInput, match="nothing removed"):
        prune(Cache(home), max_bytes=0)
    assert (home / "v1" / "entries" / ("a" * 64)).is_dir() and (home / "v1" / "thesis.tex").is_file()


@pytest.mark.parametrize("made", [False, True])
def test_dry_run_writes_nothing(tmp_path, made):
    """--dry-run on a folder that is no cache creates no cache folders and no CACHEDIR.TAG (which would later
    let `cache clear` treat it as one)."""
    folder = tmp_path / "docs"
    folder.mkdir()
    if made:
        (folder / "v1").mkdir()
        (folder / "v1" / "notes.txt").write_text("x")
    before = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))
    if made:
        with pytest.raises(InvalidInput):
            prune(Cache(folder), max_bytes=0, dry_run=True)
    else:
        assert prune(Cache(folder), max_bytes=0, dry_run=True)["removed"] == []
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")) == before
