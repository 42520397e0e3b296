"""A bundle's manifest read from disk, and its paths resolved inside the bundle: standard library only.

What the commands that read a bundle without running it need (``inspect``, ``inspect --vllm-config``, ``diff``):
it imports no torch, so they start in 0.3 s instead of 3 (tests/test_cli_startup.py). runtime/bundle/reader.py
(opening a bundle to serve it, ``check``) builds on it and re-exports ``read_manifest`` and ``safe_path``.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath

from neffbuild.errors import BundleError, IncompatibleBundle, short_repr
from neffbuild.fsutil import no_duplicate_keys
from neffbuild.runtime.bundle import paths
from neffbuild.runtime.bundle.weights_file import json_depth_ok

MAX_MANIFEST_BYTES = 64 * 1024 * 1024
MAX_MANIFEST_DEPTH = 32


def safe_path(root: Path, rel: object) -> Path:
    """Resolve a manifest path inside the bundle, refusing escapes and symlinks."""
    if not isinstance(rel, str) or not rel or "\\" in rel or "\x00" in rel:
        raise BundleError(f"{root}: manifest path {short_repr(rel)} is not a relative POSIX path")
    pure = PurePosixPath(rel)
    if pure.is_absolute() or ".." in pure.parts:
        raise BundleError(f"{root}: manifest path {rel!r} points outside the bundle")
    p = root
    for part in pure.parts:
        p = p / part
        if p.is_symlink():
            raise BundleError(f"{root}: manifest path {rel!r} goes through a symbolic link ({p.name})")
    return p


def manifest_bytes(root: Path) -> bytes:
    mpath = root / paths.MANIFEST_PATH
    if not mpath.is_file() or mpath.is_symlink():
        raise BundleError(f"{root}: no {paths.MANIFEST_PATH} (a regular file); not a neffbuild bundle")
    try:
        size = mpath.stat().st_size
        if size > MAX_MANIFEST_BYTES:
            raise BundleError(f"{mpath}: {size} bytes is over the {MAX_MANIFEST_BYTES}-byte manifest limit")
        return mpath.read_bytes()
    except OSError as exc:
        raise BundleError(f"{mpath}: unreadable manifest ({exc.strerror or exc})") from None


def read_manifest(root: Path) -> dict:
    """The parsed manifest: bounded size and depth, no duplicate keys, this format and a supported version."""
    mpath = root / paths.MANIFEST_PATH
    raw = manifest_bytes(root)
    try:
        text = raw.decode("utf-8")
        if not json_depth_ok(text, MAX_MANIFEST_DEPTH):
            raise ValueError(f"nested deeper than {MAX_MANIFEST_DEPTH} levels")
        m = json.loads(text, object_pairs_hook=no_duplicate_keys, parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise BundleError(f"{mpath}: unreadable manifest ({short_repr(str(exc), 160)})") from None
    if not isinstance(m, dict) or m.get("format") != paths.BUNDLE_FORMAT:
        got = short_repr(m.get("format") if isinstance(m, dict) else None)
        raise IncompatibleBundle(f"{mpath}: format is {got}, expected {paths.BUNDLE_FORMAT!r}")
    v = m.get("format_version")
    if not isinstance(v, int) or isinstance(v, bool) or v not in paths.SUPPORTED_FORMAT_VERSIONS:
        raise IncompatibleBundle(f"{mpath}: format_version {short_repr(v)} is not supported by this "
                                 f"reader (supported: {list(paths.SUPPORTED_FORMAT_VERSIONS)}); rebuild the bundle "
                                 "or use the neffbuild that built it")
    return m


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not standard JSON")
