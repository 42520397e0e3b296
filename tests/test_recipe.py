"""Recipe validation: a table of (fragment, expected path, expected message)."""

import copy
import json
import os

import pytest
import yaml

from neffbuild import recipe as R
from neffbuild.errors import InvalidInput, RecipeError
from tests.helpers import ROOT, TINY, cli

BASE = yaml.safe_load(TINY.read_text())


def patched(path: str, value):
    raw = copy.deepcopy(BASE)
    keys = path.split(".")
    node = raw
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    if value is DELETE:
        node.pop(keys[-1], None)
    else:
        node[keys[-1]] = value
    return raw


class _Delete:
    """The value that removes a key; a stable repr, so test ids are the same in every xdist worker."""

    def __repr__(self):
        return "<deleted>"


DELETE = _Delete()
CTX = "neuron_config.decode_context_length_buckets"
NS = "neuron_config.num_seqs_buckets"

CASES = [
    # (dotted key to patch, new value, expected error path, substring of the message)
    (CTX, 256, CTX, "must be a list"),
    (CTX, [], CTX, "must not be empty"),
    (CTX, [128, True], f"{CTX}[1]", "must be an integer"),
    (CTX, [128, 256.0], f"{CTX}[1]", "must be an integer"),
    (CTX, ["128"], f"{CTX}[0]", "must be an integer"),
    (CTX, [-128, 256], f"{CTX}[0]", "must be > 0"),
    (CTX, [0, 256], f"{CTX}[0]", "must be > 0"),
    (CTX, [256, 128], f"{CTX}[1]", "strictly ascending"),
    (CTX, [128, 128], f"{CTX}[1]", "strictly ascending"),
    (CTX, [128, 300], f"{CTX}[1]", "divisible by 128"),
    (CTX, [128, 1024], f"{CTX}[1]", "<= serving.max_model_len"),
    (NS, [], NS, "must not be empty"),
    (NS, [1, 2, 3], f"{NS}[2]", "must equal serving.max_num_seqs"),
    (NS, [0, 4], f"{NS}[0]", "must be > 0"),
    (NS, [True, 4], f"{NS}[0]", "must be an integer"),
    (NS, [2, 1, 4], f"{NS}[1]", "strictly ascending"),
    ("serving.block_size", 256, "serving.block_size", "must be <= 128"),
    ("serving.block_size", "16", "serving.block_size", "must be an integer"),
    ("serving.max_num_seqs", 0, "serving.max_num_seqs", "positive integer"),
    ("serving.max_model_len", True, "serving.max_model_len", "must be an integer"),
    ("serving.num_blocks", 16, "serving.num_blocks", "must be >= 36 to hold one max_model_len (512) sequence"),
    ("serving.num_blocks", 35, "serving.num_blocks", "(32 full + 3 sliding + 1 null block"),
    ("serving.max_model_len", 8192, "serving.max_model_len", "max_position_embeddings"),
    ("serving.block_size", DELETE, "serving.block_size", "is required"),
    ("model.config.sliding_window", 256, f"{CTX}[0]", "sliding-window table width"),
    ("parallel.tp", 3, "parallel.tp", "num_attention_heads"),
    ("parallel", {"tp": 2, "dp": 1, "ep": 4}, "parallel.ep", "must divide the world tp x dp = 2"),
    ("parallel", {"tp": 1, "dp": 1, "ep": 2}, "parallel.ep", "must divide the world tp x dp = 1"),
    ("parallel", {"tp": 4, "ep": 8}, "parallel.ep", "num_local_experts"),
    ("parallel.ep", 3, "parallel.ep", "num_local_experts"),
    ("parallel.dp", 0, "parallel.dp", "positive integer"),
    ("model.config.num_hidden_layers", 3, "model.config.num_hidden_layers", "must be even"),
    ("model.config.layer_types", ["sliding_attention", "full_attention"], "model.config.layer_types",
     "num_hidden_layers"),
    ("model.config.layer_types", ["full_attention", "sliding_attention"] * 2, "model.config.layer_types[0]",
     "gk_decode"),
    ("model.config.layer_types", ["sliding_attention", "nope"], "model.config.layer_types", "must be a list of"),
    ("model.config.num_attention_heads", 3, "model.config.num_attention_heads", "multiple of num_key_value_heads"),
    ("model.config.hidden_size", -1, "model.config.hidden_size", "positive integer"),
    ("model.config.head_dim", "16", "model.config.head_dim", "must be an integer"),
    ("model.config.num_experts_per_tok", 8, "model.config.num_experts_per_tok", "num_local_experts"),
    ("model.arch", "llama", "model.arch", "unknown architecture"),
    ("model.arch", "gpt-oss", "model.arch", "did you mean 'gpt_oss'"),
    # A typo in an inline config key would compile the default layer count: refused, with a hint.
    ("model.config.num_hiden_layers", 2, "model.config.num_hiden_layers", "did you mean 'num_hidden_layers'"),
    ("model.config.frobnicate", 1, "model.config.frobnicate", "not a GPT-OSS config key"),
    ("model.checkpoint", "/nonexistent/ckpt", "model.checkpoint", "does not exist"),
    ("model.random_seed", DELETE, "model", "exactly one of"),
    ("model.random_seed", -1, "model.random_seed", "must be >= 0"),
    ("neuron_config.lnc", 3, "neuron_config.lnc", "must be 1 or 2"),
    ("neuron_config.lnc", True, "neuron_config.lnc", "must be 1 or 2"),
    ("neuron_config.gk_decode", "yes", "neuron_config.gk_decode", "true or false"),
    ("neuron_config.fp8_packed_kv", 1, "neuron_config.fp8_packed_kv", "true or false"),
    ("neuron_config.decode_context_lenght_buckets", [128], "neuron_config.decode_context_lenght_buckets",
     "did you mean 'decode_context_length_buckets'"),
    ("serving.max_modle_len", 5, "serving.max_modle_len", "did you mean 'max_model_len'"),
    ("compiler.backend", "inductr", "compiler.backend", "did you mean 'inductor'"),
    ("compiler.target", "trn3", "compiler.target", "must be one of"),
    ("compiler.optlevel", 4, "compiler.optlevel", "1, 2 or 3"),
    ("compiler.flags", "-O2", "compiler.flags", "list of strings"),
    ("build.jobs", 0, "build.jobs", "positive integer"),
    ("name", "Bad Name", "name", "must match"),
    ("version", 1.0, "version", "semantic version"),
    ("version", DELETE, "version", "is required"),
    ("speculative", {"method": "eagle3", "num_speculative_tokens": 0, "draft": {"random_seed": 1}},
     "speculative.num_speculative_tokens", "positive integer"),
    ("speculative", {"method": "medusa", "num_speculative_tokens": 2, "draft": {"random_seed": 1}},
     "speculative.method", "must be one of"),
    ("speculative", {"method": "eagle3", "num_speculative_tokens": 2, "draft": {}},
     "speculative.draft", "exactly one of"),
    ("serving", [1], "serving", "must be a mapping"),
    ("nonsense", 1, "nonsense", "unknown key"),
    ("serving.block_size", 48, f"{CTX}[0]", "multiple of serving.block_size"),
    ("model.config", DELETE, "model.config", "is required with random_seed"),
    ("model.config", "missing/config.json", "model.config", "does not exist"),
    ("model.config", [1], "model.config", "must be a mapping"),
    ("speculative", {"method": "eagle3", "num_speculative_tokens": 600, "draft": {"random_seed": 1}},
     "speculative.num_speculative_tokens", "must be <= 64"),
    ("compiler.target_flags", ["x"], "compiler.target_flags", "must be a mapping"),
    # hostile values (issue 16): strict types, bounded sizes, nested blocks checked like the rest
    ("name", "gpt-oss-tiny\n", "name", "must match"),
    ("version", "0.1.0\n", "version", "semantic version"),
    ("neuron_config.lnc", 1.0, "neuron_config.lnc", "must be 1 or 2"),
    ("compiler.optlevel", 2.0, "compiler.optlevel", "must be 1, 2 or 3"),
    ("parallel.tp", 1.0, "parallel.tp", "not a float"),
    ("model.config.num_hidden_layers", 10**30, "model.config.num_hidden_layers", "must be <= 1024"),
    ("serving.max_model_len", 10**400, "serving.max_model_len", "must be <="),
    ("serving.num_blocks", 10**30, "serving.num_blocks", "must be <="),
    (CTX, [128, 10**30], f"{CTX}[1]", "must be > 0 and <="),
    ("model.random_seed", 2**64, "model.random_seed", "must be <="),
    ("model.config.rope_parameters", "abc", "model.config.rope_parameters", "must be a mapping"),
    ("model.config.rope_parameters.factor", "x", "model.config.rope_parameters.factor", "finite number"),
    ("model.config.rope_parameters.factr", 2.0, "model.config.rope_parameters.factr", "did you mean 'factor'"),
    ("model.config.rope_parameters.truncate", "no", "model.config.rope_parameters.truncate", "true or false"),
    ("model.config.rope_parameters.rope_type", "xx", "model.config.rope_parameters.rope_type", "one of"),
    ("model.config.rms_norm_eps", "abc", "model.config.rms_norm_eps", "finite number"),
    ("model.config.rms_norm_eps", float("nan"), "model.config.rms_norm_eps", "finite number"),
    ("model.config.swiglu_limit", float("inf"), "model.config.swiglu_limit", "finite number"),
    ("model.config.layer_types", ["sliding_attention"] * 5000, "model.config.layer_types", "at most 1024"),
    ("speculative", {}, "speculative", "is empty"),
    ("speculative", {"method": "eagle3", "num_speculative_tokens": 2,
                     "draft": {"random_seed": 1, "config": {"hidden_size": "abc"}}},
     "speculative.draft.config.hidden_size", "must be an integer"),
    ("model.config", "~nosuchuser-neffbuild/config.json", "model.config", "unknown user"),
    ("build.cache_dir", "~nosuchuser-neffbuild/c", "build.cache_dir", "unknown user"),
    # the serving dtypes (docs/recipe.md "Serving dtypes")
    ("model.weights_dtype", "float16", "model.weights_dtype", "must be one of float32, bfloat16"),
    ("model.weights_dtype", "bf16", "model.weights_dtype", "did you mean 'bfloat16'"),
    ("model.experts", "nvfp4", "model.experts", "must be one of dense, mxfp4"),
    ("model.expert", "mxfp4", "model.expert", "did you mean 'experts'"),
    ("neuron_config.kv_dtype", "float8_e4m3fn", "neuron_config.kv_dtype", "must be one of float32, bfloat16"),
    ("neuron_config", dict(BASE["neuron_config"], fp8_packed_kv=True, kv_dtype="bfloat16"), "neuron_config.kv_dtype",
     "must be left out with neuron_config.fp8_packed_kv: true"),
    ("model", dict(BASE["model"], experts="mxfp4", config=dict(BASE["model"]["config"], intermediate_size=48)),
     "model.experts", "mxfp4 needs model.config.intermediate_size (48) divisible by 32"),
]


