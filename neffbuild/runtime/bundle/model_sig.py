"""Verify a bundle's signature file (OpenSSF model-signing format, key mode) before anything is loaded.

The signature file (``model.sig``, spec: docs/bundle-format.md "Signature") is a Sigstore bundle
JSON whose DSSE envelope carries an in-toto statement with the model-signing v1.0 predicate: one
``{name, algorithm: sha256, digest}`` resource per file of the bundle directory, sorted by name,
and a subject digest = sha256 over the resources' raw digests in that order. The envelope is
signed with an elliptic-curve key (P-256/384/521) over DSSE's pre-authentication encoding.

This module is shared by the signer (``bundle/signing.py``) and every verifier: the statement is
built here once. It imports the standard library only; ``cryptography`` is imported lazily, when
keys are loaded, so the runtime stays importable without it. It covers key mode only (no
certificates, no transparency log): a bundle lives longer than any short-lived certificate.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from neffbuild.errors import InvalidInput, SignatureError
from neffbuild.fsutil import no_duplicate_keys, read_regular, sha256_file
from neffbuild.runtime.bundle import paths

MEDIA_TYPE = "application/vnd.dev.sigstore.bundle.v0.3+json"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://model_signing/signature/v1.0"
MAX_SIGNATURE_BYTES = 64 * 1024 * 1024
MAX_FILES = 100_000
MAX_KEY_BYTES = 64 * 1024  # a PEM key is under 1 KiB; a cap keeps /dev/zero out
MAX_PROBLEMS = 10


@dataclass(frozen=True)
class TrustedKey:
    """A public key a verifier trusts: where it came from and its model-signing hint (sha256 of its PEM)."""

    source: str
    hint: str
    key: object  # cryptography EllipticCurvePublicKey


@dataclass(frozen=True)
class Verified:
    """What a successful verification established."""

    key: str  # the trusted key's source
    key_hint: str
    files: int
    bytes: int


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE v1 pre-authentication encoding: what the signature is computed over."""
    t = payload_type.encode("utf-8")
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(payload), payload)


def bundle_files(root: Path) -> list[str]:
    """Every file of the bundle but the signature, as sorted POSIX paths; a symlink or special file is refused."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        base = Path(dirpath)
        for name in dirnames + filenames:
            p = base / name
            rel = p.relative_to(root).as_posix()
            if p.is_symlink():
                raise SignatureError(f"{root}: {rel} is a symbolic link; a signed bundle holds regular files only")
            if name in filenames and rel != paths.SIGNATURE_PATH:
                if not p.is_file():
                    raise SignatureError(f"{root}: {rel} is not a regular file")
                out.append(rel)
        if len(out) > MAX_FILES:
            raise SignatureError(f"{root}: more than {MAX_FILES} files; not a bundle")
    return sorted(out)


def statement(name: str, resources: list[tuple[str, str]]) -> dict:
    """The in-toto statement over ``resources`` ((path, sha256 hex), sorted by path)."""
    root = hashlib.sha256(b"".join(bytes.fromhex(d) for _, d in resources)).hexdigest()
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": name, "digest": {"sha256": root}}],
        "predicateType": PREDICATE_TYPE,
        "predicate": {
            "serialization": {"method": "files", "hash_type": "sha256", "allow_symlinks": False,
                              "ignore_paths": [paths.SIGNATURE_PATH]},
            "resources": [{"name": n, "algorithm": "sha256", "digest": d} for n, d in resources],
        },
    }


def key_hint(public_key) -> str:
    """model-signing's key identifier: the sha256 hex of the key's PEM SubjectPublicKeyInfo."""
    from cryptography.hazmat.primitives import serialization

    pem = public_key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(pem).hexdigest()


def ec_hash(public_key):
    """The ECDSA hash model-signing pairs with each curve (P-256: SHA-256, P-384: SHA-384, P-521: SHA-512)."""
    from cryptography.hazmat.primitives import hashes

    sizes = {256: hashes.SHA256, 384: hashes.SHA384, 521: hashes.SHA512}
    return sizes[public_key.curve.key_size]()


def load_trusted_keys(keys) -> list[TrustedKey]:
    """PEM public keys (paths, or PEM bytes) -> TrustedKey; a bad key is the user's input (exit 2)."""
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ec
    except ImportError:
        raise InvalidInput("verifying a signature needs the `cryptography` package: "
                           "pip install 'neffbuild[signing]'") from None
    out = []
    for k in keys:
        source = "<PEM bytes>" if isinstance(k, bytes) else str(k)
        try:
            data = k if isinstance(k, bytes) else read_regular(k, "trusted key", MAX_KEY_BYTES)
            pub = serialization.load_pem_public_key(data)
        except (ValueError, TypeError):
            raise InvalidInput(f"trusted key {source}: not a PEM public key (write one with `openssl ec -pubout`)"
                               ) from None
        if not isinstance(pub, ec.EllipticCurvePublicKey) or pub.curve.key_size not in (256, 384, 521):
            raise InvalidInput(f"trusted key {source}: must be an elliptic-curve key on P-256, P-384 or P-521")
        out.append(TrustedKey(source, key_hint(pub), pub))
    return out


