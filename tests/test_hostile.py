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

from neffbuild.bundle import manifest, paths
from neffbuild.cli.generate_cmd import _parse_prompt
from neffbuild.errors import BundleError, InvalidInput
from neffbuild.fsutil import sha256_file
from neffbuild.runtime.bundle import aoti_package
from neffbuild.runtime.bundle.reader import check, open_bundle
from tests.conftest import POOL, ROOT, TINY
from tests.helpers import cli


def strict_json(text: str):
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def run_cli(*args):
    """In-process CLI (tests/helpers.py): (exit code, stdout, stderr, unhandled exception or None)."""
    res = cli(*args)
    return res.returncode, res.stdout, res.stderr, res.unhandled


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
    import torch
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
    ("weights-missing-tensor", _rewrite_header(lambda h: h.pop("norm")), "open", "missing from the file|a gap of"),
    ("weights-huge-header", _weights(lambda rel, root: (root / rel).write_bytes(struct.pack("<Q", 2**63) + b"{}")),
     "open", "header length"),
    ("weights-3-bytes", _weights(lambda rel, root: (root / rel).write_bytes(b"abc")), "open", "too short"),
    ("weights-table-lie", lambda r, m: m["weights"]["tensors"]["embed"].update(shape=[2, 64]), "open",
     "weights.tensors.embed"),
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
    return cli("generate", *args, process=True, timeout=300)  # a tampered bundle: its own process, whatever happens


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
    res = cli("verify", root, "--json")
    doc = strict_json(res.stdout)
    assert res.returncode == 1 and not doc["ok"] and doc["problems"][0]["path"] == "artifacts/evil.so"
    res = _generate(str(built[1].bundle), "--dp", "2", "--prompt-ids", "1,2", "--prompt-ids", "1,999", "--json")
    assert res.returncode == 2 and "outside the vocabulary" in strict_json(res.stdout)["error"]["message"]
    assert "Traceback" not in res.stderr


# -- the runtime library (issue 25): every step input native code touches is checked first ----------
# Each case runs on the compiled tiny bundle in this process: before the checks, the out-of-pool
# cases aborted it (SIGABRT inside the artifact's OpenMP region); a signal here fails the suite.

import torch  # noqa: E402

from neffbuild.errors import StepInputError  # noqa: E402
from neffbuild.runtime import StepBatch, Stepper  # noqa: E402
from neffbuild.runtime.kv.blocks import BlockManager, KVGroup  # noqa: E402

VOCAB = 256  # recipes/gpt-oss-tiny.yaml


def _good():
    """Two requests at positions 20 and 40 (block 16): full blocks 1..4 / 5..8, sliding 9..12 / 13..16."""
    full = torch.arange(1, 9).reshape(2, 4)
    return [[5], [7]], [20, 40], {"full": full, "sliding": full + 8}


def _set(group, r, c, value):
    def edit(toks, comp, tables):
        tables[group] = tables[group].clone()
        tables[group][r, c] = value
        return toks, comp, tables
    return edit


def _tokens(row, value):
    def edit(toks, comp, tables):
        toks[row] = [value]
        return toks, comp, tables
    return edit


def _computed(row, value):
    def edit(toks, comp, tables):
        comp[row] = value
        return toks, comp, tables
    return edit


def _table(group, fn):
    def edit(toks, comp, tables):
        tables[group] = fn(tables.get(group))
        return toks, comp, tables
    return edit


