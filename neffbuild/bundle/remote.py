"""Push a bundle to S3-compatible storage as content-addressed blobs; pull it back, resumably.

Remote layout under ``s3://BUCKET/PREFIX`` (spec: docs/bundle-format.md, "Remote layout"):

    blobs/sha256/<hex>              every file's bytes, once per distinct content
    digests/<manifest sha256>.json  the bundle index (pull by digest)
    bundles/<name>-<version>.json   the same index (pull by name), written last

The index lists every file of the bundle (``{path: {sha256, bytes}}``). Push uploads the blobs
the remote lacks, then the index: a reader that sees an index finds every blob. Versions are
immutable: an index that exists with other bytes is refused, the same bytes are a no-op. Pull
downloads into ``DIR/.<name>-<version>.pull`` (kept across a kill; ``*.part`` files resume with
ranged reads), checks every sha256, the bundle's own checks and (with trusted keys) its
signature, and only then renames the folder to ``DIR/<name>-<version>``.

Both ask the remote once with short limits first (s3_probe.py: 3 s to connect, 5 s to the first byte,
a "waiting for" line on stderr after a second): an endpoint that accepts and never answers fails in
seconds, naming it. Every read is bounded while it streams: the index by MAX_INDEX_BYTES, each blob
by the size the index records.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
from pathlib import Path, PurePosixPath

from neffbuild import s3
from neffbuild.errors import BundleError, InvalidInput
from neffbuild.fsutil import sha256_file
from neffbuild.runtime.bundle import model_sig as signature
from neffbuild.runtime.bundle import paths, reader
from neffbuild.s3_probe import probe

INDEX_FORMAT = "neffbuild-remote-bundle"
INDEX_VERSION = 1
MAX_INDEX_BYTES = 64 * 1024 * 1024
PULL_MARK = ".pull"
_HEX = re.compile(r"^[0-9a-f]{64}$")
_DIGEST_REF = re.compile(r"^sha256:([0-9a-f]{64})$")


class Progress:
    """Byte progress callbacks (the CLI draws a bar); the default does nothing."""

    def start(self, total: int, what: str) -> None: ...
    def advance(self, n: int) -> None: ...


def blob_key(url: s3.S3Url, digest: str) -> str:
    return url.key("blobs", "sha256", digest)


def name_key(url: s3.S3Url, dirname: str) -> str:
    return url.key("bundles", f"{dirname}.json")


def digest_key(url: s3.S3Url, manifest_sha256: str) -> str:
    return url.key("digests", f"{manifest_sha256}.json")


def local_index(root: Path) -> tuple[dict, bytes]:
    """The index of a local bundle (every file, signature included), refusing a bundle that fails its checks."""
    problems = reader.check(root, full=False)
    if problems:
        raise BundleError(f"{root}: not pushed, the bundle has problems: " + "; ".join(map(str, problems[:10])))
    m = reader.read_manifest(root)
    rels = signature.bundle_files(root) + ([paths.SIGNATURE_PATH] if (root / paths.SIGNATURE_PATH).is_file() else [])
    files = {}
    for rel in sorted(rels):
        digest = sha256_file(root / rel)
        if rel in m["files"] and m["files"][rel]["sha256"] != digest:
            raise BundleError(f"{root}: not pushed: {rel}: sha256 mismatch with the manifest (corrupt or modified)")
        files[rel] = {"sha256": digest, "bytes": (root / rel).stat().st_size}
    index = {"format": INDEX_FORMAT, "format_version": INDEX_VERSION, "name": m["name"], "version": m["version"],
             "manifest_sha256": files[paths.MANIFEST_PATH]["sha256"], "files": files}
    return index, (json.dumps(index, sort_keys=True, indent=1) + "\n").encode()


def push(bundle_path: str | Path, url: str, progress: Progress | None = None) -> dict:
    """Upload a bundle under ``url`` (s3://BUCKET/PREFIX); a summary of what moved."""
    progress = progress or Progress()
    root = Path(bundle_path)
    base = s3.parse_url(url, "push URL")
    probe(base, base.key("bundles"), f"push {base}")  # before hashing the bundle: a dead endpoint fails at once
    index, raw = local_index(root)
    dirname = paths.bundle_dirname(index["name"], index["version"])
    remote = s3.open_remote(base)
    ref = name_key(base, dirname)
    out = {"bundle": dirname, "url": f"{base}/{dirname}", "digest_url": f"{base}/sha256:{index['manifest_sha256']}",
           "files": len(index["files"]), "bytes": sum(f["bytes"] for f in index["files"].values()),
           "uploaded_blobs": 0, "uploaded_bytes": 0, "skipped_bytes": 0}
    existing = remote.get(ref, limit=MAX_INDEX_BYTES)
    if existing is not None:
        _same_or_refuse(existing, raw, base, dirname)
        return dict(out, noop=True, skipped_bytes=out["bytes"])
    blobs = {f["sha256"]: (rel, f["bytes"]) for rel, f in sorted(index["files"].items())}
    missing, wrong = {}, set()
    for digest, (rel, size) in blobs.items():
        have = remote.head(blob_key(base, digest))
        if have is not None and have["size"] == size and _blob_digest(remote, blob_key(base, digest), size) == digest:
            out["skipped_bytes"] += size
        else:
            missing[digest] = (rel, size)
            if have is not None:  # bytes at a content address that are not that content: replaced, never trusted
                wrong.add(digest)
    progress.start(sum(size for _, size in missing.values()), "push")
    for digest, (rel, size) in missing.items():
        remote.put_file_if_absent(blob_key(base, digest), root / rel, on_bytes=progress.advance,
                                  replace=digest in wrong)
        out["uploaded_blobs"] += 1
        out["uploaded_bytes"] += size
    out["replaced_blobs"] = len(wrong)
    remote.put_if_absent(digest_key(base, index["manifest_sha256"]), raw)
    if not remote.put_if_absent(ref, raw):  # another push of this version won the race
        _same_or_refuse(remote.get(ref, limit=MAX_INDEX_BYTES) or b"", raw, base, dirname)
    return dict(out, noop=False)


def _blob_digest(remote: s3.S3Remote, key: str, size: int) -> str | None:
    """The sha256 of a remote blob's bytes, read back (a size is no proof: a same-size blob of zeros at the
    weights' address would make the version unpullable for good, since versions are immutable)."""
    chunks = remote.iter_from(key)
    if chunks is None:
        return None
    h, n = hashlib.sha256(), 0
    for chunk in chunks:
        n += len(chunk)
        if n > size:  # more than its HEAD said: not this content, read no further
            return None
        h.update(chunk)
    return h.hexdigest()


def _same_or_refuse(existing: bytes, raw: bytes, base: s3.S3Url, dirname: str) -> None:
    if existing != raw:
        raise BundleError(f"{base}/{dirname} already exists with other bytes; versions are immutable: bump the "
                          "recipe's version and rebuild, or push under another prefix")


def parse_ref(value: str) -> tuple[s3.S3Url, str, str]:
    """``s3://BUCKET/PREFIX/NAME-VERSION`` or ``.../sha256:HEX`` -> (base url, object key, what was asked)."""
    url = s3.parse_url(value, "pull URL")
    base, _, ref = url.prefix.rpartition("/")
    if not ref:
        raise InvalidInput(f"pull URL {value!r}: name the bundle, s3://BUCKET/PREFIX/NAME-VERSION or "
                           "s3://BUCKET/PREFIX/sha256:MANIFEST_DIGEST")
    b = s3.S3Url(url.bucket, base)
    m = _DIGEST_REF.match(ref)
    return b, (digest_key(b, m.group(1)) if m else name_key(b, ref)), ref


def parse_index(raw: bytes, where: str, ref: str) -> dict:
    """A remote index, checked like a manifest: every path relative and inside, every digest hex."""
    try:
        idx = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise BundleError(f"{where}: unreadable bundle index ({str(exc)[:120]})") from None
    bad = lambda why: BundleError(f"{where}: bad bundle index: {why}")
    if not isinstance(idx, dict) or idx.get("format") != INDEX_FORMAT or idx.get("format_version") != INDEX_VERSION:
        raise bad(f"format must be {INDEX_FORMAT!r} version {INDEX_VERSION}")
    if not all(isinstance(idx.get(k), str) and idx[k] for k in ("name", "version")) or not isinstance(
            idx.get("files"), dict) or paths.MANIFEST_PATH not in idx["files"]:
        raise bad("needs name, version and files with manifest.json")
    dirname = paths.bundle_dirname(idx["name"], idx["version"])
    if "/" in dirname or "\\" in dirname or dirname.startswith(".") or "\x00" in dirname:
        raise bad(f"name-version {dirname!r} is not a folder name")
    if not ref.startswith("sha256:") and ref != dirname:
        raise bad(f"it describes {dirname}, not {ref}")
    asked = ref.removeprefix("sha256:") if ref.startswith("sha256:") else None
    if asked is not None and (idx["files"][paths.MANIFEST_PATH].get("sha256") != asked
                              or idx.get("manifest_sha256", asked) != asked):
        raise bad(f"its manifest's sha256 is not {asked[:16]}…, the digest that was asked for")
    names = set(idx["files"])
    for rel in names:  # a path that is also another path's folder cannot be laid out (manifest.json/x)
        parts = rel.split("/")
        clash = next(("/".join(parts[:i]) for i in range(1, len(parts)) if "/".join(parts[:i]) in names), None)
        if clash is not None:
            raise bad(f"{clash[:120]!r} is listed as a file and as the folder of {rel[:120]!r}")
    for rel, f in idx["files"].items():
        pure = PurePosixPath(rel)
        if (not rel or "\\" in rel or "\x00" in rel or pure.is_absolute() or ".." in pure.parts
                or rel.endswith(".part") or any(p in ("", ".") for p in rel.split("/"))):
            raise bad(f"path {rel[:120]!r} is not a relative path inside the bundle")
        if not isinstance(f, dict) or not isinstance(f.get("sha256"), str) or not _HEX.match(f["sha256"]) or \
                not isinstance(f.get("bytes"), int) or isinstance(f["bytes"], bool) or f["bytes"] < 0:
            raise bad(f"{rel[:120]}: needs a sha256 (64 hex digits) and bytes")
    return idx


def pull(value: str, dest: str | Path, *, trusted_keys=None, progress: Progress | None = None) -> dict:
    """Download the bundle ``value`` names into ``dest/<name>-<version>``; a summary of what moved.

    Nothing appears under that name until every file's sha256, the bundle's checks and (with
    ``trusted_keys``) its signature have passed; a killed pull resumes from its temp folder.
    """
    progress = progress or Progress()
    base, key, ref = parse_ref(value)
    keys = signature.load_trusted_keys(trusted_keys) if trusted_keys else []  # a bad key: exit 2 before any I/O
    probe(base, key, f"pull {base}/{ref}")
    remote = s3.open_remote(base)
    try:
        raw = remote.get(key, limit=MAX_INDEX_BYTES)
    except s3.RemoteError as exc:
        if exc.kind != s3.TOO_LARGE:
            raise
        raise BundleError(f"{base}/{ref}: the bundle index is over {MAX_INDEX_BYTES} bytes; refused while it "
                          f"streamed ({exc})") from None
    if raw is None:
        raise BundleError(f"{base}/{ref}: no such bundle (nothing at {s3.SCHEME}{base.bucket}/{key})")
    idx = parse_index(raw, f"{s3.SCHEME}{base.bucket}/{key}", ref)
    dest = Path(dest)
    dirname = paths.bundle_dirname(idx["name"], idx["version"])
    final = dest / dirname
    total = sum(f["bytes"] for f in idx["files"].values())
    out = {"bundle": str(final), "url": f"{base}/{dirname}", "files": len(idx["files"]), "bytes": total,
           "downloaded_bytes": 0, "resumed_bytes": 0, "reused_bytes": 0, "signature": None}
    if final.is_symlink() or (final.exists() and not final.is_dir()):
        raise BundleError(f"{final}: exists and is not a bundle folder (a link or a file); remove it or pull into "
                          "another folder")
    if final.exists():
        if _matches(final, idx["files"]):
            return dict(out, noop=True, reused_bytes=total, signature=_verify(final, keys))
        raise BundleError(f"{final}: exists and differs from {base}/{ref}; remove it or pull into another folder")
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InvalidInput(f"DIR {dest}: cannot create it ({exc.strerror or exc})") from None
    tmp = dest / f".{dirname}{PULL_MARK}"
    with _locked(dest / f".{dirname}{PULL_MARK}.lock", final):
        if tmp.is_symlink() or (tmp.exists() and not tmp.is_dir()):  # never follow a link to empty its target
            raise BundleError(f"{tmp}: is not a pull's temp folder (a link or a file); remove it, then pull again")
        tmp.mkdir(exist_ok=True)
        _drop_strays(tmp, idx["files"])
        progress.start(total, "pull")
        for rel, f in sorted(idx["files"].items(), key=lambda kv: -kv[1]["bytes"]):
            got = _fetch(remote, blob_key(base, f["sha256"]), tmp, rel, f, progress)
            for k in ("downloaded_bytes", "resumed_bytes", "reused_bytes"):
                out[k] += got[k]
        problems = reader.check(tmp, full=False) or _not_asked(tmp, idx)
        if problems:
            shutil.rmtree(tmp, ignore_errors=True)
            raise BundleError(f"{base}/{ref}: the pulled files are not a valid bundle: "
                              + "; ".join(map(str, problems[:10])))
        out["signature"] = _verify(tmp, keys)  # a SignatureError keeps the temp folder: nothing is published
        os.replace(tmp, final)
    return dict(out, noop=False)


def _not_asked(root: Path, idx: dict) -> list[str]:
    """The pulled manifest must be the bundle the index (and so the ref) names: an index planted at NAME-0.2.0
    listing the signed 0.1.0 bundle is a rollback the signature alone does not catch."""
    m = reader.read_manifest(root)
    if (m.get("name"), m.get("version")) != (idx["name"], idx["version"]):
        return [f"the manifest is {m.get('name')!r} version {m.get('version')!r}, but the index names "
                f"{idx['name']!r} version {idx['version']!r} (a rollback or a swapped bundle)"]
    return []


def _verify(root: Path, keys) -> dict | None:
    if not keys:
        return None
    v = signature.verify_bundle(root, keys)
    return {"key": v.key, "key_hint": v.key_hint, "files": v.files}


def _matches(root: Path, files: dict) -> bool:
    try:
        present = set(signature.bundle_files(root)) | ({paths.SIGNATURE_PATH} & set(files))
    except BundleError:
        return False
    return present == set(files) and all((root / rel).is_file() and (root / rel).stat().st_size == f["bytes"]
                                         and sha256_file(root / rel) == f["sha256"] for rel, f in files.items())


class _locked:
    """An exclusive lock beside the temp folder: a second pull of the same bundle into DIR waits for none."""

    def __init__(self, path: Path, final: Path):
        self.path, self.final = path, final

    def __enter__(self):
        try:  # never through a link: a planted .lock symlink must not create or hold another file
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as exc:
            raise BundleError(f"{self.path}: cannot take the pull lock ({exc.strerror or exc}); if it is a link, "
                              "remove it") from None
        self.fh = os.fdopen(fd, "a+")
        try:
            fcntl.flock(self.fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.fh.close()
            raise BundleError(f"{self.final}: another pull of this bundle into {self.final.parent} is running") \
                from None
        return self

    def __exit__(self, *exc):
        self.path.unlink(missing_ok=True)
        self.fh.close()


def _drop_strays(tmp: Path, files: dict) -> None:
    """Remove what a previous pull of another index left (files not listed, symlinks)."""
    keep = set(files) | {f"{rel}.part" for rel in files}
    for p in sorted(tmp.rglob("*"), reverse=True):
        rel = p.relative_to(tmp).as_posix()
        if p.is_symlink() or (p.is_file() and rel not in keep):
            p.unlink()
        elif p.is_dir() and not any(p.iterdir()):
            p.rmdir()


def _fetch(remote: s3.S3Remote, key: str, tmp: Path, rel: str, f: dict, progress: Progress) -> dict:
    """One file into ``tmp/rel``: kept if already complete and correct, else resumed from its .part."""
    target, part = tmp / rel, tmp / f"{rel}.part"
    got = {"downloaded_bytes": 0, "resumed_bytes": 0, "reused_bytes": 0}
    if target.is_file() and target.stat().st_size == f["bytes"] and sha256_file(target) == f["sha256"]:
        progress.advance(f["bytes"])
        return dict(got, reused_bytes=f["bytes"])
    target.unlink(missing_ok=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    h, offset = hashlib.sha256(), 0
    if part.is_file() and part.stat().st_size <= f["bytes"]:
        with open(part, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
                offset += len(chunk)
        got["resumed_bytes"] = offset
        progress.advance(offset)
    else:
        part.unlink(missing_ok=True)
    if offset < f["bytes"] or f["bytes"] == 0:
        chunks = remote.iter_from(key, offset)
        if chunks is None:
            raise BundleError(f"{rel}: blob {s3.SCHEME}{remote.url.bucket}/{key} is missing on the remote (an "
                              "incomplete push); push the bundle again")
        with open(part, "ab") as fh:
            for chunk in chunks:
                if offset + len(chunk) > f["bytes"]:
                    break
                fh.write(chunk)
                h.update(chunk)
                offset += len(chunk)
                got["downloaded_bytes"] += len(chunk)
                progress.advance(len(chunk))
    if offset != f["bytes"] or h.hexdigest() != f["sha256"]:
        part.unlink(missing_ok=True)
        raise BundleError(f"{rel}: the downloaded bytes do not match the index (size {offset} of {f['bytes']}, "
                          "or sha256 mismatch): the remote blob is corrupt; the next pull downloads it again")
    os.replace(part, target)
    return got
