"""Hostile and broken input (issue 16): each case ends in a clean error (or correct output), never a crash.

Tables per category: recipe files (what the loader refuses before validation), CLI arguments, the
compile cache, and tampered bundles. A tampered bundle is "consistent": its file checksums and
manifest digest are rewritten, as an attacker or a buggy tool would, so the schema, the weights
header checks and the artifact signature checks are what must catch it.
"""

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from neffbuild.bundle import manifest, paths
from neffbuild.cli.generate_cmd import _parse_prompt
from neffbuild.cli.main import _register, cli
from neffbuild.errors import BundleError, InvalidInput
from neffbuild.fsutil import sha256_file
from neffbuild.runtime import aoti_package
from neffbuild.runtime.bundle import check, open_bundle
from tests.conftest import POOL, ROOT, TINY


def strict_json(text: str):
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def run_cli(*args):
    """In-process CLI: (exit code, stdout, stderr, unhandled exception or None)."""
    _register()
    res = CliRunner().invoke(cli, list(args), catch_exceptions=True)
    unhandled = res.exception if res.exception and not isinstance(res.exception, SystemExit) else None
    return res.exit_code, res.stdout, res.stderr, unhandled


# -- recipe files: refused before validation, one JSON document with --json, exit 2

def _deep(p):
    p.write_text("a: " + "[" * 500 + "]" * 500 + "\n")


def _bomb(p):
    rows = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    rows += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 8)]
    p.write_text("\n".join(rows) + "\n")


def _fifo(p):
    import os

    os.mkfifo(p)


RECIPE_FILES = [
    ("syntax", lambda p: p.write_text("a: [1\n"), "line 2, column 1"),
    ("duplicate-key", lambda p: p.write_text("name: a\nname: b\n"), "duplicate key 'name'"),
    ("not-utf8", lambda p: p.write_bytes(b"name: \xff\xfe\n"), "not UTF-8"),
    ("float-tag", lambda p: p.write_text("name: !!float abc\n"), "could not convert"),
    ("complex-key", lambda p: p.write_text("? [a, b]\n: 1\n"), "plain scalars"),
    ("500-deep", _deep, "nested deeper than 32"),
    ("self-alias", lambda p: p.write_text("a: &x [1, *x]\n"), "refers to its own enclosing node"),
    ("alias-bomb", _bomb, "expands to more than"),
    ("fifo", _fifo, "not a regular file"),
    ("folder", lambda p: p.mkdir(), "is a directory"),
    ("too-big", lambda p: p.write_text("#" * (2 << 20)), "the limit is"),
    ("not-a-mapping", lambda p: p.write_text("x" * 5000), "a recipe must be a YAML mapping"),
    ("missing", lambda p: None, "recipe file not found"),
]


@pytest.mark.parametrize("make,needle", [c[1:] for c in RECIPE_FILES], ids=[c[0] for c in RECIPE_FILES])
@pytest.mark.parametrize("command", ["validate", "plan"])
def test_bad_recipe_file_is_one_json_error(tmp_path, command, make, needle):
    p = tmp_path / "r.yaml"
    make(p)
    code, out, err, unhandled = run_cli(command, str(p), "--json", *(["--no-cache"] if command == "plan" else []))
    assert unhandled is None and code == 2, (code, err)
    doc = strict_json(out)
    assert doc["ok"] is False and needle in out, doc
    assert len(out) < 2000, "the error must not echo the file back"


def test_dev_null_and_config_fifo_are_refused_before_reading(tmp_path):
    import os

    import yaml

    code, out, _, _ = run_cli("validate", "/dev/null", "--json")
    assert code == 2 and "not a regular file" in out
    os.mkfifo(tmp_path / "fifo")
    raw = yaml.safe_load(TINY.read_text())
    raw["model"]["config"] = str(tmp_path / "fifo")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw))
    code, out, _, _ = run_cli("validate", str(tmp_path / "r.yaml"), "--json")
    assert code == 2 and strict_json(out)["errors"][0]["path"] == "model.config" and "not a regular file" in out


