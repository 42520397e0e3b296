"""Signatures on remote compile-cache entries: who built an entry, bound to its key, bytes and toolchain.

A shared bucket is a supply chain: whoever can write it could otherwise put another graph's
artifact under a key and rewrite ``meta.json``'s digest to match (the digest is written by the
same hand as the artifact). A writer with a CI key therefore stores ``entry.sig`` beside the
entry: the bundle signature's own format (runtime/bundle/model_sig.py: Sigstore bundle, DSSE envelope,
model-signing statement, EC key), whose subject names the cache key and whose two resources are
the artifact file's sha256 and the sha256 of the entry's toolchain (the backend fingerprint in
canonical JSON). A reader with trusted keys accepts an entry only when one of them signed exactly
that key, those bytes and that toolchain; anything else is rebuilt (docs/remote-cache.md, "Trust").

What points at an entry is signed too: a pre-key record (``prekeys/<pre-key>.json``, which lets a fresh
machine skip tracing) names the key its target traced to, and a bucket writer who rewrites it to another
graph's genuinely signed entry would otherwise get that entry served under this target. A signing writer
puts ``{"key", "signature"}`` there, the signature's subject naming the pre-key and its one resource the
key; a reader with trusted keys follows only such a record (else it traces and fetches by its own key).
"""

from __future__ import annotations

import hashlib
import json

from neffbuild.compiler.cache import canonical
from neffbuild.errors import InvalidInput, SignatureError
from neffbuild.fsutil import read_regular
from neffbuild.runtime.bundle import model_sig as signature

ENTRY_SIG = "entry.sig"
SUBJECT = "neffbuild-cache-entry/"  # + the cache key
TOOLCHAIN = "toolchain.json"  # the resource name of the fingerprint's digest
MAX_ENTRY_SIG_BYTES = 64 * 1024
PREKEY_SUBJECT = "neffbuild-cache-prekey/"  # + the pre-key
PREKEY_RESOURCE = "cache-key"  # the resource whose digest is the key the pre-key traced to


def _resources(artifact_name: str, artifact_sha256: str, fingerprint) -> list[tuple[str, str]]:
    toolchain = hashlib.sha256(canonical(fingerprint if isinstance(fingerprint, dict) else {})).hexdigest()
    return sorted([(artifact_name, artifact_sha256), (TOOLCHAIN, toolchain)])


def sign_entry(key: str, meta: dict, private_key) -> bytes:
    """``entry.sig`` for the entry ``key`` whose meta records its artifact's file name, sha256 and fingerprint."""
    from neffbuild.bundle.signing import signed_document

    doc = signed_document(SUBJECT + key, _resources(meta["file"], meta["sha256"], meta.get("fingerprint", {})),
                          private_key)
    return (json.dumps(doc, sort_keys=True, indent=1) + "\n").encode()


def entry_problem(raw: bytes | None, key: str, meta: dict, artifact_sha256: str, trusted) -> str | None:
    """Why the entry is not one a trusted key signed (None: it is). ``artifact_sha256`` is what was downloaded."""
    if raw is None:
        return f"is not signed ({ENTRY_SIG} is missing)"
    if len(raw) > MAX_ENTRY_SIG_BYTES:
        return f"{ENTRY_SIG} is over {MAX_ENTRY_SIG_BYTES} bytes"
    try:
        doc = signature.parse_signature(raw, ENTRY_SIG)
        signer, subject, table = signature.verify_document(ENTRY_SIG, doc, trusted)
    except SignatureError as exc:
        return f"signature not accepted ({str(exc)[:240]})"
    want = dict(_resources(meta["file"], artifact_sha256, meta.get("fingerprint", {})))
    if subject != SUBJECT + key:
        return f"signed by {signer.source} for another key ({subject[:90]!r})"
    if table != want:
        return f"signed by {signer.source} over other bytes or another toolchain than the entry holds"
    return None


def prekey_record(pre: str, key: str, private_key=None) -> bytes:
    """A remote pre-key record: ``{"key"}``, with ``"signature"`` (over this pre-key and key) given a key."""
    record = {"key": key}
    if private_key is not None:
        from neffbuild.bundle.signing import signed_document

        record["signature"] = signed_document(PREKEY_SUBJECT + pre, [(PREKEY_RESOURCE, key)], private_key)
    return json.dumps(record, sort_keys=True).encode()


def prekey_problem(record: dict, pre: str, trusted) -> str | None:
    """Why a remote pre-key record is not one a trusted key signed for this pre-key and its key (None: it is)."""
    doc = record.get("signature")
    if doc is None:
        return "is not signed"
    try:
        doc = signature.parse_signature(json.dumps(doc).encode(), "pre-key record")  # the one parser's checks
        signer, subject, table = signature.verify_document("pre-key record", doc, trusted)
    except SignatureError as exc:
        return f"has a signature that is not accepted ({str(exc)[:240]})"
    if subject != PREKEY_SUBJECT + pre:
        return f"is signed by {signer.source} for another pre-key ({subject[:90]!r})"
    if table != {PREKEY_RESOURCE: record.get("key")}:
        return f"is signed by {signer.source} for another key than it names"
    return None


def load_trusted(paths) -> tuple[bytes, ...]:
    """The PEM bytes of ``--cache-trust`` keys, each read as a bounded regular file and parsed once now
    (a bad key is exit 2 before any work); bytes travel to workers, which parse them again."""
    pems = []
    for path in paths:
        pem = read_regular(path, "--cache-trust", signature.MAX_KEY_BYTES)
        try:
            signature.load_trusted_keys([pem])
        except InvalidInput as exc:
            raise InvalidInput(f"--cache-trust {path}: {str(exc).removeprefix('trusted key <PEM bytes>: ')}") from None
        pems.append(pem)
    return tuple(pems)