STEP_CASES = [  # (id, edit, needle); "+" marks cases the fuzz run did not try
    ("read-column-outside-pool", _set("full", 0, 0, POOL), f"block id {POOL}; block ids must be in [0, {POOL})"),
    ("written-column-outside-pool", _set("full", 1, 2, 10**6), "block id 1000000"),
    ("negative-block-id", _set("full", 0, 1, -1), "block id -1"),
    ("null-block-for-live-position", _set("full", 0, 1, 0), "request 0 has the null block (0) in column 1"),
    ("table-narrower-than-position", _table("full", lambda t: t[:, :2]), "needs 3 columns"),
    ("token-minus-one", _tokens(0, -1), "holds -1; token ids must be integers in [0, 256)"),
    ("token-at-vocab", _tokens(1, VOCAB), "holds 256; token ids"),
    ("num-computed-float", _computed(0, 3.9), "num_computed[0] is 3.9"),
    ("num-computed-string", _computed(1, "3"), "num_computed[1] is '3'"),
    ("table-as-list", _table("full", lambda t: t.tolist()), "must be a torch.Tensor"),
    ("table-on-another-device", _table("full", lambda t: t.to("meta")), "must be on the CPU"),
    ("+ sliding-written-column-null", _set("sliding", 1, 2, 0), "request 1 has the null block (0) in column 2"),
    ("+ sliding-read-column-outside-pool", _set("sliding", 0, 0, POOL + 3), f"block id {POOL + 3}"),
    ("+ token-bool", _tokens(0, True), "holds True"),
    ("+ token-float", _tokens(0, 5.0), "holds 5.0"),
    ("+ table-float", _table("full", lambda t: t.float()), "must hold integer block ids"),
    ("+ table-1d", _table("full", lambda t: t[0]), "must be [R=2, W>=1]"),
    ("+ unknown-group", _table("draft", lambda t: torch.ones(2, 4, dtype=torch.long)), "unknown KV group 'draft'"),
    ("+ no-full-group", lambda toks, comp, tables: (toks, comp, {"sliding": tables["sliding"]}), "lacks the 'full'"),
    ("+ num-computed-negative", _computed(0, -4), "num_computed[0] is -4"),
]


@pytest.fixture(scope="module")
def tiny_stepper(built):
    step = Stepper(open_bundle(built[1].bundle))
    assert step.step(StepBatch(*_good())).logits.shape == (2, 1, VOCAB)
    return step


@pytest.mark.parametrize("edit,needle", [c[1:] for c in STEP_CASES], ids=[c[0] for c in STEP_CASES])
def test_malformed_step_is_a_step_input_error_before_native_code(tiny_stepper, edit, needle):
    toks, comp, tables = edit(*_good())
    before = [t.clone() for t in tiny_stepper.kv_caches]
    with pytest.raises(StepInputError) as err:
        tiny_stepper.step(StepBatch(toks, comp, tables))
    assert needle in str(err.value)
    assert all(torch.equal(a, b) for a, b in zip(before, tiny_stepper.kv_caches, strict=True))  # KV untouched


def test_integral_step_inputs_of_other_types_run(tiny_stepper):
    import numpy as np

    toks, comp, tables = _good()
    want = tiny_stepper.step(StepBatch(toks, comp, tables)).logits
    got = tiny_stepper.step(StepBatch([[np.int64(5)], [torch.tensor(7)]], [np.int32(20), torch.tensor(40)],
                                      {k: v.int() for k, v in tables.items()})).logits
    torch.testing.assert_close(got, want)


def _kv(kv):
    return [b.clone() for b in kv]


TEST_KV_BUFFERS = 1  # the session bundles' 2-layer model: layers 0 and 1 share buffer 0
KV_CASES = [  # (id, engine buffers from the right ones, needle)
    ("one-block-instead-of-pool", lambda kv: [b[:, :1].clone() for b in kv], "the bundle's KV layout is"),
    ("fewer-blocks", lambda kv: [b[:, : POOL - 9].clone() for b in kv], "the bundle's KV layout is"),
    ("float16", lambda kv: [b.half() for b in kv], "dtype torch.float16"),
    ("int8", lambda kv: [b.to(torch.int8) for b in kv], "dtype torch.int8"),
    ("transposed", lambda kv: [b.transpose(3, 4) for b in kv], "not contiguous"),  # block 16 = head_dim 16
    ("non-contiguous", lambda kv: [torch.zeros(*b.shape[:-1], 2 * b.shape[-1])[..., ::2] for b in kv],
     "not contiguous"),
    ("meta", lambda kv: [b.to("meta") for b in kv], "meta tensor"),
    ("a-buffer-short", lambda kv: kv[:-1], f"{TEST_KV_BUFFERS - 1} buffers given"),
    ("a-buffer-extra", lambda kv: kv + kv[:1], f"{TEST_KV_BUFFERS + 1} buffers given"),
    ("+ a-tensor-not-a-list", lambda kv: kv[0], "must be a list"),
    ("+ a-list-of-lists", lambda kv: [[0.0]] * len(kv), "must be a torch.Tensor"),
]