def test_merge_keys_work(tmp_path):
    text = TINY.read_text().replace("serving:\n  max_model_len: 512",
                                    "x-defaults: &d\n  max_model_len: 512\nserving:\n  <<: *d")
    assert "<<: *d" in text
    (tmp_path / "r.yaml").write_text(text)
    code, out, err, _ = run_cli("validate", str(tmp_path / "r.yaml"), "--json")
    assert code == 0 and strict_json(out)["valid"], err


def test_nan_values_print_standard_json(tmp_path):
    text = TINY.read_text().replace("max_model_len: 512", "max_model_len: .nan").replace("block_size: 16",
                                                                                       "block_size: .inf")
    (tmp_path / "r.yaml").write_text(text)
    code, out, _, _ = run_cli("validate", str(tmp_path / "r.yaml"), "--json")
    assert code == 2
    values = {e["path"]: e["value"] for e in strict_json(out)["errors"]}
    assert values["serving.max_model_len"] == "nan" and values["serving.block_size"] == "inf"


# -- arguments

@pytest.mark.parametrize("text", ["1 2 3", "1,,2", "", " ", "1,x", "-1", "1.0", "1,٢", "0x10", "1;2", "9" * 11])
def test_prompt_ids_accept_only_comma_separated_ascii_integers(text):
    with pytest.raises(InvalidInput, match="comma-separated token ids"):
        _parse_prompt(text)


def test_prompt_ids_parse():
    assert _parse_prompt("1,2, 3 ,40") == [1, 2, 3, 40]


def test_compile_out_under_a_file_is_a_clean_usage_error(tmp_path):
    (tmp_path / "afile").write_text("x")
    code, out, err, unhandled = run_cli("compile", str(TINY), "-o", str(tmp_path / "afile" / "out"), "--json")
    assert unhandled is None and code == 2 and "--out" in strict_json(out)["error"]["message"], err


def test_unknown_option_with_json_is_one_json_error():
    code, out, _, _ = run_cli("validate", str(TINY), "--json", "--bogus")
    assert code == 2 and strict_json(out)["error"]["kind"] == "NoSuchOption"


# -- the compile cache

def test_cache_ls_reads_without_side_effects(tmp_path):
    from neffbuild.compiler.cache import CACHE_VERSION

    entries = tmp_path / f"v{CACHE_VERSION}" / "entries"
    for name, meta in (("deep", "[" * 100_000 + "]" * 100_000), ("typo", '{"file": 3, "bytes": "x"}'),
                       ("junk", "\xff")):
        (entries / name).mkdir(parents=True)
        (entries / name / "meta.json").write_text(meta)
    code, out, err, unhandled = run_cli("cache", "ls", "--json", "--cache-dir", str(tmp_path))
    assert unhandled is None and code == 0 and strict_json(out) == [], err
    assert sorted(p.name for p in entries.iterdir()) == ["deep", "junk", "typo"]  # nothing deleted


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
    from neffbuild.runtime import weights_file

    p = tmp_path / "w.safetensors"
    write_safetensors(p, header, bytes(nbytes), length)
    with pytest.raises(BundleError, match=needle):
        weights_file.load(p)


def test_weights_short_and_deep_files(tmp_path):
    from neffbuild.runtime import weights_file

    p = tmp_path / "w.safetensors"
    p.write_bytes(b"abc")
    with pytest.raises(BundleError, match="too short"):
        weights_file.load(p)
    deep = b"[" * 50_000 + b"]" * 50_000
    p.write_bytes(struct.pack("<Q", len(deep)) + deep)
    with pytest.raises(BundleError, match="not valid JSON"):
        weights_file.load(p)


def test_weights_share_one_private_mapping(tmp_path):
    import torch
    from safetensors.torch import save_file

    from neffbuild.runtime import weights_file

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

def tampered(src: Path, dest: Path, edit) -> Path:
    shutil.copytree(src, dest)
    m = json.loads((dest / paths.MANIFEST_PATH).read_text())
    out = edit(dest, m)
    if isinstance(out, str):
        text = out
    else:
        for rel in out or []:
            p = dest / rel
            m["files"][rel] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
            for a in m["artifacts"]:
                if a["file"] == rel:
                    a.update(m["files"][rel])
        text = manifest.dumps(m)
    (dest / paths.MANIFEST_PATH).write_text(text)
    digest = __import__("hashlib").sha256(text.encode()).hexdigest()
    (dest / paths.MANIFEST_DIGEST_PATH).write_text(f"{digest}  {paths.MANIFEST_PATH}\n")
    return dest