@pytest.mark.parametrize("key,value,path,message", CASES, ids=[f"{c[0]}={c[1]!r}"[:60] for c in CASES])
def test_validation_rule(key, value, path, message):
    with pytest.raises(RecipeError) as info:
        R.from_dict(patched(key, value))
    problems = info.value.problems
    hits = [p for p in problems if p.path == path and message in str(p)]
    assert hits, f"expected {path}: ...{message}...; got {[str(p) for p in problems]}"


def test_tp_kv_heads_split_or_replicated():
    """tp may divide the KV heads or be a multiple of them (replicated), not neither."""
    raw = patched("parallel", {"tp": 4, "dp": 2, "ep": 4})  # 4 query heads, 2 KV heads: each KV head on 2 ranks
    assert R.from_dict(raw).tp == 4
    raw = patched("model.config.num_attention_heads", 12)
    raw["model"]["config"]["num_key_value_heads"] = 3
    raw["parallel"] = {"tp": 2}
    with pytest.raises(RecipeError, match=r"parallel\.tp: got 2, must divide model\.config\.num_key_value_heads"):
        R.from_dict(raw)


def test_tp_must_divide_the_vocabulary():
    """The embedding and the LM head are split by vocabulary over TP: a vocabulary tp does not divide is refused
    (naming both keys), not padded."""
    raw = patched("model.config.vocab_size", 255)
    raw["parallel"] = {"tp": 2, "ep": 2}
    with pytest.raises(RecipeError, match=r"parallel\.tp: got 2, must divide model\.config\.vocab_size \(255\)"):
        R.from_dict(raw)