def _strict_json(raw: bytes, what: str):
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicate_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise SignatureError(f"{what}: not valid JSON ({str(exc)[:160]})") from None


def read_signature(root: Path) -> dict:
    """The parsed signature file (not verified); SignatureError when absent or malformed."""
    path = root / paths.SIGNATURE_PATH
    if not path.is_file() or path.is_symlink():
        raise SignatureError(f"{root}: unsigned ({paths.SIGNATURE_PATH} is missing); sign it with "
                             "`neffbuild sign BUNDLE --key KEY.pem`")
    try:  # a regular file read with a cap on the open descriptor (swapped for a FIFO since the check: no hang)
        raw = read_regular(path, "signature", MAX_SIGNATURE_BYTES)
    except InvalidInput as exc:
        raise SignatureError(str(exc)) from None
    return parse_signature(raw, str(path))


def parse_signature(raw: bytes, where: str) -> dict:
    """A signature document's JSON checked for the fields verifiers read (an object at every level they open)."""
    doc = _strict_json(raw, where)
    env = doc.get("dsseEnvelope") if isinstance(doc, dict) else None
    sigs = env.get("signatures") if isinstance(env, dict) else None
    if (not isinstance(doc, dict) or not isinstance(doc.get("mediaType"), str)
            or not doc["mediaType"].startswith("application/vnd.dev.sigstore")
            or not isinstance(sigs, list) or not sigs or not isinstance(sigs[0], dict)
            or not isinstance(env.get("payload"), str) or not isinstance(sigs[0].get("sig"), str)):
        raise SignatureError(f"{where}: not a model-signing signature (a Sigstore bundle with a DSSE envelope)")
    return doc


def signer_hint(doc: dict) -> str:
    vm = doc.get("verificationMaterial")
    pk = vm.get("publicKey") if isinstance(vm, dict) else None
    hint = pk.get("hint") if isinstance(pk, dict) else None
    return hint if isinstance(hint, str) else ""


def _check_envelope(path: Path, doc: dict, keys: list[TrustedKey]) -> TrustedKey:
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric import ec

    env = doc["dsseEnvelope"]
    try:
        payload = base64.b64decode(env["payload"], validate=True)
        sig = base64.b64decode(env["signatures"][0]["sig"], validate=True)
    except ValueError:
        raise SignatureError(f"{path}: payload or signature is not base64") from None
    hint = signer_hint(doc)
    candidates = [k for k in keys if k.hint == hint] if hint else keys
    if not candidates:
        raise SignatureError(f"{path}: signed by key {hint[:16]}… (sha256 of its PEM), which is not a trusted key "
                             f"(trusted: {', '.join(f'{k.source} {k.hint[:16]}…' for k in keys)})")
    for k in candidates:
        try:
            k.key.verify(sig, pae(str(env.get("payloadType")), payload), ec.ECDSA(ec_hash(k.key)))
            return k
        except InvalidSignature:
            continue
    raise SignatureError(f"{path}: the signature does not verify with trusted key "
                         f"{', '.join(k.source for k in candidates)} (the signature file was altered or "
                         "re-signed by another key)")


