"""Content-addressed compile cache: disposable, versioned apart from the bundle.

Layout under the cache root (``NEFFBUILD_CACHE_DIR``, default ``~/.cache/neffbuild``)::

    v{CACHE_VERSION}/entries/<key>/artifact.<ext>   the compiled file
    v{CACHE_VERSION}/entries/<key>/meta.json        what produced it, its sha256 and size
    v{CACHE_VERSION}/locks/<key>.lock               flock: one compile per key at a time
    v{CACHE_VERSION}/tmp/<key>.<pid>.<rand>/        work in progress, never read
    v{CACHE_VERSION}/prekeys/<pre-key>.json         pre-key -> key (see below)
    v{CACHE_VERSION}/entries/<key>/used              touched on every hit: its mtime is the last use
    v{CACHE_VERSION}/hold.lock                       flock: shared while a build runs, exclusive to prune

Key = sha256 of canonical JSON (sorted keys) over the graph text, the input signature,
the backend fingerprint and the cache version. An entry is written in a temp folder,
validated, then published with ``os.replace``; an unreadable, mismatching or partial
entry is a miss (and is removed). Failures are never published.

Pre-keys make a warm rebuild skip tracing. A pre-key is the sha256 of everything that
determines the traced graph before tracing it (the target's graph spec, the source of the
packages that define the graph, the backend fingerprint); its file records the key that
tracing produced. A pre-key hit still goes through ``get`` of that key, so what the key
covers is unchanged; a stale or unreadable pre-key file is a miss (trace again).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from neffbuild.errors import InvalidInput
from neffbuild.fsutil import pid_alive, sha256_file

# Bump when the key recipe or the entry layout changes; old entries are then ignored.
CACHE_VERSION = 1
META = "meta.json"
USED = "used"  # mtime = last use (atime is unreliable: noatime/relatime mounts)


def canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()


# torch.export's readable graph names the source line of every node: "# File: /abs/path.py:12 in forward".
_FILE_RE = re.compile(r"(# File: )(.+?)(:\d+ in )")


def _source_roots() -> tuple[str, ...]:
    """The folder the graph code comes from: the one holding the ``neffbuild`` package (a checkout's root
    or site-packages)."""
    return (str(Path(__file__).resolve().parents[2]),)


def portable_graph_text(graph_text: str, roots: tuple[str, ...] | None = None) -> str:
    """The graph text with each source path made relative to its checkout (or its site-packages), so two
    checkouts at different paths (a developer's tree, a CI runner's) get one key for one graph."""
    roots = _source_roots() if roots is None else roots

    def relative(m: re.Match) -> str:
        path = m.group(2)
        for root in roots:
            if path.startswith(root.rstrip("/") + "/"):
                return m.group(1) + path[len(root.rstrip("/")) + 1:] + m.group(3)
        cut = path.rfind("/site-packages/")
        return m.group(1) + (path[cut + len("/site-packages/"):] if cut >= 0 else path) + m.group(3)

    return _FILE_RE.sub(relative, graph_text)


def cache_key(graph_text: str, signature: list, fingerprint: dict) -> str:
    """The entry's key; source paths in the graph text do not count (``portable_graph_text``)."""
    parts = {
        "cache_version": CACHE_VERSION,
        "graph_sha256": hashlib.sha256(portable_graph_text(graph_text).encode()).hexdigest(),
        "signature": signature,
        "fingerprint": fingerprint,
    }
    return hashlib.sha256(canonical(parts)).hexdigest()


def pre_key(graph: dict, fingerprint: dict, source_digest: str) -> str:
    return hashlib.sha256(canonical({"cache_version": CACHE_VERSION, "graph": graph, "fingerprint": fingerprint,
                                     "source": source_digest})).hexdigest()


def _meta_ok(meta) -> bool:
    """The fields readers use have the types they expect (a meta.json may be hand-edited or corrupt)."""
    return (isinstance(meta, dict) and isinstance(meta.get("file"), str) and "/" not in meta["file"]
            and meta["file"] not in ("", ".", "..") and isinstance(meta.get("bytes"), int)
            and isinstance(meta.get("sha256"), str) and isinstance(meta.get("label", ""), str)
            and isinstance(meta.get("compile_seconds", 0.0), (int, float))
            and isinstance(meta.get("fingerprint", {}), dict))


@dataclass(frozen=True)
class Entry:
    key: str
    path: Path  # the artifact file
    meta: dict


MARKER = "CACHEDIR.TAG"  # the cache-directory tag backup tools know; clear and prune need neffbuild's own
MARKER_TEXT = "Signature: 8a477f597d28d172789f06886806bc55\n# neffbuild compile cache (neffbuild cache clear)\n"
MARKER_OWN = MARKER_TEXT.split(" (")[0]  # the standard first line, then neffbuild's: another tool's tag is not ours
KEY_RE = re.compile(r"[0-9a-f]{64}")
TMP_RE = re.compile(r"trash\.[0-9a-f]{64}\.[0-9a-f]{8}|[0-9a-f]{64}\.\d+\.[0-9a-f]{8}")  # new_tmp, _discard
LOCK_RE = re.compile(r"[0-9a-f]{64}\.lock")
PRE_RE = re.compile(r"[0-9a-f]{64}\.json|[0-9a-f]{64}\.\d+\.[0-9a-f]{8}\.part")