def test_neuron_tp_must_fit_one_instance():
    raw = patched("compiler.backend", "neuron")
    raw["compiler"]["target"] = "trn1"
    raw["model"]["config"].update(num_attention_heads=64, num_key_value_heads=8)
    raw["neuron_config"]["lnc"] = 2
    raw["parallel"] = {"tp": 32}
    with pytest.raises(RecipeError, match=r"tp x neuron_config\.lnc \(64\) must fit the 32 NeuronCores"):
        R.from_dict(raw)
    raw["parallel"] = {"tp": 16}
    assert R.from_dict(raw).tp == 16


def test_absent_context_buckets_mean_fallback_only():
    r = R.from_dict(patched(CTX, DELETE))
    assert r.decode_context_length_buckets == ()
    assert any("no context buckets are compiled" in w for w in r.warnings)


def test_plan_of_fallback_only_recipe_lists_num_seqs_targets(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(patched(CTX, DELETE)))
    res = _cli("plan", str(p), "--json", "--no-cache")
    doc = json.loads(res.stdout)
    assert res.returncode == 0 and doc["count"] == len(BASE["neuron_config"]["num_seqs_buckets"]) == 3
    assert {t["ctx"] for t in doc["targets"]} == {BASE["serving"]["max_model_len"]}
    assert any("no context buckets" in w for w in doc["warnings"])