def signed_resources(path: Path, payload_type: str, payload: bytes) -> dict[str, str]:
    """The signed {path: sha256} table, after checking the statement's own consistency."""
    st = _strict_json(payload, f"{path} payload")
    pred = st.get("predicate") if isinstance(st, dict) else None
    if (payload_type != PAYLOAD_TYPE or not isinstance(pred, dict) or st.get("_type") != STATEMENT_TYPE
            or st.get("predicateType") != PREDICATE_TYPE or not isinstance(pred.get("resources"), list)):
        raise SignatureError(f"{path}: payload is not a model-signing v1.0 statement")
    ser = pred.get("serialization")
    if not isinstance(ser, dict) or ser.get("method") != "files" or ser.get("hash_type") != "sha256":
        raise SignatureError(f"{path}: serialization {ser!r:.120}: neffbuild verifies method 'files' with sha256")
    # ignore_paths needs no check: every file present must be a signed resource (verify_bundle), ignored or not
    table = {}
    for r in pred["resources"]:
        ok = isinstance(r, dict) and isinstance(r.get("name"), str) and r.get("algorithm") == "sha256"
        if not ok or not isinstance(r.get("digest"), str) or len(r["digest"]) != 64 or r["name"] in table:
            raise SignatureError(f"{path}: malformed resource {r!r:.120}")
        try:
            bytes.fromhex(r["digest"])
        except ValueError:
            raise SignatureError(f"{path}: resource {r['name']!r}: digest is not hex") from None
        table[r["name"]] = r["digest"]
    root = hashlib.sha256(b"".join(bytes.fromhex(table[n]) for n in [r["name"] for r in pred["resources"]]))
    subj = st.get("subject")
    digest = subj[0].get("digest") if isinstance(subj, list) and len(subj) == 1 and isinstance(subj[0], dict) else None
    if not isinstance(digest, dict) or digest.get("sha256") != root.hexdigest():
        raise SignatureError(f"{path}: subject digest does not match its resources (an inconsistent statement)")
    return table


def verify_document(where: str, doc: dict, keys: list[TrustedKey]) -> tuple[TrustedKey, str, dict[str, str]]:
    """(the key that signed it, the statement's subject name, the signed {name: sha256} table) of a parsed
    signature document (``parse_signature``); SignatureError when no trusted key signed it or it is malformed.
    The compile cache's entry signatures use it too (compiler/entry_sig.py): one format, one verifier."""
    key = _check_envelope(Path(where), doc, keys)
    env = doc["dsseEnvelope"]
    payload = base64.b64decode(env["payload"])
    table = signed_resources(Path(where), str(env.get("payloadType")), payload)
    subject = json.loads(payload)["subject"][0].get("name")
    return key, subject if isinstance(subject, str) else "", table


def verify_bundle(root: str | Path, trusted_keys) -> Verified:
    """Check ``root``'s signature with one of ``trusted_keys`` and every file against it.

    Raises SignatureError naming the file (missing, added, renamed, modified, a symlink) or the key
    (not trusted, signature invalid). Nothing of the bundle but the signature file is parsed; the
    other files are only hashed. A second call in the same process on a bundle whose ``file_state`` is
    unchanged since a successful one, with the same keys, returns that result without hashing again.
    """
    root = Path(root)
    keys = trusted_keys if all(isinstance(k, TrustedKey) for k in trusted_keys) else load_trusted_keys(trusted_keys)
    if not keys:
        raise InvalidInput("verify_bundle needs at least one trusted key")
    memo = (os.path.realpath(root), tuple(sorted((k.source, k.hint) for k in keys)))
    before = file_state(root)  # before any byte is hashed: a change while hashing shows in the next call's state
    hit = _VERIFIED.get(memo)
    if before is not None and hit is not None and hit[0] == before:
        return hit[1]
    verified = _verify_files(root, keys)
    if before is not None:
        if len(_VERIFIED) >= MAX_REMEMBERED:
            _VERIFIED.clear()
        _VERIFIED[memo] = (before, verified)
    return verified


