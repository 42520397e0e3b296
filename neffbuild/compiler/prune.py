"""``cache prune``: drop local cache entries, least recently used first.

Last use is the mtime of each entry's ``used`` file, touched on every hit (compiler/cache.py),
else its creation time. ``max_bytes``: remove the least recently used entries until the rest
fit. ``unused_for_s``: remove every entry not used for that long. Both may be given. Pruning
takes the cache's hold lock exclusively and without waiting, so it refuses while a build
holds the cache (a build's hits are never removed under it). Corrupt entries are removed too
(they are misses anyway), but only folders shaped like an entry (named by a key, meta.json and
regular files only: ``looks_like_entry``), never a link. A folder without neffbuild's own
``CACHEDIR.TAG`` is refused before anything is written (so prune never marks a foreign tree),
and ``--dry-run`` writes nothing at all (no lock, no marker). The remote tier is never touched.
"""

from __future__ import annotations

import contextlib
import re
import time

from neffbuild.compiler.cache import Cache, looks_like_entry, not_a_cache
from neffbuild.errors import InvalidInput, NeffbuildError

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "MIB": 1 << 20,
          "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30, "T": 1 << 40, "TB": 1 << 40, "TIB": 1 << 40}


def parse_size(value: str) -> int:
    """``500M``, ``2GB``, ``1.5GiB``, ``1048576`` -> bytes (binary units); InvalidInput naming ``--max-size``."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).upper() not in _UNITS:
        raise InvalidInput(f"--max-size: got {value!r}, expected a size such as 500M, 20G or 1048576 (bytes)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def entries(cache: Cache) -> list[dict]:
    """Every entry folder: key, label, bytes on disk, last use, valid; least recently used first."""
    out = []
    if not cache.entries_dir.is_dir() or cache.entries_dir.is_symlink():
        return out
    for folder in cache.entries_dir.iterdir():
        if not looks_like_entry(folder):
            continue  # not an entry this cache wrote: never pruned
        entry = cache.get(folder.name, discard=False)
        out.append({"key": folder.name, "label": entry.meta.get("label", "?") if entry else "?",
                    "bytes": cache.entry_bytes(folder.name), "last_used": cache.last_used(folder.name),
                    "valid": entry is not None})
    out.sort(key=lambda e: (e["valid"], e["last_used"], e["key"]))
    return out


def prune(cache: Cache, *, max_bytes: int | None = None, unused_for_s: float | None = None,
          dry_run: bool = False, now: float | None = None) -> dict:
    """Remove (or with ``dry_run`` only list) what the limits select: {"removed", "kept", "freed_bytes", ...}."""
    if max_bytes is None and unused_for_s is None:
        raise InvalidInput("cache prune: give --max-size SIZE and/or --unused-for DAYS")
    now = time.time() if now is None else now
    if not cache.base.is_dir() or cache.base.is_symlink():  # nothing there: nothing to prune, nothing created
        return {"dry_run": dry_run, "removed": [], "kept": [], "freed_bytes": 0, "kept_bytes": 0}
    why = not_a_cache(cache.base)
    if why:
        raise InvalidInput(f"cache prune {cache.root}: {why}; nothing removed (is --cache-dir right?)")
    try:
        with contextlib.nullcontext() if dry_run else cache.hold(exclusive=True):
            all_entries = entries(cache)
            doomed = [e for e in all_entries if not e["valid"]
                      or (unused_for_s is not None and now - e["last_used"] > unused_for_s)]
            rest = [e for e in all_entries if e not in doomed]
            if max_bytes is not None:
                total = sum(e["bytes"] for e in rest)
                for e in list(rest):  # least recently used first
                    if total <= max_bytes:
                        break
                    doomed.append(e)
                    rest.remove(e)
                    total -= e["bytes"]
            if not dry_run:
                for e in doomed:
                    cache.remove(e["key"])
    except BlockingIOError:
        raise NeffbuildError(f"cache prune: a build is using {cache.root} (it holds the cache lock); "
                             f"run prune when no compile is running") from None
    return {"dry_run": dry_run, "removed": doomed, "kept": rest, "freed_bytes": sum(e["bytes"] for e in doomed),
            "kept_bytes": sum(e["bytes"] for e in rest)}
