"""The machine's C++ object cache (neffbuild/compiler/backends/objects.py): a translation unit compiled before from
the same bytes by the same command is not compiled again, and nothing else is reused.

The unit table runs the real g++ on a one-function source; the rebuild test compiles one graph into two fresh
neffbuild caches through the session's warm pool: the second compile (a miss for neffbuild's cache) takes the
wrapper's and the kernels' objects from the machine and writes the same artifact bytes.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from neffbuild.compiler.backends import objects
from tests.helpers import build_bundle, write_recipe

SOURCE = "int neffbuild_probe(int x) { return 3 * x + %d; }\n"
GXX = shutil.which("g++")


@pytest.fixture
def object_root(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    return tmp_path


def _compile(folder: Path, n: int, compiler: str = "g++", flags: str = "-O2") -> tuple[str, str]:
    src, out = folder / "probe.cpp", folder / "probe.o"
    src.write_text(SOURCE % n)
    cmd = f"{compiler} {src} {flags} -c -o {out}"
    return cmd, str(out)


def _gxx(cmd: str) -> None:
    subprocess.run(cmd.split(), check=True, capture_output=True)


@pytest.mark.skipif(GXX is None, reason="needs g++")
def test_the_same_bytes_and_command_give_the_kept_object_and_any_change_misses(object_root):
    cmd, out = _compile(object_root, 1)
    k = objects.key(cmd, [str(object_root / "probe.cpp")])
    assert k is not None and not objects.fetch(k, out)  # nothing kept yet
    _gxx(cmd)
    made = Path(out).read_bytes()
    objects.store(k, out)
    Path(out).unlink()
    assert objects.fetch(k, out) and Path(out).read_bytes() == made
    src = [str(object_root / "probe.cpp")]
    # inductor's appended build comments are not code: the same key
    (object_root / "probe.cpp").write_text(SOURCE % 1 + "\n// Compile cmd\n// g++ ... -c -o probe.o\n")
    assert objects.key(cmd, src) == k
    changed = {
        "source": (cmd, lambda: (object_root / "probe.cpp").write_text(SOURCE % 2)),
        "flag": (cmd.replace("-O2", "-O1"), lambda: (object_root / "probe.cpp").write_text(SOURCE % 1)),
        "compiler": (cmd.replace("g++", GXX, 1), lambda: None),
    }
    for what, (other, edit) in changed.items():
        edit()
        assert objects.key(other, src) not in (k, None), what
    # not a compile-only step (a link), no compiler to name, a source that is gone: nothing is kept
    assert objects.key(cmd.replace(" -c ", " -shared "), src) is None
    assert objects.key(cmd.replace("g++", str(object_root / "no-such-compiler"), 1), src) is None
    assert objects.key(cmd, [str(object_root / "gone.cpp")]) is None


@pytest.mark.skipif(GXX is None, reason="needs g++")
def test_at_most_max_objects_are_kept_the_least_recently_used_go(object_root, monkeypatch):
    monkeypatch.setattr(objects, "MAX_OBJECTS", 2)
    cmd, out = _compile(object_root, 1)
    _gxx(cmd)
    keys = [f"{i:02x}" + "0" * 62 for i in range(3)]
    for k in keys:
        objects.store(k, out)
    kept = sorted(p.stem for p in objects.root().glob("*/*.o"))
    assert len(kept) == 2 and keys[0] not in kept  # the oldest went


def test_off_switch_and_build_steps_that_are_never_kept(monkeypatch):
    monkeypatch.setenv(objects.ENV, "0")
    assert not objects.enabled()
    monkeypatch.setenv(objects.ENV, "1")
    assert objects.enabled()

    class Step:
        def __init__(self, **kw):
            self.__dict__.update({"_compile_only": True, "_precompiling": False, "_preprocessing": False,
                                      "_target_file": "/t/w.o", "_sources_args": "/t/w.cpp"}, **kw)

    assert objects.builder_parts(Step()) == (["/t/w.cpp"], "/t/w.o")
    for why in ({"_compile_only": False}, {"_precompiling": True}, {"_preprocessing": True},
                {"_target_file": "/t/w.so"}, {"_sources_args": ""}):
        assert objects.builder_parts(Step(**why)) is None, why


def _kept_builds(bundle: Path) -> list[str]:
    log = next((bundle / "logs").glob("*.log")).read_text()
    return re.findall(r"\('([a-z]+(?::kept)?)', [0-9.]+\)", log.split("== compile profile:")[1].splitlines()[0])


def test_a_rebuild_into_a_fresh_cache_takes_the_objects_and_writes_the_same_bytes(
        small_checkpoint, compile_pool, tmp_path):
    """One graph (b1, the fallback context) into two fresh neffbuild caches: the second is a full compile for
    neffbuild (traced, lowered, smoke-run) whose g++ steps for the wrapper and the kernels are the kept objects."""
    recipe = write_recipe(tmp_path, small_checkpoint, name="objects", num_seqs_buckets=[1], ctx_buckets=[512],
                          serving__max_num_seqs=1)
    first, second = (build_bundle(tmp_path / n, tmp_path / f"cache-{n}", recipe, executor=compile_pool)
                     for n in ("a", "b"))
    assert first.result.built == second.result.built == 1
    builds = _kept_builds(second.bundle)
    # the wrapper's and the kernels' compiles kept; the link (named for the wrapper too) ran
    assert {"wrapper:kept", "kernel:kept", "wrapper"} <= set(builds), builds
    arts = [sorted((b.bundle / "artifacts").glob("*.pt2")) for b in (first, second)]
    assert [p.read_bytes() for p in arts[0]] == [p.read_bytes() for p in arts[1]]
