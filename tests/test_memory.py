"""Memory planning (issue 23): per-rank weights and KV, what a device fits, the 32-bit KV offset rule,
compile memory per target and the memory-gated local pool."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import EAGLE3_TINY, ROOT, TINY
from tests.helpers import cli

BIG = ROOT / "recipes" / "gpt-oss-120b-di-decode.yaml"
GIB = 1 << 30


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "neffbuild.cli.main", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env)


def _write(tmp_path: Path, raw: dict, name: str = "r.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(raw))
    return p


def _big(**serving) -> dict:
    raw = yaml.safe_load(BIG.read_text())
    raw.pop("speculative")
    raw["serving"].update(serving)
    return raw


def _plan_memory(path: Path, *extra, env=None) -> dict:
    res = _cli("plan", str(path), "--json", "--no-cache", *extra, env=env)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)["memory"]


def test_120b_kv_bytes_are_the_seeds_profile(tmp_path):
    mem = _plan_memory(_write(tmp_path, _big(num_blocks=36175)))
    rank = mem["per_rank"]
    assert rank["kv_bytes"] == 18 * 2 * 36175 * 1 * 128 * 64 * 1  # 18 buffers, K+V, 1 KV head at tp 8, FP8
    assert round(rank["kv_bytes"] / GIB, 2) == 9.94
    assert rank["kv_draft_bytes"] == 0 and rank["kv_target_bytes"] == rank["kv_bytes"]
    assert isinstance(rank["weight_bytes"], int) and rank["weight_bytes"] > 0
    assert mem["kv_offset_limit"] == (2**32 - 1) // (128 * 64)  # neuron: one head per rank


def test_eagle3_draft_kv_is_counted_apart(tmp_path):
    """The draft's buffer, beside the 18 target buffers, holds the rank's TP slice of its 8 KV heads: one at tp 8."""
    raw = yaml.safe_load(BIG.read_text())
    rank = _plan_memory(_write(tmp_path, raw))["per_rank"]
    nb = raw["serving"]["num_blocks"]
    assert rank["kv_target_bytes"] == 18 * 2 * nb * 1 * 128 * 64
    assert rank["kv_draft_bytes"] == 2 * nb * 1 * 128 * 64
    assert rank["kv_bytes"] == rank["kv_target_bytes"] + rank["kv_draft_bytes"] and rank["draft_weight_bytes"] > 0


def test_kv_bytes_equal_what_the_runtime_allocates():
    """The formula is the runtime's own: the bytes of the buffers kv_cache.allocate makes."""
    from neffbuild import memory
    from neffbuild import recipe as R
    from neffbuild.runtime.kv.cache import allocate, allocate_draft

    for path in (TINY, EAGLE3_TINY):
        r = R.load(path).replace(num_blocks=37)
        layout = memory.recipe_kv_layout(r)
        bufs = allocate(layout) + ([allocate_draft(layout)] if layout.has_draft else [])
        assert sum(t.numel() * t.element_size() for t in bufs) == memory.per_rank(r)["per_rank"]["kv_bytes"]


def _manifest_bytes(bundle: Path, pieces: list[str]) -> int:
    size = {"float32": 4, "bfloat16": 2, "int64": 8, "uint8": 1, "bool": 1}
    m = json.loads((bundle / "manifest.json").read_text())
    entries = [m["weights"]] + [m["parallel"]["pieces"][p] for p in pieces]
    return sum(math.prod(t["shape"]) * size[t["dtype"]] for e in entries for t in e["tensors"].values())


def test_weight_bytes_are_the_ranks_pieces_in_the_bundle(built_tp2, eagle3_built):
    from neffbuild import memory
    from neffbuild import recipe as R
    from neffbuild.runtime.bundle.paths import RECIPE_PATH

    sharded = R.load(built_tp2 / RECIPE_PATH)
    assert sum(memory.weight_bytes(sharded)) == _manifest_bytes(built_tp2, ["tp0", "ep0"])
    path, res = eagle3_built.recipe, eagle3_built.result
    target, draft = memory.weight_bytes(R.load(path))
    assert target + draft == _manifest_bytes(res.bundle, []) and draft > 0


