"""The bundle writer owns only what it made (no compile: BundleWriter on empty temp bundles).

It sweeps only the exact temp names of the bundle it writes whose writer is gone, refuses to replace
a folder that is not a bundle (before any work), and follows no symbolic link in its temp or output paths.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from neffbuild.bundle.writer import BundleWriter
from neffbuild.errors import InvalidInput


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _fake_bundle(folder):
    folder.mkdir()
    (folder / "manifest.json").write_text("{}")
    (folder / "manifest.sha256").write_text("x  manifest.json\n")


def test_sweep_removes_only_this_bundles_dead_temp_folders(tmp_path):
    out, dead = tmp_path / "out", _dead_pid()
    out.mkdir()
    mine = [out / f".m-0.1.0.tmp-{dead}", out / f".m-0.1.0.old-{dead}"]
    others = [out / ".photos.old-2024", out / f".other-0.1.0.tmp-{dead}", out / ".m-0.1.0.tmp-x1",
              out / f".m-0.1.0.tmp-{dead}-keep", out / f".m-0.1.0.old-{os.getpid()}"]
    for p in mine + others:
        p.mkdir()
        (p / "f").write_text("data")
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "f").write_text("keep")
    link = out / f".m-0.1.0.old-{dead + 1}"
    link.symlink_to(victim)
    w = BundleWriter(out, "m", "0.1.0")
    w.abort()
    assert not any(p.exists() for p in mine)
    assert all((p / "f").read_text() == "data" for p in others)
    assert link.is_symlink() and (victim / "f").read_text() == "keep"


@pytest.mark.parametrize("what", ["folder", "file", "link"])
def test_refuses_to_replace_what_is_not_a_bundle(tmp_path, what):
    out = tmp_path / "out"
    out.mkdir()
    final = out / "m-0.1.0"
    if what == "folder":
        final.mkdir()
        (final / "thesis.tex").write_text("years")
    elif what == "file":
        final.write_text("notes")
    else:
        (tmp_path / "elsewhere").mkdir()
        final.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(InvalidInput, match="it is not replaced"):
        BundleWriter(out, "m", "0.1.0")
    assert os.path.lexists(final) and not list(out.glob(".m-0.1.0.tmp-*"))
    if what == "folder":
        assert (final / "thesis.tex").read_text() == "years"


def test_replaces_a_bundle_and_refuses_one_that_turned_into_something_else(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    _fake_bundle(out / "m-0.1.0")
    w = BundleWriter(out, "m", "0.1.0")
    (w.tmp / "manifest.json").write_text('{"new": 1}')
    (w.tmp / "manifest.sha256").write_text("y  manifest.json\n")
    assert w.publish() == out / "m-0.1.0" and (out / "m-0.1.0" / "manifest.json").read_text() == '{"new": 1}'
    assert sorted(p.name for p in out.iterdir()) == ["m-0.1.0"]  # the old one is gone, no temp left
    w2 = BundleWriter(out, "m", "0.1.0")
    (out / "m-0.1.0" / "manifest.sha256").unlink()  # while the build ran, the folder stopped being a bundle
    with pytest.raises(InvalidInput, match="not a bundle"):
        w2.publish()
    w2.abort()


def test_a_symlink_at_the_temp_name_is_refused(tmp_path):
    out, victim = tmp_path / "out", tmp_path / "victim"
    out.mkdir()
    victim.mkdir()
    (out / f".m-0.1.0.tmp-{os.getpid()}").symlink_to(victim)
    with pytest.raises(InvalidInput, match="symbolic link"):
        BundleWriter(out, "m", "0.1.0")
    assert list(victim.iterdir()) == []
