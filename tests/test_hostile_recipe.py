"""Hostile recipes: files the loader refuses before validation, and what validate gates (a recipe that validates
plans and compiles without a traceback).

Each case ends in a clean error (or correct output), never a crash."""

import os
import subprocess
import sys

import pytest

from neffbuild.errors import InvalidInput
from tests.conftest import ROOT, TINY
from tests.helpers import run_cli, strict_json

# -- recipe files: refused before validation, one JSON document with --json, exit 2

def _deep(p):
    p.write_text("a: " + "[" * 500 + "]" * 500 + "\n")


def _bomb(p):
    rows = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    rows += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 8)]
    p.write_text("\n".join(rows) + "\n")


def _fifo(p):

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

# -- recipes are data; validate is the gate ------------------------------------------------

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
    ("+ draft-kv-heads-tp-cannot-split", lambda t: _patched(EAGLE3_RAW, (("parallel", "tp"), 2), (
        ("speculative", "draft", "config"), {"num_attention_heads": 6, "num_key_value_heads": 3})),
     "parallel.tp", "the draft's 6 attention heads"),
    ("+ draft-vocab-tp-cannot-split", lambda t: _patched(EAGLE3_RAW, (("parallel", "tp"), 2), (
        ("speculative", "draft", "config"), {"draft_vocab_size": 255})),
     "parallel.tp", "the draft's vocabulary of 255"),
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