@pytest.mark.parametrize("make,needle", [c[1:] for c in KV_CASES], ids=[c[0] for c in KV_CASES])
def test_engine_kv_buffers_are_checked_at_construction(built, make, needle):
    bundle = open_bundle(built[1].bundle)
    good = Stepper(bundle).kv_caches
    assert len(good) == TEST_KV_BUFFERS
    with pytest.raises(StepInputError, match="kv_caches") as err:
        Stepper(bundle, kv_caches=make(good))
    assert needle in str(err.value)
    assert Stepper(bundle, kv_caches=good).kv_caches[0] is good[0]  # the engine's own buffers, used in place


def test_fp8_bundle_refuses_float32_kv_buffers(fp8_built):
    bundle = open_bundle(fp8_built[1].bundle)
    with pytest.raises(StepInputError, match="float8_e4m3fn"):
        Stepper(bundle, kv_caches=[torch.zeros(bundle.kv_layout.buffer_shape)] * bundle.kv_layout.num_buffers)


@pytest.mark.parametrize("args,needle", [
    ((64, 0, [KVGroup("full")]), "block_size must be an integer >= 1"),
    ((1, 16, [KVGroup("full")]), "num_blocks must be an integer >= 2"),  # +
    ((64, 16.0, [KVGroup("full")]), "block_size"),  # +
    ((64, 16, []), "groups must be KVGroups"),  # +
    ((64, 16, [KVGroup("sliding", 0)]), "window None or >= 1"),  # +
], ids=["block-size-0", "+ one-block", "+ float-block-size", "+ no-groups", "+ window-0"])
def test_block_manager_refuses_bad_sizes(args, needle):
    with pytest.raises(InvalidInput, match=needle):
        BlockManager(*args)


# -- EAGLE3 draft calls: the same rules; the aux width comes from the bundle, never the caller

def _draft_rows(bundle):
    A = bundle.aux_hidden_size
    return [([3, 4], torch.zeros(2, A), 30), ([9], torch.zeros(1, A), 50)], torch.arange(1, 11).reshape(2, 5), 51


DRAFT_CASES = [
    ("block-id-outside-pool", lambda rows, t, m: (rows, t.index_fill(1, torch.tensor([0]), POOL), m), "block id"),
    ("token-minus-one", lambda rows, t, m: ([([-1, 4], rows[0][1], 30), rows[1]], t, m), "holds -1"),
    ("position-beyond-max-model-len", lambda rows, t, m: ([([3], rows[0][1][:1], 600)], t[:1], 601),
     "max_model_len is 256"),
    ("row-count-mismatch", lambda rows, t, m: (rows, t[:1], m), "must be [R=2, W>=1]"),
    ("aux-rows-mismatch", lambda rows, t, m: ([([3, 4], rows[1][1], 30), rows[1]], t, m), "aux is [1, "),
    ("aux-width-from-caller", lambda rows, t, m: ([([3, 4], torch.zeros(2, 7), 30), rows[1]], t, m), "aux is [2, 7]"),
    ("+ first-position-float", lambda rows, t, m: ([([3, 4], rows[0][1], 30.5), rows[1]], t, m), "30.5"),
    ("+ beyond-max-computed", lambda rows, t, m: (rows, t, 40), "beyond max_computed 40"),
    ("+ aux-float64", lambda rows, t, m: ([([3, 4], rows[0][1].double(), 30), rows[1]], t, m), "float32"),
    ("+ null-block-for-live-position", lambda rows, t, m: (rows, t.index_fill(1, torch.tensor([1]), 0), m),
     "null block (0) in column 1"),
]


@pytest.fixture(scope="module")
def eagle3_stepper(eagle3_built):
    step = Stepper(open_bundle(eagle3_built[1].bundle))
    rows, table, mc = _draft_rows(step.artifacts)
    _, drafts = step.draft(rows, table, max_computed=mc)
    assert drafts.shape == (2, step.grid.num_speculative_tokens)
    return step


@pytest.mark.parametrize("edit,needle", [c[1:] for c in DRAFT_CASES], ids=[c[0] for c in DRAFT_CASES])
def test_malformed_draft_call_is_a_step_input_error(eagle3_stepper, edit, needle):
    rows, table, mc = edit(*_draft_rows(eagle3_stepper.artifacts))
    before = eagle3_stepper.draft_cache.clone()
    with pytest.raises(StepInputError) as err:
        eagle3_stepper.draft(rows, table, max_computed=mc)
    assert needle in str(err.value)
    assert torch.equal(before, eagle3_stepper.draft_cache)


