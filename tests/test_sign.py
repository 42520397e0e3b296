"""Signed bundles (issue 22): model.sig in the OpenSSF model-signing format, verified before anything loads.

Every tamper case is refused by `verify --trust` (exit 1, naming the file or the key) and by
`open_bundle(..., trusted_keys=...)` before any artifact is loaded: an audit hook records every
Python-level open of a `.pt2` with the functions on the stack, and spies on the loader and on
the package reader show neither ran. The session bundle `built` is copied, never compiled anew.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import sys
from pathlib import Path

import pytest

from neffbuild.errors import SignatureError
from tests.helpers import run_cli

pytest.importorskip("cryptography")

# -- instrumentation: which .pt2 files were opened, by whom (audit hook, installed once, inert unless watching)
_OPENS: list[tuple[str, set[str]]] = []
_WATCH = [False]


def _hook(event, args):
    if _WATCH[0] and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)) and \
            os.fsdecode(args[0]).endswith(".pt2"):
        names, f = set(), sys._getframe(1)
        while f is not None:
            names.add(f.f_code.co_name)
            f = f.f_back
        _OPENS.append((os.fsdecode(args[0]), names))


sys.addaudithook(_hook)


@pytest.fixture
def watch(monkeypatch):
    """Record .pt2 opens and every call of the package reader and the artifact loader."""
    from neffbuild.runtime.bundle import aoti_package, loaders

    calls = []
    for mod, name in ((loaders, "load"), (aoti_package, "describe"), (aoti_package, "load_package")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _n=name, **k: (calls.append(_n), _real(*a, **k))[1])
    _OPENS.clear()
    _WATCH[0] = True
    yield calls
    _WATCH[0] = False


def _keypair(folder: Path, name: str) -> tuple[Path, Path]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    priv, pub = folder / f"{name}.pem", folder / f"{name}.pub.pem"
    priv.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                  serialization.PublicFormat.SubjectPublicKeyInfo))
    return priv, pub


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys")
    return {"a": _keypair(folder, "a"), "b": _keypair(folder, "b")}


@pytest.fixture(scope="module")
def signed(built, keys, tmp_path_factory):
    """A copy of the session bundle, signed with key a by `neffbuild sign`."""
    dest = tmp_path_factory.mktemp("signed") / built.bundle.name
    shutil.copytree(built.bundle, dest)
    code, out, err, exc = run_cli("sign", str(dest), "--key", str(keys["a"][0]), "--json")
    assert code == 0 and exc is None, err
    assert json.loads(out)["files"] > 10
    return dest


@pytest.fixture
def copy(signed, tmp_path):
    dest = tmp_path / signed.name
    shutil.copytree(signed, dest)
    return dest


def _flip_byte(root: Path, keys) -> str:
    p = root / "artifacts" / "decode_b1_ctx128.pt2"
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))
    return "artifacts/decode_b1_ctx128.pt2"


def _flip_byte_keep_times(root: Path, keys) -> str:
    """Other bytes, the same size, the old mtime put back (``os.utime``): only the ctime moves."""
    p = root / "artifacts" / "decode_b1_ctx128.pt2"
    st = p.stat()
    _flip_byte(root, keys)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    return "artifacts/decode_b1_ctx128.pt2"


def _add_file(root: Path, keys) -> str:
    shutil.copyfile(root / "artifacts" / "decode_b4_ctx128.pt2", root / "artifacts" / "extra.pt2")
    return "artifacts/extra.pt2"


def _remove_file(root: Path, keys) -> str:
    (root / "artifacts" / "decode_b4_ctx512.pt2").unlink()
    return "artifacts/decode_b4_ctx512.pt2"


def _rename_file(root: Path, keys) -> str:
    os.replace(root / "artifacts" / "decode_b1_ctx256.pt2", root / "artifacts" / "decode_b1_ctx384.pt2")
    return "artifacts/decode_b1_ctx384.pt2"


def _rewrite_manifest(root: Path, keys) -> str:
    """A consistent forgery: the manifest points at other bytes and manifest.sha256 agrees with it."""
    import hashlib

    from neffbuild.bundle import manifest as manifest_mod

    m = json.loads((root / "manifest.json").read_text())
    m["artifacts"][0]["cache_key"] = "0" * 64
    text = manifest_mod.dumps(m)
    (root / "manifest.json").write_text(text)
    (root / "manifest.sha256").write_text(f"{hashlib.sha256(text.encode()).hexdigest()}  manifest.json\n")
    return "manifest.json"


def _other_key(root: Path, keys) -> str:
    from neffbuild.bundle import signing
    from neffbuild.runtime.bundle import model_sig as signature

    signing.sign(root, keys["b"][0])
    return signature.signer_hint(signature.read_signature(root))[:16]


def _edited_statement(root: Path, keys) -> str:
    """The signed statement altered to match a modified file, the old signature kept."""
    sig = json.loads((root / "model.sig").read_text())
    st = json.loads(base64.b64decode(sig["dsseEnvelope"]["payload"]))
    st["predicate"]["resources"][0]["digest"] = "0" * 64
    sig["dsseEnvelope"]["payload"] = base64.b64encode(json.dumps(st).encode()).decode()
    (root / "model.sig").write_text(json.dumps(sig))
    return "does not verify"


def _unsigned(root: Path, keys) -> str:
    (root / "model.sig").unlink()
    return "unsigned"


def _symlink(root: Path, keys) -> str:
    (root / "report.html").unlink()
    (root / "report.html").symlink_to(root / "recipe.yaml")
    return "report.html"


TAMPER = [_flip_byte, _flip_byte_keep_times, _add_file, _remove_file, _rename_file, _rewrite_manifest, _other_key,
          _edited_statement, _unsigned, _symlink]


@pytest.mark.parametrize("tamper", TAMPER, ids=[t.__name__.strip("_") for t in TAMPER])
def test_tampered_bundle_is_refused_before_any_artifact_loads(copy, keys, tamper, watch, monkeypatch):
    from neffbuild.runtime import open_bundle

    monkeypatch.delenv("NEFFBUILD_TRUSTED_KEYS", raising=False)
    needle = tamper(copy, keys)
    code, out, err, exc = run_cli("verify", str(copy), "--trust", str(keys["a"][1]), "--json")
    assert exc is None and code == 1, (out, err)
    assert needle in err and "Traceback" not in err
    assert not json.loads(out)["ok"]
    _OPENS.clear()
    watch.clear()
    with pytest.raises(SignatureError, match=needle.replace(".", r"\.")):
        open_bundle(copy, trusted_keys=[keys["a"][1]])
    assert watch == [], f"the package reader or loader ran: {watch}"
    assert all("verify_bundle" in names and "sha256_file" in names for _, names in _OPENS), _OPENS


@pytest.mark.parametrize("tamper", TAMPER, ids=[t.__name__.strip("_") for t in TAMPER])
def test_a_bundle_changed_after_its_facts_were_judged_is_refused_when_opened(copy, keys, tamper, watch, monkeypatch):
    """A host judges a bundle's facts (``Bundle.read_facts``, vLLM's config hook and worker), then opens it: the
    open re-uses the first verification only while the files' state is unchanged (model_sig.file_state)."""
    from neffbuild.runtime import Bundle, open_bundle
    from neffbuild.runtime.bundle import model_sig

    monkeypatch.delenv("NEFFBUILD_TRUSTED_KEYS", raising=False)
    monkeypatch.setattr(model_sig, "RACY_NS", 0)  # the copy is a moment old: remembered all the same
    trusted = [keys["a"][1]]
    assert Bundle.read_facts(copy, trusted_keys=trusted) is not None
    needle = tamper(copy, keys)
    with pytest.raises(SignatureError, match=needle.replace(".", r"\.")):
        open_bundle(copy, trusted_keys=trusted)
    assert watch == [], f"the package reader or loader ran: {watch}"