def gi(fn):
    def edit(root, m):
        fn(m["graph_inputs"])

    return edit


def kv_sigs(m, fn):
    for a in m["artifacts"]:
        for s in a["input_signature"]:
            if s["name"].startswith("kv_caches"):
                fn(s)


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
    ("weights-missing-tensor", _rewrite_header(lambda h: h.pop("norm")), "open", "missing from the file"),
    ("weights-huge-header", _weights(lambda rel, root: (root / rel).write_bytes(struct.pack("<Q", 2**63) + b"{}")),
     "open", "header length"),
    ("weights-3-bytes", _weights(lambda rel, root: (root / rel).write_bytes(b"abc")), "open", "too short"),
    ("weights-table-lie", lambda r, m: m["weights"]["tensors"]["embed"].update(shape=[2, 64]), "open",
     "weights.tensors.embed"),
    ("garbage-artifact", _garbage_artifact, "load", "not a readable AOTInductor package"),
]


@pytest.mark.slow
@pytest.mark.parametrize("edit,stage,needle", [c[1:] for c in BUNDLES], ids=[c[0] for c in BUNDLES])
def test_tampered_bundle_is_refused(built, tmp_path, edit, stage, needle):
    root = tampered(built[1].bundle, tmp_path / "b", edit)
    with pytest.raises(BundleError, match=needle):
        b = open_bundle(root)
        assert stage == "load", "expected open_bundle to refuse it"
        for label in b.labels:  # the fallback artifact is checked at open; the others before their first call
            b.artifact(label)
    assert check(root), "verify must report it too"


@pytest.mark.slow
def test_manifest_edit_without_digest_is_caught(built, tmp_path):
    root = tmp_path / "b"
    shutil.copytree(built[1].bundle, root)
    text = (root / paths.MANIFEST_PATH).read_text().replace('"max_model_len": 512', '"max_model_len": 1024')
    (root / paths.MANIFEST_PATH).write_text(text)
    with pytest.raises(BundleError, match=r"manifest\.sha256"):
        open_bundle(root)


def _generate(*args):
    return subprocess.run([sys.executable, "-m", "neffbuild.cli.main", "generate", *args], capture_output=True,
                          check=False,
                          text=True, cwd=ROOT, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("edit,needle", [
    (_kv_lie, "the artifact takes"),
    (_fp8_lie, "the artifact takes"),
    (gi(lambda g: g["model_config"].update(vocab_size=2)), "model_config implies weight 'embed'"),
    (gi(lambda g: g["model_config"].update(num_hidden_layers=10**30)), "num_hidden_layers"),
], ids=["kv-lie", "fp8-lie", "vocab-2", "layers-1e30"])
def test_generate_on_a_broken_bundle_exits_1_with_json(built, tmp_path, edit, needle):
    root = tampered(built[1].bundle, tmp_path / "b", edit)
    res = _generate(str(root), "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--json")
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr and needle in strict_json(res.stdout)["error"]["message"]


@pytest.mark.slow
def test_verify_json_and_dp_prompt_error(built, tmp_path):
    root = tampered(built[1].bundle, tmp_path / "b", _extra_so)
    res = subprocess.run([sys.executable, "-m", "neffbuild.cli.main", "verify", str(root), "--json"],
                         capture_output=True, text=True, cwd=ROOT, check=False)
    doc = strict_json(res.stdout)
    assert res.returncode == 1 and not doc["ok"] and doc["problems"][0]["path"] == "artifacts/evil.so"
    res = _generate(str(built[1].bundle), "--dp", "2", "--prompt-ids", "1,2", "--prompt-ids", "1,999", "--json")
    assert res.returncode == 2 and "outside the vocabulary" in strict_json(res.stdout)["error"]["message"]
    assert "Traceback" not in res.stderr
