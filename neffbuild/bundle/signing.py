"""Sign a finished bundle: write ``model.sig`` (OpenSSF model-signing format, key mode) over every file.

The statement and its encoding are defined once, in ``runtime/bundle/model_sig.py``, which every
verifier uses; this module adds the private-key side. Written with ``cryptography`` rather than
the ``model-signing`` package: the same bytes on disk (its ``verify key`` accepts them), one
dependency instead of sigstore's dozen, and the runtime can verify with the same library
(docs/bundle-format.md, "Signature").
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

from neffbuild.errors import BundleError, InvalidInput
from neffbuild.fsutil import read_regular, sha256_file
from neffbuild.runtime.bundle import model_sig as signature
from neffbuild.runtime.bundle import paths


def load_private_key(path: str | Path, password: bytes | None = None, what: str = "--key"):
    """A PEM EC private key (P-256/384/521); a bad file is the user's input (exit 2)."""
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ec
    except ImportError:
        raise InvalidInput("signing needs the `cryptography` package: pip install 'neffbuild[signing]'") from None
    try:
        key = serialization.load_pem_private_key(read_regular(path, what, signature.MAX_KEY_BYTES), password)
    except (ValueError, TypeError) as exc:
        raise InvalidInput(f"{what} {path}: not an unencrypted PEM private key ({str(exc)[:120]}); make one with "
                           "`openssl ecparam -genkey -name prime256v1 -noout -out key.pem`") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.key_size not in (256, 384, 521):
        raise InvalidInput(f"{what} {path}: must be an elliptic-curve key on P-256, P-384 or P-521")
    return key


def sign(root: str | Path, key, *, check: bool = True, name: str | None = None) -> dict:
    """Write ``root/model.sig`` signed with ``key`` (a private key object or a PEM path); its summary.

    check: refuse a bundle that fails the reader's checks (digest, schema, sizes), and any
    listed file whose sha256 differs from the manifest: never sign a corrupt bundle.
    name: the statement's subject (default: the folder's name, ``<name>-<version>``).
    """
    from cryptography.hazmat.primitives.asymmetric import ec

    root = Path(root)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        key = load_private_key(key)
    listed = {}
    if check:
        from neffbuild.runtime.bundle import reader  # torch: only a signing run checks the bundle whole

        problems = reader.check(root, full=False)
        if problems:
            raise BundleError(f"{root}: not signed, the bundle has problems: " + "; ".join(map(str, problems[:10])))
        listed = reader.read_manifest(root)["files"]
    resources = []
    for rel in signature.bundle_files(root):
        digest = sha256_file(root / rel)
        if rel in listed and listed[rel]["sha256"] != digest:
            raise BundleError(f"{root}: not signed: {rel}: sha256 mismatch with the manifest (corrupt or modified)")
        resources.append((rel, digest))
    doc = signed_document(name or root.name, resources, key)
    hint = doc["verificationMaterial"]["publicKey"]["hint"]
    dest = root / paths.SIGNATURE_PATH
    if dest.is_symlink() or (dest.exists() and not dest.is_file()):
        raise InvalidInput(f"{dest}: is not a regular file (a folder or a link); remove it, then sign again")
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, dest)
    return {"bundle": str(root), "signature": str(dest), "key_hint": hint, "files": len(resources),
            "bytes": sum((root / rel).stat().st_size for rel, _ in resources)}


def signed_document(name: str, resources: list[tuple[str, str]], key) -> dict:
    """The signature document (Sigstore bundle, DSSE envelope, model-signing statement) over ``resources``
    ((name, sha256 hex), sorted by name) with subject ``name``, signed with the EC private key ``key``."""
    from cryptography.hazmat.primitives.asymmetric import ec

    payload = json.dumps(signature.statement(name, resources), sort_keys=True, separators=(",", ":")).encode()
    pub = key.public_key()
    sig = key.sign(signature.pae(signature.PAYLOAD_TYPE, payload), ec.ECDSA(signature.ec_hash(pub)))
    return {
        "mediaType": signature.MEDIA_TYPE,
        "verificationMaterial": {"publicKey": {"hint": signature.key_hint(pub)}, "tlogEntries": []},
        "dsseEnvelope": {"payload": base64.b64encode(payload).decode(), "payloadType": signature.PAYLOAD_TYPE,
                         "signatures": [{"sig": base64.b64encode(sig).decode(), "keyid": ""}]},
    }


def describe(root: str | Path) -> dict:
    """What ``inspect`` says about the signature, without verifying it (no key needed)."""
    root = Path(root)
    if not (root / paths.SIGNATURE_PATH).exists():
        return {"signed": False}
    try:
        doc = signature.read_signature(root)
    except BundleError as exc:
        return {"signed": False, "error": str(exc)}
    return {"signed": True, "verified": False, "key_hint": signature.signer_hint(doc), "format": PAYLOAD_FORMAT}


PAYLOAD_FORMAT = f"{signature.MEDIA_TYPE} / {signature.PREDICATE_TYPE}"