def test_an_unchanged_bundle_is_verified_once_per_process_unless_freshly_written(copy, keys, watch, monkeypatch):
    """The second verification (open_bundle after read_facts) hashes nothing when nothing changed; a bundle written
    within RACY_NS is hashed every time (two writes in one timestamp tick can share a ctime)."""
    from neffbuild.runtime import Bundle, open_bundle
    from neffbuild.runtime.bundle import model_sig

    monkeypatch.delenv("NEFFBUILD_TRUSTED_KEYS", raising=False)
    trusted = [keys["a"][1]]

    def hashed_by_verify() -> bool:
        return any("verify_bundle" in names for _, names in _OPENS)

    for racy_ns, rehashed in ((10**12, True), (0, False)):  # the copy is written within 1,000 s / remembered
        monkeypatch.setattr(model_sig, "RACY_NS", racy_ns)
        model_sig._VERIFIED.clear()
        Bundle.read_facts(copy, trusted_keys=trusted)
        _OPENS.clear()
        assert open_bundle(copy, trusted_keys=trusted).labels
        assert hashed_by_verify() == rehashed, _OPENS
        _OPENS.clear()
        model_sig.verify_bundle(copy, [keys["b"][1], keys["a"][1]])  # other keys: verified anew
        assert hashed_by_verify()


