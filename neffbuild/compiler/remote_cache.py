"""The remote compile-cache tier: an S3-compatible bucket behind the local cache.

The local cache (compiler/cache.py) stays the first tier. Remote layout under
``s3://BUCKET/PREFIX``, mirroring the local one::

    v{CACHE_VERSION}/entries/<key>/<artifact file>   written first
    v{CACHE_VERSION}/entries/<key>/entry.sig         a signed writer's signature (compiler/entry_sig.py)
    v{CACHE_VERSION}/entries/<key>/meta.json         written last: a reader never sees a half entry
    v{CACHE_VERSION}/prekeys/<pre-key>.json          pre-key -> key (a fresh machine skips tracing)

Reads: on a local miss the meta is fetched, then the artifact; its size and sha256 are checked
against the meta; with trusted keys its signature must cover this key, these bytes and this
toolchain; then it is smoke-run in a child process, and only then published locally (the local
cache's atomic publish). A mismatch is a miss with a warning ("remote entry rejected, rebuilt");
the remote object is never deleted (it may be someone else's in-flight upload, and a cache never
destroys what it did not write).

Writes (the driver, after a target compiled and passed its smoke run, or a local hit the
remote lacks): create-only puts (``If-None-Match: *``), artifact first, meta last. A lost race
is fine; when the winner's bytes differ from ours (compared by the S3 ETag, the MD5 of a
single-part upload) a warning says the build is not reproducible. Failures are never pushed.
With a signing key the entry's ``entry.sig`` goes between the artifact and the meta.

Every remote error (network, 403, 5xx, a bad digest) is a miss or a skipped push with a
warning and a count, never a failed build. Modes: ``rw`` writes; ``ro`` never writes;
``auto`` writes until a write is refused, then is read-only for the rest of the run (one
warning). After the remote is found unreachable it is not asked again in this process.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from neffbuild import s3
from neffbuild.compiler.cache import CACHE_VERSION, META, Cache, Entry, _meta_ok
from neffbuild.fsutil import sha256_file
from neffbuild.s3_probe import probe

MODES = ("auto", "rw", "ro")
MAX_META_BYTES = 1024 * 1024  # a meta.json is a few KiB
MAX_PREKEY_BYTES = 64 * 1024  # {"key", "signature"}: the signature is under 2 KiB

@dataclass
class RemoteStats:
    """What one process did with the remote; results carry it from workers to the driver as plain JSON."""

    hits: int = 0
    pushes: int = 0
    errors: int = 0
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"hits": self.hits, "pushes": self.pushes, "errors": self.errors, "warnings": list(self.warnings)}


class RemoteCache:
    """One remote tier for one run. Never raises a RemoteError: failures become warnings and counts."""

    def __init__(self, url: str, mode: str = "auto", *, client: s3.S3Remote | None = None,
                 trusted: tuple[bytes, ...] = (), sign_key=None):
        self.url = s3.parse_url(url)
        self.mode = mode
        self.trusted = tuple(trusted)  # PEM public keys whose entry signatures are accepted (empty: any entry)
        self.sign_key = sign_key  # the EC private key that signs what this run pushes (None: pushed unsigned)
        self._keys = None
        self.read_only = mode == "ro"
        self.down: str | None = None  # why the remote is not asked any more
        self.suspect = False  # a fetched entry's smoke run timed out: no more fetches (pushes go on)
        self.stats = RemoteStats()
        self._client = client
        self._md5: dict[str, str] = {}
        self.rejected: set[str] = set()  # keys whose remote entry failed its check in this process

    # -- plumbing
    @property
    def client(self) -> s3.S3Remote | None:
        if self.down is not None:
            return None
        if self._client is None:
            try:
                self._client = s3.S3Remote(self.url)
            except s3.RemoteError as exc:
                self._error(exc)
        return self._client

    def probe(self) -> bool:
        """Ask the remote once with short timeouts (connect and first byte; one attempt) before the run uses it;
        unreachable: ``down``, with the warning, so no later request waits its long timeout. True when usable."""
        if self.down is not None:
            return False
        try:
            probe(self.url, self._key(META), f"the remote cache {self.url}")
        except s3.RemoteError as exc:
            self._error(exc)
            return False
        return True

    def _key(self, *parts: str) -> str:
        return self.url.key(f"v{CACHE_VERSION}", *parts)

    def warn(self, message: str) -> None:
        if message not in self.stats.warnings:
            self.stats.warnings.append(message)

    def _error(self, exc: s3.RemoteError) -> None:
        self.stats.errors += 1
        if exc.kind in (s3.UNREACHABLE, s3.MISSING_EXTRA, s3.NO_CREDENTIALS):
            self.down = self.down or exc.kind
            self.warn(f"remote cache {self.url} {'unreachable' if exc.kind == s3.UNREACHABLE else 'unusable'}: "
                      f"{exc}; building without it")
        else:
            self.warn(f"remote cache: {exc}")

    @property
    def state(self) -> str:
        """``read-write``, ``read-only``, ``suspect``, ``unreachable`` or ``unusable`` (for the summary)."""
        if self.down:
            return "unreachable" if self.down == s3.UNREACHABLE else "unusable"
        if self.suspect:
            return "suspect"
        return "read-only" if self.read_only else "read-write"

    def mark_suspect(self, why: str) -> None:
        """One entry's code did not finish its smoke run: fetch nothing more from this remote in this build."""
        if not self.suspect:
            self.suspect = True
            self.warn(f"remote cache {self.url}: {why}; the remote is suspect, so nothing more is fetched from it "
                      "in this build (targets compile locally)")

    @property
    def trusted_keys(self) -> list:
        if self._keys is None:
            from neffbuild.runtime.bundle.model_sig import load_trusted_keys

            self._keys = load_trusted_keys(list(self.trusted))
        return self._keys

    # -- reads
    def fetch(self, cache: Cache, key: str, check=None, expect=None) -> Entry | None:
        """The remote entry ``key`` published into ``cache`` (call under ``cache.lock(key)``), or None (a miss)."""
        tmp = cache.new_tmp(key)
        got = self.fetch_to(key, tmp, check, expect)
        if got is None:
            _rmtree(tmp)
            return None
        return cache.publish(key, tmp, *got)

    def fetch_to(self, key: str, tmp: Path, check=None, expect=None) -> tuple[Path, dict] | None:
        """(artifact, meta) of the remote entry ``key`` downloaded into ``tmp`` and checked against its meta,
        ready for ``Cache.publish`` (the ``produce`` of ``jobs.publish``), or None (a miss; ``tmp`` is left
        empty). A key whose remote entry failed its check is in ``rejected`` and is not asked again.

        With trusted keys the entry must carry a signature by one of them over this key, these bytes and
        this toolchain (compiler/entry_sig.py). ``expect(meta)`` (what this target's graph and toolchain are:
        an entry recording another graph is refused under any key) runs before the artifact is downloaded.
        ``check(artifact)`` (the smoke run in a child process) runs last, before anything is published; a
        LoadFailed rejects the entry (it is rebuilt). Every object is read with a bound: the meta and the
        signature by their limits, the artifact by the size its meta records."""
        client = self.client
        if client is None or key in self.rejected or self.suspect:
            return None
        artifact = None
        try:
            raw = client.get(self._key("entries", key, META), limit=MAX_META_BYTES)
            if raw is None:
                return None
            meta = json.loads(raw)
            if not _meta_ok(meta) or meta.get("key") != key or not isinstance(meta.get("ext"), str) or \
                    not isinstance(meta.get("compile_seconds"), (int, float)):  # what a hit's result reads
                self._reject(key, f"remote cache: entry {key[:16]} has a malformed {META}; treated as a miss "
                                  f"(the remote object is left as it is)")
                return None
            why = expect(meta) if expect is not None else None
            if why is not None:
                self._reject(key, f"remote cache: entry {key[:16]} ({meta.get('label', '')}) {why}: remote entry "
                                  f"rejected, rebuilt (the remote object is left as it is)")
                return None
            artifact = tmp / Path(meta["file"]).name
            found = client.get_to_file(self._key("entries", key, meta["file"]), artifact, limit=meta["bytes"])
            digest = sha256_file(artifact) if found and artifact.stat().st_size == meta["bytes"] else None
            if digest != meta["sha256"]:
                artifact.unlink(missing_ok=True)
                self._reject(key, f"remote cache: entry {key[:16]}: the artifact does not match the sha256/size "
                                  f"its {META} records; treated as a miss and rebuilt (the remote object is left "
                                  f"as it is)")
                return None
            why = self._untrusted(client, key, meta, digest)
            if why is None and check is not None:
                why = self._check(check, artifact)
            if why is not None:
                artifact.unlink(missing_ok=True)
                self._reject(key, f"remote cache: entry {key[:16]} ({meta.get('label', '')}) {why}: remote entry "
                                  f"rejected, rebuilt (the remote object is left as it is)")
                return None
        except s3.RemoteError as exc:
            if artifact is not None:
                artifact.unlink(missing_ok=True)
            self._error(exc)
            return None
        except (ValueError, OSError, TypeError) as exc:
            if artifact is not None:
                artifact.unlink(missing_ok=True)
            self.stats.errors += 1
            self.warn(f"remote cache: entry {key[:16]} unreadable ({type(exc).__name__}); treated as a miss")
            return None
        self.stats.hits += 1
        meta = {k: v for k, v in meta.items() if k not in ("key", "file", "bytes", "sha256", "created")}
        return artifact, dict(meta, fetched_from=str(self.url))

    def _untrusted(self, client: s3.S3Remote, key: str, meta: dict, digest: str) -> str | None:
        """Why the entry is not signed by a trusted key (None: it is, or no key is trusted: the bucket is)."""
        if not self.trusted:
            return None
        from neffbuild.compiler.entry_sig import ENTRY_SIG, MAX_ENTRY_SIG_BYTES, entry_problem

        try:
            raw = client.get(self._key("entries", key, ENTRY_SIG), limit=MAX_ENTRY_SIG_BYTES)
        except s3.RemoteError as exc:
            if exc.kind != s3.TOO_LARGE:
                raise
            return f"{ENTRY_SIG} is over {MAX_ENTRY_SIG_BYTES} bytes"
        return entry_problem(raw, key, meta, digest, self.trusted_keys)

    def _check(self, check, artifact: Path) -> str | None:
        from neffbuild.compiler.smoke import LoadFailed
        from neffbuild.compiler.smoke_child import SmokeTimedOut

        try:
            check(artifact)
        except SmokeTimedOut as exc:
            self.mark_suspect(f"a fetched entry's smoke run did not finish ({exc}; its code may loop)")
            return f"failed its smoke run in a child process ({exc})"
        except LoadFailed as exc:
            return f"failed its smoke run in a child process ({exc})"
        return None

    def _reject(self, key: str, message: str) -> None:
        self.rejected.add(key)
        self.stats.errors += 1
        self.warn(message)

    def fetch_pre(self, cache: Cache, pre: str, check=None, expect=None) -> Entry | None:
        """The entry a remote pre-key record names (fetched when the local cache lacks it), or None (trace).

        With trusted keys the record must be signed by one of them for this pre-key and the key it names
        (compiler/entry_sig.py): a rewritten record would otherwise serve another graph's signed entry.
        ``expect(meta)`` is asked of the entry found (local or fetched): one recording another graph or
        toolchain is never this target's, whatever the record says."""
        client = self.client
        if client is None or self.suspect:
            return None
        try:
            raw = client.get(self._key("prekeys", f"{pre}.json"), limit=MAX_PREKEY_BYTES)
            record = json.loads(raw) if raw is not None else None
        except s3.RemoteError as exc:
            self._error(exc)
            return None
        except (ValueError, RecursionError):
            return None
        key = record.get("key") if isinstance(record, dict) else None
        if not isinstance(key, str) or len(key) != 64 or not self._pre_trusted(record, pre):
            return None
        with cache.lock(key):
            entry = cache.get(key)
            if entry is None:
                entry = self.fetch(cache, key, check, expect)
            elif expect is not None and (why := expect(entry.meta)) is not None:
                self.stats.errors += 1
                self.warn(f"remote cache: pre-key record {pre[:16]} names entry {key[:16]}, which {why}; not "
                          "followed (the target is traced)")
                return None
        if entry is not None:
            cache.put_pre(pre, key)
        return entry

    def _pre_trusted(self, record: dict, pre: str) -> bool:
        if not self.trusted:
            return True
        from neffbuild.compiler.entry_sig import prekey_problem

        why = prekey_problem(record, pre, self.trusted_keys)
        if why is not None:
            self.stats.errors += 1
            self.warn(f"remote cache: a pre-key record {why}: pre-key records not signed by a trusted key are not "
                      "followed; those targets are traced and fetched by their own key")
        return why is None

    def has(self, key: str) -> bool | None:
        """Whether the remote holds a complete entry for ``key`` (None: could not tell)."""
        client = self.client
        if client is None:
            return None
        try:
            return client.head(self._key("entries", key, META)) is not None
        except s3.RemoteError as exc:
            self._error(exc)
            return None

    # -- writes
    def push(self, entry: Entry, pre: str | None = None) -> str:
        """Push one entry the local cache holds: ``pushed``, ``present``, ``lost-race``, ``skipped`` or ``error``."""
        client = self.client
        if client is None or self.read_only:
            return "skipped"
        meta_key = self._key("entries", entry.key, META)
        art_key = self._key("entries", entry.key, entry.meta["file"])
        try:
            head = client.head(meta_key)
            outcome = "present"
            if head is None:
                outcome = self._push_entry(client, entry, art_key, meta_key)
            if pre is not None and outcome in ("pushed", "present"):
                from neffbuild.compiler.entry_sig import prekey_record

                client.put_if_absent(self._key("prekeys", f"{pre}.json"), prekey_record(pre, entry.key, self.sign_key))
            return outcome
        except s3.RemoteError as exc:
            if exc.kind == s3.DENIED and self.mode == "auto":
                self.read_only = True
                self.warn(f"remote cache {self.url}: write refused ({exc.status or exc.kind}); read-only for the "
                          f"rest of this run")
                return "skipped"
            self._error(exc)
            return "error"

    def _push_entry(self, client: s3.S3Remote, entry: Entry, art_key: str, meta_key: str) -> str:
        created = client.put_if_absent(art_key, entry.path)
        if not created:
            theirs = client.head(art_key)
            if theirs is not None and theirs.get("etag") and theirs["etag"] != self._local_md5(entry.path):
                self.warn(f"remote cache: lost the race for {entry.meta.get('label', '')} ({entry.key[:16]}) and the "
                          f"winner's artifact bytes differ from ours: this build is not reproducible")
                return "lost-race"
        if self.sign_key is not None:  # before the meta: a reader that sees the meta finds the signature
            from neffbuild.compiler.entry_sig import ENTRY_SIG, sign_entry

            client.put_if_absent(self._key("entries", entry.key, ENTRY_SIG),
                                 sign_entry(entry.key, entry.meta, self.sign_key))
        body = json.dumps(entry.meta, sort_keys=True, indent=1).encode()
        if client.put_if_absent(meta_key, body):
            self.stats.pushes += 1
            return "pushed"
        return "lost-race"

    def _local_md5(self, path: Path) -> str:
        if str(path) not in self._md5:
            h = hashlib.md5(usedforsecurity=False)
            with open(path, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
            self._md5[str(path)] = h.hexdigest()
        return self._md5[str(path)]


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


@functools.cache
def for_worker(url: str, mode: str, trusted: tuple[bytes, ...] = ()) -> RemoteCache:
    """One RemoteCache per worker process, remote and set of trusted keys (its client is reused across jobs)."""
    return RemoteCache(url, mode, trusted=trusted)


def check(url: str) -> dict:
    """``cache remote check``: {"url", "endpoint", "reachable", "readable", "writable", "errors"} (s3_probe.check
    listing the cache's own folder)."""
    from neffbuild.s3_probe import check as check_remote

    return check_remote(url, f"v{CACHE_VERSION}")
