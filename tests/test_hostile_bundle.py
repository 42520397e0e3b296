"""Hostile bundles: weights headers, and tampered bundles that are "consistent" (file checksums and the manifest
digest rewritten, as an attacker or a buggy tool would), so the schema, the weights header checks and the
artifact signature checks must catch them.

Each case ends in a clean error (or correct output), never a crash."""

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch

from neffbuild.bundle import manifest, paths
from neffbuild.errors import BundleError
from neffbuild.runtime.bundle import aoti_package
from neffbuild.runtime.bundle.reader import check, open_bundle
from tests.conftest import POOL
from tests.helpers import cli, gi, kv_sigs, run_cli, strict_json, tampered

# -- weights headers (no bundle needed)

def write_safetensors(path: Path, header: dict, data: bytes, length: int | None = None) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)


F32x4 = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
HEADERS = [
    ("huge-length", {"a": F32x4}, 16, 2**63, "header length"),
    ("length-past-end", {"a": F32x4}, 16, 10**6, "header length"),
    ("unknown-dtype", {"a": dict(F32x4, dtype="F128")}, 16, None, "unknown dtype"),
    ("negative-offset", {"a": dict(F32x4, data_offsets=[-16, 0])}, 16, None, "outside the data area"),
    ("past-the-end", {"a": dict(F32x4, data_offsets=[16, 32])}, 16, None, "outside the data area"),
    ("overlap", {"a": F32x4, "b": dict(F32x4, shape=[2], data_offsets=[8, 16])}, 16, None, "overlap"),
    ("shape-vs-bytes", {"a": dict(F32x4, shape=[5])}, 16, None, "needs 20 bytes"),
    ("float-shape", {"a": dict(F32x4, shape=[4.0])}, 16, None, "non-negative ints"),
    ("bool-offset", {"a": dict(F32x4, data_offsets=[False, 16])}, 16, None, "must be \\[begin, end\\]"),
    ("not-object", [1, 2], 16, None, "must be a JSON object"),
]


@pytest.mark.parametrize("header,nbytes,length,needle", [c[1:] for c in HEADERS], ids=[c[0] for c in HEADERS])
def test_weights_header_limits(tmp_path, header, nbytes, length, needle):
    from neffbuild.runtime.bundle import weights_file

    p = tmp_path / "w.safetensors"
    write_safetensors(p, header, bytes(nbytes), length)
    with pytest.raises(BundleError, match=needle):
        weights_file.load(p)


def test_weights_short_and_deep_files(tmp_path):
    from neffbuild.runtime.bundle import weights_file

    p = tmp_path / "w.safetensors"
    p.write_bytes(b"abc")
    with pytest.raises(BundleError, match="too short"):
        weights_file.load(p)
    deep = b"[" * 50_000 + b"]" * 50_000
    p.write_bytes(struct.pack("<Q", len(deep)) + deep)
    with pytest.raises(BundleError, match="not valid JSON"):
        weights_file.load(p)


def test_weights_share_one_private_mapping(tmp_path):
    from safetensors.torch import save_file

    from neffbuild.runtime.bundle import weights_file

    p = tmp_path / "w.safetensors"
    save_file({"a": torch.arange(8.0), "b": torch.ones(4, 4)}, str(p))
    w = weights_file.load(p, {"a": {"dtype": "float32", "shape": [8]}, "b": {"dtype": "float32", "shape": [4, 4]}})
    maps = [line for line in Path("/proc/self/maps").read_text().splitlines() if str(p) in line]
    assert len({line.split()[0] for line in maps}) == 1  # one mapping for both tensors
    w["a"].mul_(2)  # copy-on-write: the file is untouched
    assert weights_file.load(p)["a"][1] == 1.0
    with pytest.raises(BundleError, match=r"weights\.tensors\.b"):
        weights_file.load(p, {"a": {"dtype": "float32", "shape": [8]}, "b": {"dtype": "float32", "shape": [16]}})


def test_failed_package_load_leaves_no_temp_folder(tmp_path):
    import tempfile
    import zipfile

    bad = tmp_path / "bad.pt2"
    with zipfile.ZipFile(bad, "w") as z:
        z.writestr("artifact/data/aotinductor/model/x.wrapper.cpp", "int main() {}")
    before = set(Path(tempfile.gettempdir()).glob(f"{aoti_package.TMP_PREFIX}*"))
    with pytest.raises(BundleError, match="could not load"):
        aoti_package.load_package(bad)
    assert set(Path(tempfile.gettempdir()).glob(f"{aoti_package.TMP_PREFIX}*")) == before

