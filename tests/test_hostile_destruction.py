"""Hostile folders: ``cache clear`` / ``cache prune`` act only on a tree neffbuild created (its own CACHEDIR.TAG)
and delete only what neffbuild writes there; a failed compile replaces only a failed-logs folder it wrote.

Each case: a folder someone else owns loses nothing and gains no neffbuild marker."""

from __future__ import annotations

import os
import time

import pytest

from neffbuild.bundle import paths
from neffbuild.bundle.writer import BundleWriter
from neffbuild.compiler.builder import LOGS_MARKER, _keep_logs
from neffbuild.compiler.cache import CACHE_VERSION, MARKER, MARKER_TEXT, Cache
from neffbuild.compiler.prune import prune
from neffbuild.errors import InvalidInput
from tests.helpers import run_cli

OTHER_TAG = "Signature: 8a477f597d28d172789f06886806bc55\n# This file is a cache directory tag created by ccache.\n"


def _photo(base):
    (base / "entries" / "photos").mkdir(parents=True)
    (base / "entries" / "photos" / "a.jpg").write_bytes(b"jpg")


def _only_cache_named_folders(base):
    _photo(base)
    for d in ("tmp", "locks", "prekeys"):
        (base / d).mkdir()


def _another_tools_tag(base):
    _photo(base)
    (base / MARKER).write_text(OTHER_TAG)


def _key_named_folder_of_photos(base):
    folder = base / "entries" / ("a" * 64)
    folder.mkdir(parents=True)
    (folder / "a.jpg").write_bytes(b"jpg")


def _tag_as_a_link_to_ours(base):
    _photo(base)
    real = base.parent / "real.tag"
    real.write_text(MARKER_TEXT)
    (base / MARKER).symlink_to(real)


FOREIGN = [  # (id, how the foreign folder X/v1 is laid out)
    ("only-cache-named-folders", _only_cache_named_folders),
    ("another-tools-cachedir-tag", _another_tools_tag),
    ("a-key-named-folder-without-marker", _key_named_folder_of_photos),
    ("a-link-to-a-neffbuild-tag", _tag_as_a_link_to_ours),
]


def _tree(root):
    return sorted((p.relative_to(root).as_posix(), p.read_bytes() if p.is_file() and not p.is_symlink() else None)
                  for p in root.rglob("*"))


@pytest.mark.parametrize("layout", [c[1] for c in FOREIGN], ids=[c[0] for c in FOREIGN])
def test_clear_and_prune_refuse_a_foreign_folder_and_write_nothing_into_it(tmp_path, layout):
    root = tmp_path / "X"
    base = root / f"v{CACHE_VERSION}"
    base.mkdir(parents=True)
    layout(base)
    before = _tree(root)
    with pytest.raises(InvalidInput, match="nothing removed"):
        prune(Cache(root), max_bytes=0)
    code, _, err, unhandled = run_cli("cache", "clear", "--yes", "--cache-dir", str(root))
    assert unhandled is None and code == 2 and "written by neffbuild" in err, err
    Cache(root).ensure()  # a compile using the folder: it may add its folders, never the marker
    assert not (base / MARKER).exists() or (base / MARKER).is_symlink() or (base / MARKER).read_text() == OTHER_TAG
    with pytest.raises(InvalidInput):  # so a later clear still refuses it
        Cache(root).clear()
    after = dict(_tree(root))
    assert all(after.get(path) == data for path, data in before), "a foreign file was changed or removed"


def _entry(cache: Cache, key: str):
    tmp = cache.new_tmp(key)
    (tmp / "artifact.pt2").write_bytes(b"x" * 100)
    cache.publish(key, tmp, tmp / "artifact.pt2", {"label": "t", "compile_seconds": 1.0})
    assert cache.get(key) is not None  # a hit: writes "used"