def test_long_values_are_shortened_in_errors():
    with pytest.raises(RecipeError) as info:
        R.from_dict("x" * 100_000)
    assert len(str(info.value)) < 400 and "100002 characters" in str(info.value)
    assert len(json.dumps(info.value.problems[0].to_json())) < 400


def test_error_text_names_path_value_and_rule():
    with pytest.raises(RecipeError) as info:
        R.from_dict(patched(CTX, [128, 3000]))
    assert f"{CTX}[1]: got 3000, must be divisible by 128 (the attention tile)" in str(info.value)


def test_gk_off_allows_any_layer_order():
    raw = patched("model.config.layer_types", ["full_attention", "sliding_attention"] * 2)
    raw["neuron_config"]["gk_decode"] = False
    R.from_dict(raw)


def test_all_errors_at_once():
    raw = patched(CTX, [256, 128])
    raw["serving"]["block_size"] = "16"
    raw["parallel"]["tp"] = 3
    with pytest.raises(RecipeError) as info:
        R.from_dict(raw)
    paths = {p.path for p in info.value.problems}
    assert {f"{CTX}[1]", "serving.block_size", "parallel.tp"} <= paths


def test_last_bucket_equal_to_max_model_len_is_folded():
    r = R.from_dict(patched(CTX, [128, 512]))
    assert r.decode_context_length_buckets == (128,)
    r = R.from_dict(patched(CTX, [512]))
    assert r.decode_context_length_buckets == ()


@pytest.mark.parametrize("mns,expected", [(8, (1, 2, 4, 8)), (6, (1, 2, 4, 6)), (1, (1,)), (4, (1, 2, 4))])
def test_default_num_seqs_buckets(mns, expected):
    raw = patched(NS, DELETE)
    raw["serving"]["max_num_seqs"] = mns
    assert R.from_dict(raw).num_seqs_buckets == expected


def test_non_power_of_two_bucket_warns():
    raw = patched(CTX, [128, 384])
    r = R.from_dict(raw)
    assert any("384" in w and "1.87x" in w for w in r.warnings)


def test_few_blocks_warns():
    r = R.from_dict(patched("serving.num_blocks", 64))
    assert any("num_blocks" in w for w in r.warnings)


def test_checkpoint_folder_without_safetensors_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(BASE["model"]["config"]))
    raw = patched("model", {"arch": "gpt_oss", "checkpoint": str(tmp_path)})
    with pytest.raises(RecipeError, match=r"holds no \*\.safetensors files"):
        R.from_dict(raw)


def test_yaml_syntax_error_names_line_and_column(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("name: x\nserving: {max_model_len: 5\nversion: 1\n")
    with pytest.raises(InvalidInput, match=r"line \d+, column \d+"):
        R.load(p)


def test_duplicate_key_is_an_error(tmp_path):
    p = tmp_path / "dup.yaml"
    p.write_text("name: a\nname: b\n")
    with pytest.raises(InvalidInput, match="duplicate key 'name'"):
        R.load(p)


def test_relative_paths_resolve_against_recipe_folder(tmp_path):
    (tmp_path / "ck").mkdir()
    cfg = dict(BASE["model"]["config"])
    (tmp_path / "ck" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "ck" / "model.safetensors").write_bytes(b"\x02" + bytes(7) + b"{}")  # an empty safetensors file
    raw = copy.deepcopy(BASE)
    raw["model"] = {"arch": "gpt_oss", "checkpoint": "ck"}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw))
    r = R.load(tmp_path / "r.yaml")
    assert r.model.checkpoint == (tmp_path / "ck").resolve()
    assert r.model.config.hidden_size == 64


def test_normalised_recipe_round_trips_and_hash_is_stable():
    r = R.from_dict(copy.deepcopy(BASE))
    again = R.from_dict(yaml.safe_load(r.to_yaml()))
    assert again.sha256() == r.sha256()
    assert again == r