# -- tampered bundles (a real compiled bundle; checksums and digest rewritten to match)

def _kv_lie(root, m):
    m["graph_inputs"]["num_blocks"] = 256
    m["graph_inputs"]["kv_layout"]["buffer_shape"][1] = 256
    kv_sigs(m, lambda s: s["shape"].__setitem__(1, 256))


def _fp8_lie(root, m):
    m["graph_inputs"].update(fp8_packed_kv=True)
    m["graph_inputs"]["kv_layout"].update(dtype="float8_e4m3fn", packed_k=True)
    kv_sigs(m, lambda s: s.update(dtype="uint8"))


def _swa_lie(root, m):
    m["graph_inputs"]["num_swa"] = 4
    for a in m["artifacts"]:
        a["input_signature"][3]["shape"][1] = 4


def _rewrite_header(edit):
    def fn(root, m):
        p = root / m["weights"]["file"]
        raw = p.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])
        edit(header)
        write_safetensors(p, header, raw[8 + n:])
        return [m["weights"]["file"]]
    return fn


def _overlap(h):
    names = sorted(k for k in h if k != "__metadata__")
    h[names[1]]["data_offsets"] = [h[names[0]]["data_offsets"][0], h[names[0]]["data_offsets"][0]
                                   + h[names[1]]["data_offsets"][1] - h[names[1]]["data_offsets"][0]]


def _garbage_artifact(root, m):
    rel = m["artifacts"][0]["file"]
    (root / rel).write_bytes(b"PK\x03\x04" + bytes(5000))
    return [rel]


def _extra_so(root, m):
    (root / "artifacts" / "evil.so").write_bytes(b"\x7fELF")


def _weights(fn):
    return lambda root, m: (fn(m["weights"]["file"], root), [m["weights"]["file"]])[1]