def _tiny_independent(device: int) -> tuple[int, int]:
    """(weight bytes, largest num_blocks) for the tiny recipe on ``device`` bytes, from real tensors and the
    config by hand: 4 layers -> 2 buffers, K and V, 2 KV heads, block 16, head 16, float32."""
    from neffbuild.models.gpt_oss.weights import model_weights
    from neffbuild.recipe import load

    cfg = load(TINY).model.config
    weights = sum(t.numel() * t.element_size() for t in model_weights(cfg, None, 0).values())
    per_block = (4 // 2) * 2 * 2 * 16 * 16 * 4
    usable = device - device * 10 // 100
    return weights, (usable - weights) // per_block


def test_device_memory_suggestion_fits_and_one_more_block_does_not(tiny_raw, tmp_path):
    device = 48 << 20
    weights, expect = _tiny_independent(device)
    mem = _plan_memory(_write(tmp_path, tiny_raw), "--device-memory", "48MiB")
    assert mem["per_rank"]["weight_bytes"] == weights
    assert mem["device"]["max_num_blocks"] == expect and mem["device"]["device_memory_bytes"] == device
    for nb, fits in ((expect, True), (expect + 1, False)):
        tiny_raw["serving"]["num_blocks"] = nb
        path = _write(tmp_path, tiny_raw, f"n{nb}.yaml")
        assert _plan_memory(path, "--device-memory", "48MiB")["device"]["fits"] is fits
        res = _cli("validate", str(path), "--json", "--device-memory", "48MiB")
        assert res.returncode == 0, res.stderr
        warned = [w for w in json.loads(res.stdout)["warnings"] if "--device-memory" in w]
        assert bool(warned) is not fits
        if warned:
            assert "serving.num_blocks" in warned[0] and f"at most {expect} fit" in warned[0]
    text = _cli("plan", str(path), "--no-cache", "--device-memory", "48MiB", env=dict(os.environ, COLUMNS="200"))
    assert "does NOT fit" in text.stdout and f"largest num_blocks that fits: {expect}" in text.stdout


def test_device_memory_bad_size_is_a_usage_error(tmp_path, tiny_raw):
    res = _cli("plan", str(_write(tmp_path, tiny_raw)), "--no-cache", "--device-memory", "12XB")
    assert res.returncode == 2 and "--device-memory" in res.stderr and "Traceback" not in res.stderr


def test_uint32_kv_offsets_refuse_the_tp1_70000_block_neuron_recipe(tmp_path):
    raw = _big(num_blocks=70000)
    raw["parallel"] = {"tp": 1, "dp": 1, "ep": 1}
    res = _cli("validate", str(_write(tmp_path, raw)), "--json")
    assert res.returncode == 2, res.stdout
    [err] = json.loads(res.stdout)["errors"]
    span = 70000 * 8 * 128 * 64  # one K half: num_blocks x 8 KV heads x block x head_dim x 1 byte (FP8)
    assert err["path"] == "serving.num_blocks" and err["value"] == 70000
    assert f"{span:,}" in err["message"] and "at most 65535 blocks fit" in err["message"]
    assert "Traceback" not in res.stderr
    for nb, code in ((65535, 0), (65536, 2)):  # 65536 x 2^16 = 2^32: not below it
        raw["serving"]["num_blocks"] = nb
        assert _cli("validate", str(_write(tmp_path, raw, f"{nb}.yaml"))).returncode == code
    raw["serving"]["num_blocks"] = 70000
    raw["compiler"]["backend"] = "inductor"  # the rule is the neuron backend's part, not a general one
    assert _cli("validate", str(_write(tmp_path, raw, "inductor.yaml"))).returncode == 0


def test_memory_planning_is_torch_free():
    """plan --no-cache --device-memory and validate --device-memory are arithmetic: torch is never imported."""
    code = ("import sys, json\n"
            "from click.testing import CliRunner\n"
            "from neffbuild.cli.main import _register, cli\n"
            "_register()\n"
            f"r = CliRunner().invoke(cli, ['plan', {str(BIG)!r}, '--no-cache', '--json', '--device-memory', '24GiB'])\n"
            "assert r.exit_code == 0, r.output\n"
            "doc = json.loads(r.output)['memory']\n"
            "assert doc['per_rank']['kv_bytes'] > 0 and len(doc['compile']['targets']) == 48\n"
            f"assert CliRunner().invoke(cli, ['validate', {str(BIG)!r}, '--device-memory', '12GiB']).exit_code == 0\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr


def test_admission_holds_back_and_never_stalls():
    from neffbuild.compiler.memory_plan import Admission

    gate = Admission({"a": 3 * GIB, "b": 3 * GIB, "c": GIB}, 4 * GIB, "test", jobs=3)
    assert gate.workers() == 2  # the two smallest fit together
    assert gate.may_start("a")
    gate.started("a")
    assert not gate.may_start("b") and gate.may_start("c")
    gate.started("c")
    gate.finished("a")
    gate.finished("c")
    huge = Admission({"a": 9 * GIB}, 4 * GIB, "test", jobs=2)
    assert huge.workers() == 1 and huge.may_start("a")  # one compile always starts, whatever it needs
    free = Admission({"a": 9 * GIB, "b": 9 * GIB}, None, "unknown", jobs=2)
    assert free.workers() == 2 and free.may_start("a") and free.note() is None


def test_plan_compile_memory_follows_the_free_memory_override(tmp_path, tiny_raw):
    env = dict(os.environ, NEFFBUILD_FREE_MEMORY="3GiB", NEFFBUILD_CACHE_DIR=str(tmp_path / "empty"))
    c = _plan_memory(_write(tmp_path, tiny_raw), env=env)["compile"]
    assert c["free_memory_bytes"] == 3 * GIB and c["free_memory_source"] == "NEFFBUILD_FREE_MEMORY"
    assert c["concurrent_compiles"] == 1  # each tiny compile is estimated at just over 2 GiB
    assert all(row["source"] == "size" and 2 * GIB < row["peak_rss_bytes"] < 3 * GIB for row in c["targets"].values())


def test_plan_reads_artifact_size_and_rss_from_the_cache(built, build_cache):
    from neffbuild.compiler.cache import Cache

    path, res = built.recipe, built.result
    env = dict(os.environ, NEFFBUILD_CACHE_DIR=str(build_cache))
    out = _cli("plan", str(path), "--json", env=env)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    m = json.loads((res.bundle / "manifest.json").read_text())
    largest = max(m["artifacts"], key=lambda a: a["bytes"])
    art = doc["memory"]["per_rank"]["largest_artifact"]
    assert art == {"label": largest["label"], "bytes": largest["bytes"], "source": "cache"}
    metas = {e["key"]: e for e in Cache(build_cache).metas()}
    for t in doc["targets"]:
        row = doc["memory"]["compile"]["targets"][t["label"]]
        assert row["source"] == "key" and row["peak_rss_bytes"] == int(metas[t["cache_key"]]["peak_rss_bytes"] * 1.25)


@pytest.mark.slow  # it compiles (cold, its own cache)
def test_local_build_under_a_memory_cap_runs_one_compile_at_a_time(tmp_path, tiny_raw):
    """Two targets, two jobs, 3 GiB 'free' (each compile is estimated above 2 GiB): one at a time, said so.
    The 2-layer model (the fewest gk_decode allows): the gate schedules real compiles whatever their graph."""
    tiny_raw["name"] = "memcap"
    tiny_raw["model"]["config"]["num_hidden_layers"] = 2
    tiny_raw["neuron_config"].update(num_seqs_buckets=[1], decode_context_length_buckets=[128])
    tiny_raw["serving"].update(max_num_seqs=1, num_blocks=101)
    env = dict(os.environ, NEFFBUILD_FREE_MEMORY="3GiB")
    res = cli("compile", str(_write(tmp_path, tiny_raw)), "-o", str(tmp_path / "out"), "--jobs", "2", "--json",
              "--cache-dir", str(tmp_path / "cache"), env=env)  # in this process: the pool's workers are its own
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    assert (doc["built"], doc["failed"]) == (2, [])  # nothing killed, both built
    assert doc["memory"]["jobs"] == 2 and doc["memory"]["max_concurrent"] == 1 and doc["memory"]["held_back"]
    assert doc["memory"]["free_memory_bytes"] == 3 * GIB
    assert "at most 1 compile(s) at once instead of 2" in doc["memory_note"]
    assert "NEFFBUILD_FREE_MEMORY" in res.stderr and "at most 1 compile(s) at once" in res.stderr


@pytest.mark.parametrize("text,value", [("12GiB", 12 * GIB), ("512MiB", 512 << 20), ("1.5G", 3 * GIB // 2),
                                        ("4096", 4096), ("2 gb", 2 * GIB)])
def test_parse_size(text, value):
    from neffbuild.settings import parse_size

    assert parse_size(text) == value


def test_120b_recipe_num_blocks_is_the_formulas_12gib_value():
    """recipes/gpt-oss-120b-di-decode.yaml is the seeds' deployment (LNC 1: 12 GiB a rank, bf16 + MXFP4, packed
    FP8 KV) and sets num_blocks from `plan --device-memory 12GiB` (its comment)."""
    raw = yaml.safe_load(BIG.read_text())
    assert raw["neuron_config"]["lnc"] == 1 and raw["neuron_config"]["fp8_packed_kv"]
    assert (raw["model"]["weights_dtype"], raw["model"]["experts"]) == ("bfloat16", "mxfp4")
    mem = _plan_memory(BIG, "--device-memory", "12GiB")
    dev = mem["device"]
    assert dev["device_memory_bytes"] == 12 * GIB
    assert dev["fits"] and dev["max_num_blocks"] == raw["serving"]["num_blocks"] == 33113


def test_120b_weights_per_rank_from_the_stored_dtypes(tmp_path):
    """The production layout (tp 8, ep 128) by hand: one expert per layer as MXFP4 (17 bytes per 32 weights), an
    eighth of attention in bf16, the router, an eighth of the embedding and unembedding (split by vocabulary) in
    bf16; the draft bf16 too, its TP slice."""
    rank = _plan_memory(BIG)["per_rank"]
    parts = rank["weight_parts_bytes"]
    L, H, I, V, E = 36, 2880, 2880, 201088, 128
    experts = L * (2 * I * H + H * I) * 17 // 32 + L * (2 * I + H) * 2  # MXFP4 weights + bf16 biases, 1 expert
    attention = L * ((8 + 2) * 64 * H + (8 + 2) * 64 + H * 8 * 64 + H + 8 + 2 * H) * 2 + H * 2  # + norms, final norm
    assert parts == {"embedding": 2 * (V // 8) * H * 2, "attention": attention, "router": L * (E * H + E) * 2,
                     "experts": experts, "draft": rank["draft_weight_bytes"]}
    assert rank["weight_bytes"] == sum(parts.values())
    assert round(parts["experts"] / GIB, 2) == 0.44 and round(parts["attention"] / GIB, 2) == 0.22
    # float32 and dense experts (the old form) is 7.5x the expert bytes: 32 bits a weight against 4.25
    raw = yaml.safe_load(BIG.read_text())
    raw["model"].update(weights_dtype="float32", experts="dense")
    f32 = _plan_memory(_write(tmp_path, raw))["per_rank"]
    ratio = (f32["weight_parts_bytes"]["experts"] - L * (2 * I + H) * 4) / (experts - L * (2 * I + H) * 2)
    assert round(ratio, 2) == 7.53  # 32 / 4.25
    target = sum(parts.values()) - parts["draft"]  # about 1 GiB a rank: the arithmetic the recipe's comment quotes
    assert round(target / GIB, 2) == 0.96 and round(parts["embedding"] / GIB, 2) == 0.27
    assert rank["sharding_outlook"] == {"no_draft": {"weight_bytes": target, "kv_bytes_per_block": 18 * 2 * 128 * 64}}
    # the draft, bf16 and split over TP like the target: an eighth of its heads and of its LM head's vocabulary
    Hq, d = 64, 64
    draft = (H * 3 * H + 4 * H + (Hq // 8 + 2) * d * 2 * H + H * (Hq // 8) * d + 3 * I * H + (V // 8) * H) * 2 + V * 8
    assert parts["draft"] == draft and round(draft / 2**20, 2) == 244.4  # + d2t int64, whole


def test_120b_plan_acceptance_draft_sharded_like_the_target():
    """Issue 52: per rank at lnc 1 (12 GiB), the target's weights at most 1.5 GiB, the draft's at most 1 GiB
    (bf16, its TP slice), and at least 30,000 KV blocks (its draft KV: 1 of its 8 KV heads a rank)."""
    mem = _plan_memory(BIG, "--device-memory", "12GiB")
    rank = mem["per_rank"]
    target, draft = rank["weight_bytes"] - rank["draft_weight_bytes"], rank["draft_weight_bytes"]
    assert target <= 1.5 * GIB and 0 < draft <= 1 * GIB
    assert rank["kv_bytes_per_block"] == 2 * (18 + 1) * 128 * 64  # FP8: 18 target buffers + the draft's, 1 head
    assert mem["device"]["max_num_blocks"] >= 30_000