def not_a_cache(base: Path) -> str | None:
    """Why ``base`` (``root/v{N}``) is not a tree neffbuild created, or None.

    Only neffbuild's own ``CACHEDIR.TAG`` (the standard signature line, then ``# neffbuild compile cache``) makes
    a cache: folders named like the cache's, or another tool's tag, are someone else's."""
    marker = base / MARKER
    if marker.is_file() and not marker.is_symlink():
        with contextlib.suppress(OSError, UnicodeDecodeError), open(marker, encoding="utf-8") as fh:
            if fh.read(200).startswith(MARKER_OWN):
                return None
    return (f"{base} holds no {MARKER} written by neffbuild (the signature line, then '{MARKER_OWN.splitlines()[1]}'"
            f"): a folder neffbuild did not create is never cleared or pruned")


def looks_like_entry(folder: Path) -> bool:
    """A folder ``publish`` wrote: named by a key, a real folder holding meta.json and regular files only (the
    artifact, ``used``). Anything else under ``entries/`` is not neffbuild's to delete."""
    if not KEY_RE.fullmatch(folder.name) or folder.is_symlink() or not folder.is_dir():
        return False
    try:
        files = list(folder.iterdir())
    except OSError:
        return False
    return (len(files) <= 3 and any(f.name == META for f in files)
            and all(f.is_file() and not f.is_symlink() for f in files))