# -- DP: one rank's out-of-pool block id; both ranks raise on the same step (one collective each)

def _dp_out_of_pool_rank(rank, world):
    import torch.distributed as dist

    from neffbuild import recipe as R
    from neffbuild.models.gpt_oss.weights import model_weights
    from neffbuild.runtime.kv.cache import KVLayout
    from neffbuild.runtime.step import dp_sync
    from neffbuild.runtime.step.dispatch import Grid
    from neffbuild.serve.rank import eager_artifacts

    cfg = R.load(TINY).model.config
    layout = KVLayout(cfg.num_kv_buffers, 40, cfg.num_key_value_heads, 16, cfg.head_dim)
    step = Stepper(eager_artifacts(cfg, model_weights(cfg, None, 0), Grid((1, 2), (128,), 256), layout, 8),
                   group=dist.group.WORLD)
    before = dp_sync.COLLECTIVES["count"]
    for i in range(4):
        table = torch.arange(1, 17)[None].clone()
        if rank == 1 and i == 2:
            table[0, 0] = 40  # the pool is 40 blocks: id 40 is outside it
        try:
            step.step(StepBatch([[3]], [10 + i], {"full": table}))
        except StepInputError as exc:
            return {"step": i, "message": str(exc), "collectives": dp_sync.COLLECTIVES["count"] - before}
    return {"step": None}


def test_dp2_out_of_pool_block_raises_on_both_ranks_same_step():
    from tests.dist_util import run_ranks

    r0, r1 = run_ranks(_dp_out_of_pool_rank, 2)
    assert r0["step"] == r1["step"] == 2 and r0["collectives"] == r1["collectives"] == 3
    assert "block id 40; block ids must be in [0, 40)" in r1["message"]
    assert "another DP rank" in r0["message"]


# -- recipes are data; validate is the gate (issue 25) ------------------------------------------------

EAGLE3_RAW = __import__("yaml").safe_load((ROOT / "recipes" / "gpt-oss-tiny-eagle3.yaml").read_text())
TINY_RAW = __import__("yaml").safe_load(TINY.read_text())


def _patched(base, *edits):
    import copy

    raw = copy.deepcopy(base)
    for path, value in edits:
        node = raw
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return raw


def _garbage_checkpoint(tmp_path):
    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"\x10" + bytes(7) + b"this is not a header")
    return str(folder)


