"""The C++ objects of AOTInductor's compiles, kept by content: a translation unit g++ already compiled on this
machine, from the same bytes with the same command, is not compiled again.

Why: a neffbuild cache key covers neffbuild's own source (compiler/sources.py), so any change to neffbuild (a
docstring) misses every entry, and a graph built into a fresh cache (a new CI job on a warm machine, a remote
entry rejected and rebuilt) is compiled from scratch, although inductor writes the same C++ for it: the same
wrapper and kernel files under the same content-named paths. g++ is about half of a compile's CPU (the wrapper
alone ~6 s of ~20 for the 2-layer test graph), so such a rebuild skips that half and still traces, lowers and
smoke-runs as any compile does.

The key: the whole command line (compiler, every flag, the source and output paths), the compiler's own
``--version`` line, torch's version (its headers are the -I folders), and the bytes of every input the command
names (its sources and ``-include`` headers; a wrapper's trailing build-command comments, which inductor appends
after each build, left out). Only compile-only steps (``-c``: a source to one object) are kept;
linking, precompiled headers and preprocessing run as they are. An object is stored only after g++ succeeded, by
rename (a killed build leaves a temporary file, never a half object under a key); a failing compiler stores
nothing, and another compiler (``$CXX``) is another key. Objects live beside inductor's own caches
(``<inductor cache dir>/neffbuild-objects``: per user, shared by every process and worker on the machine), at most
``MAX_OBJECTS`` of them (least recently used go first). ``NEFFBUILD_OBJECT_CACHE=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import torch

KEY_VERSION = "neffbuild-objects-v1"
MAX_OBJECTS = 400  # ~1-3 MB an object: under a GiB
ENV = "NEFFBUILD_OBJECT_CACHE"


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def root() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "neffbuild-objects" / "v1"


@functools.lru_cache(maxsize=8)
def version_line(compiler: str) -> str | None:
    """The first line of ``<compiler> --version`` ("" when it prints nothing), or None when it cannot be run: the
    compiler's identity here and in the inductor backend's fingerprint (``cxx_version``)."""
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.splitlines() or [""])[0].strip()


def _inputs(argv: list[str], sources: list[str]) -> list[str]:
    """The files the command reads that differ between compiles: its sources and its ``-include`` headers."""
    names = list(sources)
    names += [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "-include"]
    return names


_BUILD_NOTES = b"\n// Compile cmd\n"


def _code(data: bytes) -> bytes:
    """A source's code: inductor appends the commands of each build to its wrapper as comments after compiling, so
    the same graph's file grows by a comment block a build; the object does not change with them."""
    cut = data.find(_BUILD_NOTES)
    return data if cut < 0 else data[:cut]


def key(command: str, sources: list[str]) -> str | None:
    """The object's key, or None where it cannot be kept (no compiler identity, an input missing)."""
    try:
        argv = shlex.split(command)
    except ValueError:
        return None
    if not argv or "-c" not in argv:
        return None
    ident = version_line(argv[0])
    if not ident:  # no identity: nothing is kept for this compiler
        return None
    h = hashlib.sha256()
    for part in (KEY_VERSION, command, ident, torch.__version__):
        h.update(part.encode() + b"\0")
    for name in _inputs(argv, sources):
        try:
            data = _code(Path(name).read_bytes())
        except OSError:
            return None
        h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest()


def fetch(k: str, target: str) -> bool:
    """Copy the kept object ``k`` to ``target`` (True), or False when there is none."""
    src = root() / k[:2] / f"{k}.o"
    tmp = f"{target}.neffbuild-tmp-{os.getpid()}"
    try:
        shutil.copyfile(src, tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except OSError:
        Path(tmp).unlink(missing_ok=True)
        return False
    with contextlib.suppress(OSError):
        os.utime(src)  # recently used: evicted last
    return True


def store(k: str, target: str) -> None:
    """Keep the object g++ just wrote at ``target`` under ``k`` (best effort: a full disk loses nothing)."""
    folder = root() / k[:2]
    dest = folder / f"{k}.o"
    tmp = folder / f".{k}.{os.getpid()}.tmp"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(target, tmp)
        os.replace(tmp, dest)
    except OSError:
        tmp.unlink(missing_ok=True)
        return
    _evict()


def _evict() -> None:
    """At most MAX_OBJECTS objects: the least recently used go."""
    try:
        kept = [(p.stat().st_mtime, p) for p in root().glob("*/*.o")]
    except OSError:
        return
    if len(kept) <= MAX_OBJECTS:
        return
    for _, p in sorted(kept)[: len(kept) - MAX_OBJECTS]:
        p.unlink(missing_ok=True)


def builder_parts(builder) -> tuple[list[str], str] | None:
    """(sources, target) of an inductor ``CppBuilder`` that compiles one source to an object, else None."""
    if not getattr(builder, "_compile_only", False) or getattr(builder, "_precompiling", False) \
            or getattr(builder, "_preprocessing", False):
        return None
    target = str(getattr(builder, "_target_file", "") or "")
    try:
        sources = shlex.split(str(getattr(builder, "_sources_args", "") or ""))
    except ValueError:
        return None
    if not target.endswith(".o") or not sources:
        return None
    return sources, target