def _verify_files(root: Path, keys: list[TrustedKey]) -> Verified:
    path = root / paths.SIGNATURE_PATH
    doc = read_signature(root)
    key = _check_envelope(path, doc, keys)
    env = doc["dsseEnvelope"]
    table = signed_resources(path, str(env.get("payloadType")), base64.b64decode(env["payload"]))
    present = bundle_files(root)
    problems = [(rel, "not covered by the signature (a file was added or renamed)")
                for rel in present if rel not in table]
    problems += [(rel, "signed but missing (a file was removed or renamed)")
                 for rel in sorted(set(table) - set(present))]
    total = 0
    for rel in present:
        if rel in table and not problems:
            total += (root / rel).stat().st_size
            if sha256_file(root / rel) != table[rel]:
                problems.append((rel, "sha256 differs from the signed digest (modified after signing)"))
    if problems:
        more = f" (and {len(problems) - MAX_PROBLEMS} more)" if len(problems) > MAX_PROBLEMS else ""
        raise SignatureError(f"{root}: signature check failed: "
                             + "; ".join(f"{r}: {m}" for r, m in problems[:MAX_PROBLEMS]) + more,
                             paths=tuple(r for r, _ in problems))
    return Verified(key.source, key.hint, len(present), total)


# -- a verification re-used: one process verifies a bundle more than once while it opens it (vLLM's config hook and
#    worker both judge the facts, ``Bundle.read_facts``, then open it, ``open_bundle``: two full hashes of every file)

RACY_NS = 2_000_000_000  # a file changed this recently could change again under the same coarse timestamps
MAX_REMEMBERED = 64
_VERIFIED: dict[tuple, tuple[str, Verified]] = {}  # (real path, trusted keys) -> (file_state, what it established)


def file_state(root: Path) -> str | None:
    """A digest of the bundle as the file system describes it, or None when that cannot stand for its bytes.

    Every entry under ``root`` (the signature included, the folder itself too): its path, type, size, mtime,
    ctime, inode and device. ``verify_bundle`` re-uses a verification of the same real path with the same keys
    only while this digest is unchanged, and takes it before hashing, so what it re-uses covers the bytes it
    hashed. Why that is sound: no write reaches a file's bytes without moving its ctime, which no unprivileged
    process can set back (``os.utime`` restores mtime and moves ctime); a file replaced or renamed in changes
    its inode or ctime; an added, removed or renamed file changes the list. Two changes inside one timestamp tick
    can share a ctime (git's "racily clean" entries), so a bundle with any entry changed within ``RACY_NS`` of
    now is never remembered nor re-used: it is hashed every time. Anything unreadable gives None (hash it)."""
    now, names, entries = time.time_ns(), [str(root)], []
    try:
        for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
            names += [os.path.join(dirpath, name) for name in dirnames + filenames]
        for name in names:
            st = os.lstat(name)
            if max(st.st_mtime_ns, st.st_ctime_ns) > now - RACY_NS:
                return None
            entries.append((os.path.relpath(name, root), st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                            st.st_ino, st.st_dev))
    except OSError:
        return None
    return hashlib.sha256(repr(sorted(entries)).encode()).hexdigest()


def require(root: Path, trusted_keys=None) -> Verified | None:
    """open_bundle's gate: verify with ``trusted_keys`` (None: NEFFBUILD_TRUSTED_KEYS); None when no key is set.

    An empty list is refused (InvalidInput naming ``trusted_keys``): "trust these keys" with none listed is a
    caller's mistake (a config read as ``[]``), and reading it as "no policy" would switch off the host's
    NEFFBUILD_TRUSTED_KEYS and open unsigned bundles. Pass None for the environment's keys."""
    if trusted_keys is None:
        from neffbuild import settings

        trusted_keys = settings.trusted_keys()
        return verify_bundle(root, trusted_keys) if trusted_keys else None
    if isinstance(trusted_keys, (str, bytes)) or len(trusted_keys) == 0:
        raise InvalidInput(f"trusted_keys: got {trusted_keys!r:.80}, must list at least one PEM public key (a path "
                           "or PEM bytes); leave it out (None) to use NEFFBUILD_TRUSTED_KEYS")
    return verify_bundle(root, trusted_keys)