GATE_CASES = [  # (id, recipe from tmp_path, field path in the JSON errors, needle); "+": not in the fuzz run
    ("cxx-names-a-program", lambda t: _patched(TINY_RAW, (("compiler", "flags"), ['cpp.cxx=[null, "/bin/sh"]'])),
     "compiler.flags[0]", "not an allowed inductor option"),
    ("no-such-option", lambda t: _patched(TINY_RAW, (("compiler", "flags"), ["no_such_option=1"])),
     "compiler.flags[0]", "not an allowed inductor option"),
    ("+ target-flag-names-a-program", lambda t: _patched(
        TINY_RAW, (("compiler", "target_flags"), {"decode_b1_ctx128": ['cpp.cxx=["/bin/sh"]']})),
     "compiler.target_flags.decode_b1_ctx128[0]", "not an allowed"),
    ("+ reserved-option", lambda t: _patched(
        TINY_RAW, (("compiler", "flags"), ["aot_inductor.package_constants_in_so=true"])),
     "compiler.flags[0]", "set by neffbuild itself"),
    ("+ wrong-value-type", lambda t: _patched(TINY_RAW, (("compiler", "flags"), ["max_autotune=yes"])),
     "compiler.flags[0]", "must be true or false"),
    ("+ neuron-flag-with-a-path", lambda t: _patched(
        TINY_RAW, (("compiler", "backend"), "neuron"), (("compiler", "flags"), ["--logfile=/etc/passwd"])),
     "compiler.flags[0]", "no paths"),
    ("packed-k-odd-block-size", lambda t: _patched(
        TINY_RAW, (("neuron_config", "fp8_packed_kv"), True), (("serving", "block_size"), 15)),
     "serving.block_size", "must be even with neuron_config.fp8_packed_kv"),
    ("odd-head-dim", lambda t: _patched(TINY_RAW, (("model", "config", "head_dim"), 15)),
     "model.config.head_dim", "must be even"),
    ("odd-draft-head-dim", lambda t: _patched(EAGLE3_RAW, (("speculative", "draft", "config"), {"head_dim": 15})),
     "speculative.draft.config.head_dim", "must be even"),
    ("string-eagle-config", lambda t: _patched(
        EAGLE3_RAW, (("speculative", "draft", "config"), {"eagle_config": "x"})),
     "speculative.draft.config.eagle_config", "must be a mapping"),
    ("+ aux-layer-ids-strings", lambda t: _patched(EAGLE3_RAW, (
        ("speculative", "draft", "config"), {"eagle_config": {"eagle_aux_hidden_state_layer_ids": ["a", "b", "c"]}})),
     "speculative.draft.config.eagle_config.eagle_aux_hidden_state_layer_ids", "list of layer indices"),
    ("garbage-draft-checkpoint", lambda t: _patched(EAGLE3_RAW, (("speculative", "draft"), {
        "checkpoint": _garbage_checkpoint(t)})), "speculative.draft.checkpoint", "unreadable safetensors"),
    ("+ garbage-target-checkpoint", lambda t: _patched(TINY_RAW, (("model",), {
        "arch": "gpt_oss", "checkpoint": _garbage_checkpoint(t), "config": TINY_RAW["model"]["config"]})),
     "model.checkpoint", "unreadable safetensors"),
    ("grid-without-bound", lambda t: _patched(
        TINY_RAW, (("serving", "max_num_seqs"), 1024), (("neuron_config", "num_seqs_buckets"), list(range(1, 1025))),
        (("serving", "max_model_len"), 2048), (("neuron_config", "decode_context_length_buckets"),
                                               list(range(128, 2048, 128)))),
     "neuron_config", "the limit is 4096"),
    ("+ grid-bound-counts-families", lambda t: _patched(
        EAGLE3_RAW, (("serving", "max_num_seqs"), 1024), (("neuron_config", "num_seqs_buckets"), list(range(1, 1025)))),
     "neuron_config", "x 3 families"),
]


@pytest.mark.parametrize("make,path,needle", [c[1:] for c in GATE_CASES], ids=[c[0] for c in GATE_CASES])
def test_validate_gates_what_plan_and_compile_would_trip_on(tmp_path, make, path, needle):
    import yaml

    raw = make(tmp_path)
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw))
    code, out, err, unhandled = run_cli("validate", str(tmp_path / "r.yaml"), "--json")
    assert unhandled is None and code == 2, (code, out, err)
    errors = {e["path"]: e["message"] for e in strict_json(out)["errors"]}
    assert path in errors and needle in errors[path], errors


def test_inductor_backend_refuses_flags_outside_the_allow_list_itself():
    from neffbuild.compiler.backends.inductor import parse_flags

    assert parse_flags(["max_autotune=false", "cpp.threads=2"]) == {"max_autotune": False, "cpp.threads": 2}
    for flag in ('cpp.cxx=[null, "/bin/sh"]', "no_such_option=1", "aot_inductor.package_constants_in_so=true"):
        with pytest.raises(InvalidInput, match=r"compiler\.flags"):
            parse_flags([flag])


@pytest.mark.parametrize("line", ["num_blocks: 4:16", "num_blocks: 0400", "num_blocks: 1:0:0", "max_num_seqs: -010"],
                         ids=["sexagesimal", "octal", "+ sexagesimal-3-parts", "+ negative-octal"])
def test_yaml_11_integers_are_refused_not_reread(tmp_path, line):
    key = line.split(":")[0]
    text = TINY.read_text()
    want = next(row for row in text.splitlines() if row.strip().startswith(key + ":"))
    (tmp_path / "r.yaml").write_text(text.replace(want, "  " + line))
    code, out, _, unhandled = run_cli("validate", str(tmp_path / "r.yaml"), "--json")
    assert unhandled is None and code == 2 and "YAML 1.1 sexagesimal or octal integer" in out