class Cache:
    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser()
        self.base = self.root / f"v{CACHE_VERSION}"
        self.entries_dir = self.base / "entries"
        self.tmp_dir = self.base / "tmp"
        self.locks_dir = self.base / "locks"
        self.prekeys_dir = self.base / "prekeys"

    def ensure(self) -> Cache:
        """The cache's folders; its marker only in a tree this call creates (or an empty one): a folder that
        already holds someone's files is used but never marked, so clear and prune keep refusing it."""
        try:
            fresh = not any(self.base.iterdir())
        except FileNotFoundError:
            fresh = True
        except OSError:
            fresh = False
        for d in (self.entries_dir, self.tmp_dir, self.locks_dir, self.prekeys_dir):
            d.mkdir(parents=True, exist_ok=True)
        if fresh and not (self.base / MARKER).exists():
            with contextlib.suppress(OSError):
                (self.base / MARKER).write_text(MARKER_TEXT)
        return self

    # -- read
    def get(self, key: str, *, discard: bool = True) -> Entry | None:
        """The entry for key if it is complete and its artifact matches its recorded sha256.

        A corrupt entry is a miss; it is removed unless ``discard`` is false (read-only callers).
        """
        folder = self.entries_dir / key
        try:
            meta = json.loads((folder / META).read_text(encoding="utf-8"))
            if not _meta_ok(meta):
                raise ValueError("malformed meta")
            artifact = folder / meta["file"]
            if (meta.get("key") != key or artifact.stat().st_size != meta["bytes"]
                    or sha256_file(artifact) != meta["sha256"]):
                raise ValueError("mismatch")
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            if discard:
                self._discard(folder)
            return None
        if discard:  # a real use (read-only callers such as ls and plan do not count)
            with contextlib.suppress(OSError):
                (folder / USED).touch()
        return Entry(key, artifact, meta)

    def last_used(self, key: str) -> float:
        """When the entry was last used (its creation time if never used since)."""
        folder = self.entries_dir / key
        try:
            return (folder / USED).stat().st_mtime
        except OSError:
            with contextlib.suppress(OSError, ValueError):
                return float(json.loads((folder / META).read_text()).get("created", 0))
        return 0.0

    def entry_bytes(self, key: str) -> int:
        folder = self.entries_dir / key
        return sum(f.stat().st_size for f in folder.iterdir() if f.is_file()) if folder.is_dir() else 0

    @contextlib.contextmanager
    def hold(self, exclusive: bool = False):
        """Shared: a build uses the cache (many at once). Exclusive, non-blocking: prune; raises BlockingIOError
        while any build holds it."""
        self.ensure()
        with open(self.base / "hold.lock", "a+") as fh:
            fcntl.flock(fh, (fcntl.LOCK_EX | fcntl.LOCK_NB) if exclusive else fcntl.LOCK_SH)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def remove(self, key: str) -> None:
        """Delete one entry (prune; never a remote)."""
        self._discard(self.entries_dir / key)

    def get_pre(self, pre: str) -> Entry | None:
        """The entry a pre-key recorded, if both the record and the entry are valid."""
        try:
            key = json.loads((self.prekeys_dir / f"{pre}.json").read_text())["key"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return self.get(key) if isinstance(key, str) else None

    def put_pre(self, pre: str, key: str) -> None:
        """Record pre-key -> key (atomic; a lost race writes the same content)."""
        self.ensure()
        tmp = self.prekeys_dir / f"{pre}.{os.getpid()}.{uuid.uuid4().hex[:8]}.part"
        tmp.write_text(json.dumps({"key": key}))
        os.replace(tmp, self.prekeys_dir / f"{pre}.json")

    def list(self) -> list[dict]:
        """Valid entries; never changes the cache (a corrupt entry is skipped, not removed)."""
        out = []
        if not self.entries_dir.is_dir():
            return out
        for folder in sorted(self.entries_dir.iterdir()):
            entry = self.get(folder.name, discard=False)
            if entry:
                out.append(dict(entry.meta, path=str(entry.path)))
        return out

    def metas(self) -> list[dict]:
        """Every entry's recorded meta, artifacts not hashed (advisory reads: memory and size estimates)."""
        out = []
        if not self.entries_dir.is_dir():
            return out
        for folder in sorted(self.entries_dir.iterdir()):
            try:
                meta = json.loads((folder / META).read_text(encoding="utf-8"))
            except (OSError, ValueError, RecursionError):
                continue
            if isinstance(meta, dict) and _meta_ok(meta):
                out.append(meta)
        return out

    # -- write
    @contextlib.contextmanager
    def lock(self, key: str):
        """Exclusive per-key lock across processes (and hosts sharing a POSIX filesystem)."""
        self.ensure()
        with open(self.locks_dir / f"{key}.lock", "a+") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def new_tmp(self, key: str) -> Path:
        self.ensure()
        path = self.tmp_dir / f"{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        path.mkdir()
        return path

    def publish(self, key: str, tmp: Path, artifact: Path, meta: dict) -> Entry:
        """Validate the work folder, then move it into place atomically. Call under ``lock``."""
        if not artifact.is_file() or artifact.stat().st_size == 0:
            raise RuntimeError(f"backend produced no artifact at {artifact}")
        final_name = artifact.name
        meta = dict(meta, key=key, file=final_name, bytes=artifact.stat().st_size, sha256=sha256_file(artifact),
                    created=time.time())
        for extra in tmp.iterdir():  # keep only the artifact and its meta
            if extra.name != final_name:
                shutil.rmtree(extra) if extra.is_dir() else extra.unlink()
        meta_tmp = tmp / (META + ".part")
        with open(meta_tmp, "w") as f:
            json.dump(meta, f, sort_keys=True, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(meta_tmp, tmp / META)
        dest = self.entries_dir / key
        if dest.exists():
            self._discard(dest)
        os.replace(tmp, dest)
        return Entry(key, dest / final_name, meta)

    def _discard(self, folder: Path) -> None:
        trash = self.tmp_dir / f"trash.{folder.name}.{uuid.uuid4().hex[:8]}"
        with contextlib.suppress(OSError):
            self.ensure()
            os.replace(folder, trash)
            shutil.rmtree(trash, ignore_errors=True)

    def sweep(self) -> int:
        """Remove work folders left by processes that no longer run (a crash or kill -9)."""
        removed = 0
        if not self.tmp_dir.is_dir():
            return 0
        for d in self.tmp_dir.iterdir():
            if not TMP_RE.fullmatch(d.name) or d.is_symlink():
                continue  # not a work folder this cache made
            parts = d.name.split(".")
            pid = int(parts[1]) if len(parts) >= 3 and parts[1].isdigit() else None
            if pid is not None and pid_alive(pid):
                continue
            shutil.rmtree(d, ignore_errors=True)
            removed += 1
        return removed

    def clear(self) -> int:
        """Remove this cache's entries and work files, then its tree if nothing else is left; the number of entries
        removed.

        Refuses (InvalidInput, nothing removed) unless ``v{CACHE_VERSION}/`` holds neffbuild's own marker
        (``NEFFBUILD_CACHE_DIR=$HOME`` must never cost the home folder), and even then deletes only what neffbuild
        writes: key-named entry folders (``looks_like_entry``), its work folders, locks and pre-key records."""
        if not self.base.is_dir() or self.base.is_symlink():
            return 0
        why = not_a_cache(self.base)
        if why:
            raise InvalidInput(f"{self.root}: {why}; nothing removed (is --cache-dir / NEFFBUILD_CACHE_DIR right?)")
        n = 0
        for d, own in ((self.entries_dir, None), (self.tmp_dir, TMP_RE), (self.locks_dir, LOCK_RE),
                       (self.prekeys_dir, PRE_RE)):
            if not d.is_dir() or d.is_symlink():
                continue
            for item in d.iterdir():
                if looks_like_entry(item) if own is None else (own.fullmatch(item.name) and not item.is_symlink()):
                    shutil.rmtree(item, ignore_errors=True) if item.is_dir() else item.unlink(missing_ok=True)
                    n += own is None
            with contextlib.suppress(OSError):
                d.rmdir()  # only when nothing of someone else's is left in it
        with contextlib.suppress(OSError):
            (self.base / "hold.lock").unlink(missing_ok=True)  # a build's hold (prune); flock'd files may go
            if [p.name for p in self.base.iterdir()] == [MARKER]:
                (self.base / MARKER).unlink()
                self.base.rmdir()
        return n