def test_clear_and_prune_delete_only_what_looks_like_an_entry(tmp_path):
    cache = Cache(tmp_path / "c").ensure()
    keys = [f"{i:064x}" for i in range(3)]
    for key in keys:
        _entry(cache, key)
    _photo(cache.base)  # under entries/, not key-named
    odd = cache.entries_dir / ("b" * 64)  # key-named, but a folder of folders: not an entry
    (odd / "album").mkdir(parents=True)
    (odd / "album" / "b.jpg").write_bytes(b"jpg")
    (cache.tmp_dir / "notes.txt").write_text("mine")  # not a work folder's name: never swept or cleared
    assert cache.sweep() == 0 and (cache.tmp_dir / "notes.txt").exists()
    old = time.time() - 30 * 86400
    os.utime(cache.entries_dir / keys[0] / "used", (old, old))
    res = prune(cache, unused_for_s=86400)
    assert [e["key"] for e in res["removed"]] == [keys[0]] and (odd / "album" / "b.jpg").exists()
    assert cache.clear() == 2
    assert not any(cache.entries_dir.glob("0" * 63 + "*"))
    assert (cache.entries_dir / "photos" / "a.jpg").read_bytes() == b"jpg" and (odd / "album" / "b.jpg").exists()
    assert (cache.tmp_dir / "notes.txt").read_text() == "mine"
    assert (cache.base / MARKER).exists()  # someone's files remain: the tree stays, still recognised


def test_clear_of_a_cache_with_nothing_foreign_removes_its_whole_tree(tmp_path):
    cache = Cache(tmp_path).ensure()
    for i in range(3):
        _entry(cache, f"{i:064x}")
    cache.put_pre("c" * 64, f"{0:064x}")
    with cache.lock(f"{1:064x}"):
        pass
    (tmp_path / "mine.txt").write_text("keep")
    code, out, err, _ = run_cli("cache", "clear", "--yes", "--cache-dir", str(tmp_path))
    assert code == 0 and "removed 3 entries" in out, err
    assert not cache.base.exists() and (tmp_path / "mine.txt").read_text() == "keep"


# -- a failed compile's logs ------------------------------------------------------------------------------------

def _ours(dest):
    dest.mkdir()
    (dest / LOGS_MARKER).write_text("x")
    (dest / "old.log").write_text("old")


def _foreign_dir(dest):
    dest.mkdir()
    (dest / "report.txt").write_text("mine")


def _a_file(dest):
    dest.write_text("mine")


def _a_link(dest):
    target = dest.parent / "elsewhere"
    target.mkdir()
    (target / "keep").write_text("mine")
    dest.symlink_to(target, target_is_directory=True)


LOGS = [  # (id, what is at <out>/<name>-<version>.failed-logs before the build, where the logs must go)
    ("none", lambda dest: None, ""),
    ("a-failed-logs-folder-neffbuild-wrote", _ours, ""),
    ("someone-elses-folder", _foreign_dir, ".1"),
    ("a-file", _a_file, ".1"),
    ("a-link", _a_link, ".1"),
]


@pytest.mark.parametrize("before,suffix", [c[1:] for c in LOGS], ids=[c[0] for c in LOGS])
def test_a_failed_build_replaces_only_a_logs_folder_it_wrote(tmp_path, before, suffix, caplog):
    out = tmp_path / "out"
    out.mkdir()
    wanted = out / "m-0.1.0.failed-logs"
    before(wanted)
    kept = _tree(tmp_path) if suffix else []
    writer = BundleWriter(out, "m", "0.1.0")
    (writer.path(paths.LOGS_DIR) / "decode_b1.log").write_text("the error")
    try:
        dest = _keep_logs(writer, out)
    finally:
        writer.abort()
    assert dest == out / f"m-0.1.0.failed-logs{suffix}"
    assert (dest / "decode_b1.log").read_text() == "the error" and (dest / LOGS_MARKER).is_file()
    assert not (dest / "old.log").exists()
    after = dict(_tree(tmp_path))
    assert all(after.get(path) == data for path, data in kept)  # someone's folder, file or link: untouched
    assert (str(dest) in caplog.text) == bool(suffix)