def test_plan_of_a_huge_pool_never_allocates_it(tmp_path):
    """num_blocks 2**24 (a 64 GiB pool for this model): plan traces on fake inputs, in well under 1 GiB."""
    import resource

    import yaml

    raw = _patched(TINY_RAW, (("serving", "num_blocks"), 2**24), (("serving", "max_num_seqs"), 1),
                   (("neuron_config", "num_seqs_buckets"), [1]))
    raw["neuron_config"].pop("decode_context_length_buckets")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw))
    res = subprocess.run([sys.executable, "-m", "neffbuild.cli.main", "plan", str(tmp_path / "r.yaml"), "--json"],
                         capture_output=True, text=True, cwd=ROOT, check=False, timeout=300,
                         env=dict(__import__("os").environ, NEFFBUILD_CACHE_DIR=str(tmp_path / "cache")))
    assert res.returncode == 0, res.stderr
    assert [t["label"] for t in strict_json(res.stdout)["targets"]] == ["decode_b1_ctx512"]
    assert resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss < 2 << 20  # KiB: under 2 GiB


# -- write only what you own ----------------------------------------------------------------------------

def _special_outputs(tmp_path, bundle):
    import os

    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "target").write_text("keep me")
    (tmp_path / "link").symlink_to(tmp_path / "target")
    (tmp_path / "folder").mkdir()
    return {"dev-null": ("/dev/null", "a device"), "fifo": (str(tmp_path / "fifo"), "a FIFO"),
            "symlink": (str(tmp_path / "link"), "a symbolic link"),
            "missing-parent": (str(tmp_path / "no" / "such" / "h.csv"), "does not exist"),
            "into-a-bundle": (str(Path(bundle) / "weights" / "h.csv"), "inside the bundle"),
            "+ folder": (str(tmp_path / "folder"), "is a directory"),  # click refuses it first, exit 2
            "+ bundle-root": (str(Path(bundle) / "h.csv"), "inside the bundle")}


OUTPUT_CASES = ["dev-null", "fifo", "symlink", "missing-parent", "into-a-bundle", "+ folder", "+ bundle-root"]


@pytest.mark.parametrize("case", OUTPUT_CASES)
@pytest.mark.parametrize("command", ["generate", "bench"])
def test_output_paths_that_are_not_ours_are_refused_before_any_work(built, tmp_path, command, case):
    import os

    bundle = built[1].bundle
    path, needle = _special_outputs(tmp_path, bundle)[case]
    before = sorted(os.listdir(bundle)), sorted(os.listdir(Path(bundle) / "weights"))
    args = (["generate", str(bundle), "--prompt-ids", "1,2", "--histogram", path] if command == "generate"
            else ["bench", str(bundle), "--plot", path])
    code, out, err, unhandled = run_cli(*args, "--json")
    assert unhandled is None and code == 2 and needle in strict_json(out)["error"]["message"], (out, err)
    assert (sorted(os.listdir(bundle)), sorted(os.listdir(Path(bundle) / "weights"))) == before
    assert Path("/dev/null").is_char_device() and (tmp_path / "target").read_text() == "keep me"
    assert (tmp_path / "link").is_symlink() and Path(tmp_path / "fifo").is_fifo()


def test_output_file_is_written_in_place_or_created(tmp_path):
    import os

    from neffbuild.fsutil import write_output

    p = tmp_path / "h.csv"
    p.write_text("old, longer than the new text")
    inode = os.stat(p).st_ino
    write_output(p, "new", "--histogram")
    assert p.read_text() == "new" and os.stat(p).st_ino == inode  # in place: same file, no rename over it
    write_output(tmp_path / "fresh.csv", b"x", "--histogram")
    assert (tmp_path / "fresh.csv").read_bytes() == b"x"


def test_cache_clear_of_home_removes_nothing(tmp_path):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text("secret")
    (home / "notes.txt").write_text("mine")
    res = subprocess.run([sys.executable, "-m", "neffbuild.cli.main", "cache", "clear", "--yes"], capture_output=True,
                         text=True, cwd=ROOT, check=False,
                         env=dict(__import__("os").environ, HOME=str(home), NEFFBUILD_CACHE_DIR=str(home)))
    assert res.returncode == 0 and "removed 0 entries" in res.stdout, res.stderr
    assert (home / ".ssh" / "id_ed25519").read_text() == "secret" and (home / "notes.txt").read_text() == "mine"