def test_signed_bundle_opens_and_loads(copy, keys, watch, monkeypatch):
    """The positive control: the same instrumentation sees the loader open a .pt2 of a good bundle."""
    from neffbuild.runtime import open_bundle

    monkeypatch.delenv("NEFFBUILD_TRUSTED_KEYS", raising=False)
    code, _, err, _ = run_cli("verify", str(copy), "--trust", str(keys["b"][1]), "--trust", str(keys["a"][1]))
    assert code == 0, err
    b = open_bundle(copy, trusted_keys=[keys["a"][1].read_bytes()])
    b.artifact(b.labels[0])
    assert "load" in watch and "describe" in watch
    assert any("verify_bundle" not in names for _, names in _OPENS)  # the loader's own opens are visible


def test_trusted_keys_from_the_environment(copy, keys, monkeypatch):
    from neffbuild.runtime import open_bundle

    monkeypatch.setenv("NEFFBUILD_TRUSTED_KEYS", str(keys["b"][1]))
    with pytest.raises(SignatureError, match="not a trusted key"):
        open_bundle(copy)
    monkeypatch.setenv("NEFFBUILD_TRUSTED_KEYS", os.pathsep.join([str(keys["b"][1]), str(keys["a"][1])]))
    assert open_bundle(copy).labels
    code, _, err, _ = run_cli("verify", str(copy))  # verify honours the variable too
    assert code == 0, err


def test_unsigned_bundle_without_keys_is_as_today(built, monkeypatch):
    from neffbuild.runtime import open_bundle

    monkeypatch.delenv("NEFFBUILD_TRUSTED_KEYS", raising=False)
    root = built.bundle
    assert open_bundle(root).labels
    code, out, err, _ = run_cli("inspect", str(root), "--json")
    assert code == 0, err
    assert json.loads(out)["signature"] == {"signed": False}
    code, out, _, _ = run_cli("inspect", str(root))
    assert "signature: unsigned" in out


def test_bad_key_is_invalid_input(signed, tmp_path):
    bad = tmp_path / "bad.pem"
    bad.write_text("not a key\n")
    code, _, err, exc = run_cli("verify", str(signed), "--trust", str(bad))
    assert exc is None and code == 2 and "not a PEM public key" in err
    code, _, err, exc = run_cli("sign", str(signed), "--key", str(bad))
    assert exc is None and code == 2 and "--key" in err


def test_sign_refuses_a_corrupt_bundle(copy, keys):
    _flip_byte(copy, keys)
    code, _, err, exc = run_cli("sign", str(copy), "--key", str(keys["a"][0]))
    assert exc is None and code == 1 and "decode_b1_ctx128.pt2" in err


def test_model_signing_package_verifies_our_signature(signed, keys, tmp_path):
    """Format oracle: the OpenSSF reference implementation accepts model.sig, and ours accepts its signature."""
    ms = pytest.importorskip("model_signing")
    from neffbuild.runtime.bundle import model_sig as signature

    ms.verifying.Config().use_elliptic_key_verifier(public_key=keys["a"][1]).verify(signed, signed / "model.sig")
    theirs = tmp_path / signed.name
    shutil.copytree(signed, theirs)
    (theirs / "model.sig").unlink()
    ms.signing.Config().use_elliptic_key_signer(private_key=keys["b"][0]).sign(theirs, theirs / "model.sig")
    ours = signature.verify_bundle(signed, [keys["a"][1]])
    assert signature.verify_bundle(theirs, [keys["b"][1]]).files == ours.files


def test_compile_sign_key_signs_and_records_provenance(built, build_cache, keys, tmp_path):
    """A cache-hit rebuild (no compile) with --sign-key: signed before publishing; provenance names every hit."""
    recipe, res = built.recipe, built.result
    out = tmp_path / "out"
    code, _, err, exc = run_cli("compile", str(recipe), "-o", str(out), "--cache-dir", str(build_cache),
                                "--sign-key", str(keys["a"][0]), "--json")
    assert exc is None and code == 0, err
    root = out / res.bundle.name
    code, _, err, _ = run_cli("verify", str(root), "--trust", str(keys["a"][1]))
    assert code == 0, err
    code, text, _, _ = run_cli("inspect", str(root), "--json")
    doc = json.loads(text)
    prov = doc["provenance"]
    assert doc["signature"]["signed"] and doc["signature"]["key_hint"]
    assert prov["recipe_sha256"] == doc["recipe_sha256"] and prov["toolchain"] == doc["toolchain"]
    assert prov["builder"] == f"urn:neffbuild:host:{socket.gethostname()}"
    assert sorted(prov["from_cache"]) == sorted(a["label"] for a in doc["artifacts"]) and prov["compiled"] == []
    assert len(prov["checkpoint"]["checkpoint"]) == 64
    code, text, _, _ = run_cli("inspect", str(root))
    assert "provenance: built by urn:neffbuild:host:" in text and "from cache: 6" in text