@pytest.mark.parametrize("name", ["gpt-oss-tiny", "gpt-oss-small", "gpt-oss-120b-di-decode", "gpt-oss-tiny-eagle3"])
def test_shipped_recipes_validate(name):
    r = R.load(ROOT / "recipes" / f"{name}.yaml")
    if name != "gpt-oss-small":  # the benchmark recipe keeps its measured 8192-block pool (docs/benchmarks.md)
        assert r.warnings == (), r.warnings  # a recipe we ship as an example validates without a warning


_cli = cli  # in-process (tests/helpers.py)


def test_cli_validate_three_mistakes(tmp_path):
    raw = patched(CTX, [256, 128])
    raw["serving"]["block_size"] = "16"
    raw["parallel"]["tpp"] = 2
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(raw))
    res = _cli("validate", str(p))
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    for needle in (f"{CTX}[1]", "serving.block_size", "parallel.tpp", "did you mean 'tp'"):
        assert needle in res.stderr
    res = _cli("validate", str(p), "--json")
    doc = json.loads(res.stdout)
    assert res.returncode == 2 and doc["valid"] is False and len(doc["errors"]) == 3


def test_cli_validate_ok_json():
    res = _cli("validate", str(TINY), "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc.pop("parallel")["world_size"] == 1
    assert doc == {"valid": True, "errors": [], "warnings": []}


def test_cli_missing_file_is_usage_error():
    res = _cli("validate", "/nope.yaml")
    assert res.returncode == 2 and "not found" in res.stderr and "Traceback" not in res.stderr


def test_cli_plan_json_neuron_recipe_without_sdk():
    res = _cli("plan", str(ROOT / "recipes" / "gpt-oss-120b-di-decode.yaml"), "--json", "--no-cache")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["count"] == 48 and len(doc["targets"]) == 48
    assert {t["family"] for t in doc["targets"]} == {"target_spec", "target_nospec", "draft"}


def test_target_flags_validated_against_grid():
    raw = patched("compiler.target_flags", {"decode_b3_ctx128": ["x=1"], "decode_b1_ctx128": "x=1"})
    with pytest.raises(RecipeError) as info:
        R.from_dict(raw)
    text = str(info.value)
    assert "compiler.target_flags.decode_b3_ctx128" in text and "did you mean" in text
    assert "compiler.target_flags.decode_b1_ctx128: got 'x=1', must be a list of strings" in text
    r = R.from_dict(patched("compiler.target_flags", {"decode_b1_ctx128": ["max_autotune=false"]}))
    assert r.flags_for("decode_b1_ctx128") == ("max_autotune=false",) and r.flags_for("decode_b2_ctx128") == ()


def test_plan_of_the_production_grid_fits_an_80_column_pipe():
    """48 graphs whose cache state is unknown (no Neuron SDK here): one line per row, the reason said once,
    and no "to build: 0 of 48" (nothing was looked up)."""
    res = _cli("plan", ROOT / "recipes" / "gpt-oss-120b-di-decode.yaml", env=dict(os.environ, COLUMNS="80"))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    rows = [line for line in lines if line.split() and line.split()[0].startswith(("decode_", "draft_"))
            and line.split()[-1] == "unknown"]  # the plan table's rows (the memory table below has its own)
    assert len(rows) == 48 and len({line.split()[0] for line in rows}) == 48
    why = [line for line in lines if line.startswith("why (all 48 graphs): backend 'neuron' needs the Neuron SDK")]
    assert len(why) == 1, res.stdout
    assert "to build: 0 of 48" not in res.stdout
    assert "cache state unknown for all 48 graphs" in lines[-1]


def test_yaml_limit_error_is_wrapped_once_and_keeps_its_reason(tmp_path):
    """A limit hit while reading the file: one error naming the file, the reason whole, however long the path."""
    folder = tmp_path / ("d" * 200)
    folder.mkdir()
    p = folder / "r.yaml"
    p.write_text("a: " + "[" * 40 + "]" * 40 + "\n")
    res = _cli("validate", p)
    assert res.returncode == 2
    assert res.stderr.count("problem(s)") == 1 and "RecipeError" not in res.stderr
    assert res.stderr.rstrip().endswith("(file): nested deeper than 32 levels (line 1)"), res.stderr
    doc = json.loads(_cli("validate", p, "--json").stdout)
    assert [e["message"] for e in doc["errors"]] == ["nested deeper than 32 levels (line 1)"]