def test_cache_clear_removes_only_its_own_tree_and_counts_truly(tmp_path):
    from neffbuild.compiler.cache import CACHE_VERSION, Cache

    c = Cache(tmp_path).ensure()
    for key in ("a", "b", "c"):
        (c.entries_dir / key).mkdir()
    (tmp_path / "mine.txt").write_text("keep")
    code, out, err, _ = run_cli("cache", "clear", "--yes", "--cache-dir", str(tmp_path))
    assert code == 0 and "removed 3 entries" in out, err
    assert not (tmp_path / f"v{CACHE_VERSION}").exists() and (tmp_path / "mine.txt").read_text() == "keep"
    # + a folder named like the cache's tree that holds someone else's files: refused, nothing removed
    own = tmp_path / f"v{CACHE_VERSION}"
    (own / "entries").mkdir(parents=True)
    (own / "thesis.tex").write_text("years of work")
    code, out, err, _ = run_cli("cache", "clear", "--yes", "--cache-dir", str(tmp_path))
    assert code == 2 and "nothing removed" in err and (own / "thesis.tex").exists()


# -- CLI: exit codes, JSON on errors, non-regular inputs, stdout kept for the JSON ----------------------

def test_recommend_refuses_non_regular_histograms(tmp_path):
    import os

    os.mkfifo(tmp_path / "fifo")
    for path, needle in ((str(tmp_path / "fifo"), "not a regular file"), ("/dev/zero", "not a regular file"),
                         (str(tmp_path), "is a directory")):  # + a folder (click refuses it)
        code, out, err, unhandled = run_cli("recommend", "--histogram", path, "--max-model-len", "512", "--json")
        assert unhandled is None and code == 2 and needle in out, (path, out, err)


def test_bench_refuses_bad_input_before_timing(built, eagle3_built):
    code, out, _, unhandled = run_cli("bench", str(built[1].bundle), "--context", "100000", "--json")
    assert unhandled is None and code == 2 and "above the bundle's max_model_len (512)" in out
    code, out, _, unhandled = run_cli("bench", str(eagle3_built[1].bundle), "--json")
    assert unhandled is None and code == 2 and "EAGLE3" in strict_json(out)["error"]["message"]


@pytest.mark.parametrize("args,env,needle", [
    (["compile", str(TINY), "-o", "/tmp/never", "--cache-dir", "/dev/null/cache"], {}, "--cache-dir /dev/null/cache"),
    (["compile", str(TINY), "-o", "/tmp/never", "--cache-dir", "/proc/neffbuild-cache"], {}, "cannot write there"),
    (["validate", str(TINY)], {"NEFFBUILD_LOG": "garbage"}, "NEFFBUILD_LOG='garbage'"),
    (["cache", "ls"], {"NEFFBUILD_LOG": "1e9"}, "NEFFBUILD_LOG"),
], ids=["cache-dir-under-a-file", "+ cache-dir-on-proc", "log-garbage", "+ log-on-another-command"])
def test_environment_and_folders_are_exit_2_with_json(args, env, needle):
    res = subprocess.run([sys.executable, "-m", "neffbuild.cli.main", *args, "--json"], capture_output=True,
                         text=True, cwd=ROOT, check=False, timeout=120, env=dict(__import__("os").environ, **env))
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert needle in strict_json(res.stdout)["error"]["message"]


def test_native_output_stays_off_stdout_under_json():
    """What UCX does under `generate --di --json`: a native library writes to file descriptor 1."""
    code = ("import os, sys\nfrom neffbuild.cli.output import keep_native_output_off_stdout\n"
            "keep_native_output_off_stdout()\nos.write(1, b'[UCX WARN] native noise\\n')\n"
            "os.system('echo child noise')\nprint('{\"ok\": true}')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert strict_json(res.stdout) == {"ok": True}
    assert "[UCX WARN] native noise" in res.stderr and "child noise" in res.stderr


@pytest.mark.slow
def test_sparse_12gb_digest_is_an_error_not_a_memory_error(built, tmp_path):
    import os

    root = tmp_path / "b"
    shutil.copytree(built[1].bundle, root)
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
    root = tampered(eagle3_built[1].bundle, tmp_path / "b", edit)
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
    root = tampered(built[1].bundle, tmp_path / "b", edit)
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
    root = tampered(built[1].bundle, tmp_path / "b", _flip_weight_byte)
    assert open_bundle(root) is not None  # the default open checks sizes only (documented)
    code, out, err, unhandled = run_cli("generate", str(root), "--prompt-ids", "1,2", "--check", "--json")
    assert unhandled is None and code == 1 and "sha256 mismatch" in strict_json(out)["error"]["message"], err