def test_runtime_imports_cryptography_only_with_trusted_keys(signed, keys):
    import subprocess

    from tests.conftest import ROOT

    code = ("import sys; from neffbuild.runtime import open_bundle; b = open_bundle(sys.argv[1]); "
            "before = 'cryptography' in sys.modules; open_bundle(sys.argv[1], trusted_keys=[sys.argv[2]]); "
            "print(before, 'cryptography' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "NEFFBUILD_TRUSTED_KEYS"}
    out = subprocess.run([sys.executable, "-c", code, str(signed), str(keys["a"][1])], capture_output=True,
                         text=True, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]


def test_sign_refuses_a_model_sig_that_is_a_folder(tmp_path):
    """`sign` when model.sig is a folder was a traceback (os.replace of a file onto a folder)."""
    from neffbuild.bundle import signing
    from neffbuild.errors import InvalidInput

    root = tmp_path / "b"
    (root / "model.sig").mkdir(parents=True)
    (root / "manifest.json").write_text("{}")
    priv, _ = _keypair(tmp_path, "k")
    with pytest.raises(InvalidInput, match=r"model\.sig: is not a regular file"):
        signing.sign(root, priv, check=False)
    assert (root / "model.sig").is_dir()


@pytest.mark.parametrize("doc", ["[]", '"x"', "null", "3", '{"mediaType": []}',
                                 '{"mediaType": "application/vnd.dev.sigstore.x", "dsseEnvelope": []}'])
def test_a_signature_that_is_json_but_not_an_object_is_a_signature_error(tmp_path, doc):
    from neffbuild.runtime.bundle import model_sig as signature

    (tmp_path / "model.sig").write_text(doc)
    with pytest.raises(SignatureError, match="not a model-signing signature"):
        signature.read_signature(tmp_path)


@pytest.mark.parametrize("statement", [[], "x", None, {"_type": 1, "predicate": []},
                                       {"_type": "https://in-toto.io/Statement/v1", "predicate": {"resources": []},
                                        "predicateType": "https://model_signing/signature/v1.0",
                                        "subject": [{"digest": []}]}])
def test_a_statement_that_is_not_an_object_is_a_signature_error(statement):
    from neffbuild.runtime.bundle import model_sig as signature

    with pytest.raises(SignatureError):
        signature.signed_resources(Path("model.sig"), signature.PAYLOAD_TYPE, json.dumps(statement).encode())


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_trust_and_key_files_are_bounded_regular_files(tmp_path, kind):
    from neffbuild.bundle.signing import load_private_key
    from neffbuild.errors import InvalidInput
    from neffbuild.runtime.bundle.model_sig import load_trusted_keys

    path = "/dev/zero" if kind == "dev-zero" else tmp_path / "k.pem"
    if kind == "fifo":
        os.mkfifo(path)
    with pytest.raises(InvalidInput, match="not a regular file"):
        load_trusted_keys([path])
    with pytest.raises(InvalidInput, match="not a regular file"):
        load_private_key(path)


@pytest.mark.parametrize("doc", ["[]", '"x"', "null"])
def test_model_sig_not_an_object_is_a_clean_refusal_everywhere(copy, keys, doc):
    """verify --trust, inspect and generate --trust gave an AttributeError traceback; open_bundle raised it too."""
    from neffbuild.runtime.bundle.reader import open_bundle

    (copy / "model.sig").write_text(doc)
    pub = str(keys["a"][1])
    for args in (["verify", str(copy), "--trust", pub], ["inspect", str(copy)],
                 ["generate", str(copy), "--prompt-ids", "1,2", "--max-new-tokens", "1", "--trust", pub]):
        code, _, err, exc = run_cli(*args)
        assert exc is None and "Traceback" not in err, (args, err)
        assert code == (0 if args[0] == "inspect" else 1), (args, err)
    with pytest.raises(SignatureError, match="not a model-signing signature"):
        open_bundle(copy, trusted_keys=[keys["a"][1]])