# (id, edit, stage: "open" must fail at open_bundle, "load" by the first load of every artifact at the latest, needle)
BUNDLES = [
    ("kv-buffer-shape-256", gi(lambda g: g["kv_layout"]["buffer_shape"].__setitem__(1, 256)), "open", "buffer_shape"),
    ("kv-num-blocks-256", gi(lambda g: (g.update(num_blocks=256), g["kv_layout"]["buffer_shape"].__setitem__(1, 256))),
     "open", "input_signature"),
    ("kv-consistent-lie", _kv_lie, "load", f"the artifact takes float32 \\[2, {POOL}"),
    ("num-swa-4", gi(lambda g: g.update(num_swa=4)), "open", "input_signature\\[3\\]"),
    ("num-swa-4-consistent", _swa_lie, "load", "input_signature\\[3\\]"),
    ("num-swa-negative", gi(lambda g: g.update(num_swa=-1)), "open", "num_swa"),
    ("kv-dtype-fp8", gi(lambda g: g["kv_layout"].update(dtype="float8_e4m3fn")), "open", "kv_layout.dtype"),
    ("fp8-consistent-lie", _fp8_lie, "load", "the artifact takes float32"),
    ("file-of-other-label", lambda r, m: m["artifacts"][0].update(file=m["artifacts"][1]["file"]), "open",
     "its own file"),
    ("duplicate-label", lambda r, m: m["artifacts"].__setitem__(1, dict(m["artifacts"][0])), "open", "duplicate"),
    ("no-artifacts", lambda r, m: m.update(artifacts=[]), "open", "at least one"),
    ("missing-cell", lambda r, m: m["artifacts"].pop() and None, "open", "lacks \\(batch, ctx\\) cells"),
    ("negative-bytes", lambda r, m: m["files"][m["weights"]["file"]].update(bytes=-1), "open", "bytes"),
    ("unlisted-so", _extra_so, "open", "not listed"),
    ("no-kv-layout", gi(lambda g: g.pop("kv_layout")), "open", "kv_layout"),
    ("string-batch", lambda r, m: m["artifacts"][0].update(batch="1"), "open", "not a cell of the grid"),
    ("deep-manifest", lambda r, m: "[" * 100_000 + "]" * 100_000, "open", "nested deeper"),
    ("nan-manifest", lambda r, m: json.dumps(dict(m, x=float("nan"))), "open", "not standard JSON"),
    ("duplicate-key", lambda r, m: '{"format": 1, ' + manifest.dumps(m)[1:], "open", "duplicate key"),
    ("weights-overlap", _rewrite_header(_overlap), "open", "overlap"),
    ("weights-negative", _rewrite_header(lambda h: h["norm"].update(data_offsets=[-4, 252])), "open",
     "outside the data area"),
    ("weights-dtype", _rewrite_header(lambda h: h["norm"].update(dtype="Q4")), "open", "unknown dtype"),
    ("weights-missing-tensor", _rewrite_header(lambda h: h.pop("norm")), "open", "missing from the file|a gap of"),
    ("weights-huge-header", _weights(lambda rel, root: (root / rel).write_bytes(struct.pack("<Q", 2**63) + b"{}")),
     "open", "header length"),
    ("weights-3-bytes", _weights(lambda rel, root: (root / rel).write_bytes(b"abc")), "open", "too short"),
    ("weights-table-lie", lambda r, m: m["weights"]["tensors"]["embed"].update(shape=[2, 64]), "open",
     "implies weight 'embed' of shape \\[256, 64\\], the bundle's weights hold \\[2, 64\\]"),
    ("garbage-artifact", _garbage_artifact, "load", "not a readable AOTInductor package"),
    # issue 25: what the safetensors library would refuse later, and manifest fields generate reads
    ("weights-gap-at-end", lambda r, m: _weights_gap(r, m, at_end=True), "open", "cover it exactly"),
    ("+ weights-gap-inside", lambda r, m: _weights_gap(r, m, at_end=False), "open", "a gap of 4 bytes"),
    ("weights-metadata-not-str", _rewrite_header(lambda h: h.update(__metadata__={"format": 1})), "open",
     "__metadata__ must map strings to strings"),
    ("parallel-on-unsharded", lambda r, m: m.update(parallel={"tp": 1, "dp": 1, "ep": 1, "world_size": 1,
                                                              "pieces": {}}), "open", "present on a bundle"),
    ("+ model-config-without-vocab", gi(lambda g: g["model_config"].pop("vocab_size")), "open",
     "model_config.vocab_size"),
]


def _weights_gap(root, m, *, at_end):
    p = root / m["weights"]["file"]
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    if at_end:
        data += bytes(4)
    else:
        last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
        b, e = header[last]["data_offsets"]
        header[last]["data_offsets"] = [b + 4, e + 4]
        data = data[:b] + bytes(4) + data[b:]
    write_safetensors(p, header, data)
    return [m["weights"]["file"]]


@pytest.mark.slow
@pytest.mark.parametrize("edit,stage,needle", [c[1:] for c in BUNDLES], ids=[c[0] for c in BUNDLES])
def test_tampered_bundle_is_refused(built, tmp_path, edit, stage, needle):
    root = tampered(built.bundle, tmp_path / "b", edit)
    with pytest.raises(BundleError, match=needle):
        b = open_bundle(root)
        assert stage == "load", "expected open_bundle to refuse it"
        for label in b.labels:  # the fallback artifact is checked at open; the others before their first call
            b.artifact(label)
    assert check(root), "verify must report it too"


@pytest.mark.slow
def test_manifest_edit_without_digest_is_caught(built, tmp_path):
    root = tmp_path / "b"
    shutil.copytree(built.bundle, root)
    text = (root / paths.MANIFEST_PATH).read_text().replace('"max_model_len": 512', '"max_model_len": 1024')
    (root / paths.MANIFEST_PATH).write_text(text)
    with pytest.raises(BundleError, match=r"manifest\.sha256"):
        open_bundle(root)


def _generate(*args):
    return cli("generate", *args, process=True, timeout=300)  # a tampered bundle: its own process, whatever happens


@pytest.mark.slow
@pytest.mark.parametrize("edit,needle", [
    (_kv_lie, "the artifact takes"),
    (_fp8_lie, "the artifact takes"),
    (gi(lambda g: g["model_config"].update(vocab_size=2)), "model_config: implies weight 'embed'"),
    (gi(lambda g: g["model_config"].update(num_hidden_layers=10**30)), "num_hidden_layers"),
], ids=["kv-lie", "fp8-lie", "vocab-2", "layers-1e30"])
def test_generate_on_a_broken_bundle_exits_1_with_json(built, tmp_path, edit, needle):
    root = tampered(built.bundle, tmp_path / "b", edit)
    res = _generate(str(root), "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--json")
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr and needle in strict_json(res.stdout)["error"]["message"]


@pytest.mark.slow
def test_verify_json_and_dp_prompt_error(built, tmp_path):
    root = tampered(built.bundle, tmp_path / "b", _extra_so)
    res = cli("verify", root, "--json")
    doc = strict_json(res.stdout)
    assert res.returncode == 1 and not doc["ok"] and doc["problems"][0]["path"] == "artifacts/evil.so"
    res = _generate(str(built.bundle), "--dp", "2", "--prompt-ids", "1,2", "--prompt-ids", "1,999", "--json")
    assert res.returncode == 2 and "outside the vocabulary" in strict_json(res.stdout)["error"]["message"]
    assert "Traceback" not in res.stderr

@pytest.mark.slow
def test_sparse_12gb_digest_is_an_error_not_a_memory_error(built, tmp_path):

    root = tmp_path / "b"
    shutil.copytree(built.bundle, root)
    os.truncate(root / paths.MANIFEST_DIGEST_PATH, 12 * 10**9)  # sparse: no disk used
    with pytest.raises(BundleError, match="missing or unreadable"):
        open_bundle(root)
    assert "missing or unreadable" in str(check(root)[0])


def _draft_heads(root, m):
    m["graph_inputs"]["kv_layout"]["draft"]["buffer_shape"][2] += 1


@pytest.mark.slow
@pytest.mark.parametrize("edit,needle", [
    (_draft_heads, "kv_layout.draft: got"),
    (gi(lambda g: g["kv_layout"].pop("draft")), "missing with num_speculative_tokens"),
], ids=["draft-layout-heads", "+ draft-layout-removed"])
def test_tampered_draft_layout_is_refused(eagle3_built, tmp_path, edit, needle):
    root = tampered(eagle3_built.bundle, tmp_path / "b", edit)
    with pytest.raises(BundleError, match=needle):
        open_bundle(root)
    assert any(needle.split(":")[0] in str(p) for p in check(root))


def _recipe_yaml_edited(root, m):
    p = root / paths.RECIPE_PATH
    p.write_text(p.read_text().replace("max_model_len: 512", "max_model_len: 1024"))
    return [paths.RECIPE_PATH]


@pytest.mark.slow
@pytest.mark.parametrize("edit,needle", [
    (gi(lambda g: g["model_config"].update(rms_norm_eps=0.5)), "graph_inputs.model_config"),
    (gi(lambda g: g["model_config"]["rope_parameters"].update(rope_theta=10.0)), "graph_inputs.model_config"),
    (_recipe_yaml_edited, "does not hash to the manifest's recipe_sha256"),
], ids=["model-config-edited", "+ rope-theta-edited", "+ recipe-yaml-edited"])
def test_verify_cross_checks_model_config_with_recipe_yaml(built, tmp_path, edit, needle):
    root = tampered(built.bundle, tmp_path / "b", edit)
    code, out, err, unhandled = run_cli("verify", str(root), "--json")
    assert unhandled is None and code == 1 and needle in out, (out, err)
    code, out, err, unhandled = run_cli("generate", str(root), "--prompt-ids", "1,2", "--check", "--json")
    assert unhandled is None and code == 1 and needle in out, (out, err)


def _flip_weight_byte(root, m):
    p = root / m["weights"]["file"]
    raw = bytearray(p.read_bytes())
    raw[-1] ^= 0xFF  # same size: the size-only open accepts it
    p.write_bytes(bytes(raw))


@pytest.mark.slow
def test_generate_check_verifies_every_sha256(built, tmp_path):
    root = tampered(built.bundle, tmp_path / "b", _flip_weight_byte)
    assert open_bundle(root) is not None  # the default open checks sizes only (documented)
    code, out, err, unhandled = run_cli("generate", str(root), "--prompt-ids", "1,2", "--check", "--json")
    assert unhandled is None and code == 1 and "sha256 mismatch" in strict_json(out)["error"]["message"], err
