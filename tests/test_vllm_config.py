"""`neffbuild inspect BUNDLE --vllm-config`: vLLM's settings for exactly the compiled grid."""

import json

from neffbuild.bundle import handoff
from neffbuild.grid import enumerate_targets
from tests.helpers import POOL, cli


def _cli(env, *args):
    return cli(*args)  # inspect reads the manifest only: no stand-in SDK needed, so in this process


def test_vllm_config_of_a_built_bundle_names_exactly_the_compiled_grid(neuron_bundle):
    bundle, env = neuron_bundle.bundle, neuron_bundle.env
    out = _cli(env, "inspect", str(bundle), "--vllm-config")
    assert out.returncode == 0, out.stderr
    nc = json.loads(out.stdout)["neuron_config"]
    assert nc == {"num_seqs_buckets": [1, 2], "decode_context_length_buckets": [128], "gk_decode": True,
                  "fp8_packed_kv": False, "lnc": 2}
    assert f"--max-model-len 512 --max-num-seqs 2 --block-size 16 --num-gpu-blocks-override {POOL}" in out.stderr
    manifest = json.loads(_cli(env, "inspect", str(bundle), "--json").stdout)
    engine = {t.label for t in enumerate_targets(nc["num_seqs_buckets"], nc["decode_context_length_buckets"], 512)}
    assert engine == {a["label"] for a in manifest["artifacts"]}
    doc = json.loads(_cli(env, "inspect", str(bundle), "--vllm-config", "--json").stdout)
    assert doc["additional_config"] == {"neuron_config": nc} and doc["speculative_config"] is None
    assert doc["engine_args"]["max_model_len"] == 512


def _manifest(ctx, k=0):
    return {"graph_inputs": {"num_seqs_buckets": [1, 4], "decode_context_length_buckets": ctx, "fp8_packed_kv": True,
                             "lnc": 1, "num_speculative_tokens": k, "max_model_len": 4096, "block_size": 16,
                             "num_blocks": 900, "tp": 1, "dp": 2} | ({"speculative_method": "eagle3"} if k else {})}


def test_fallback_only_bundle_leaves_context_buckets_out_and_eagle3_goes_to_speculative_config():
    recipe = {"speculative": {"method": "eagle3", "draft": {"checkpoint": "/ckpt/draft"}}}
    config = handoff.vllm_config(_manifest([], k=3), recipe)
    assert "decode_context_length_buckets" not in config["additional_config"]["neuron_config"]  # vLLM: feature off
    assert config["speculative_config"] == {"method": "eagle3", "num_speculative_tokens": 3, "model": "/ckpt/draft"}
    flags = handoff.vllm_flags(config)
    assert "--data-parallel-size 2" in flags and "--speculative-config '{\"method\": \"eagle3\"" in flags


def test_random_draft_keeps_the_model_key_and_says_what_vllm_lacks():
    recipe = {"speculative": {"method": "eagle3", "draft": {"random_seed": 1}}}
    config = handoff.vllm_config(_manifest([128], k=3), recipe)
    assert config["speculative_config"] == {"method": "eagle3", "model": None, "num_speculative_tokens": 3}
    [warning] = config["warnings"]
    assert "speculative_config.model" in warning and "random_seed: 1" in warning
    assert "speculative.draft.checkpoint" in warning
    assert handoff.vllm_config(_manifest([128]), {})["warnings"] == []  # no speculation: nothing missing


def test_vllm_config_of_a_cpu_bundle_is_the_whole_vllm_serve_line_for_the_plugin(built):
    """The line starts vLLM on the bundle folder alone: its config.json, no weights to load (the plugin computes
    with the bundle's), the bundle's dtypes, grid and pool, and KV memory sized from the pool (no host fraction)."""
    out = cli("inspect", str(built.bundle), "--vllm-config")
    assert out.returncode == 0, out.stderr
    [line] = out.stdout.strip().splitlines()
    root = str(built.bundle.resolve())
    pool_bytes = -(-2 * POOL * 2 * 16 * 16 * 4 // 2**20) * 2**20  # one buffer: K and V x pool x heads x bs x d x 4
    assert line.startswith(f"PROMETHEUS_MULTIPROC_DIR=$(mktemp -d) vllm serve {root} ")
    assert (f"--dtype float32 --enforce-eager --load-format dummy --skip-tokenizer-init --max-model-len 512 "
            f"--max-num-seqs 4 --block-size 16 --num-gpu-blocks-override {POOL} --tensor-parallel-size 1 "
            f"--data-parallel-size 1 --kv-cache-memory-bytes {pool_bytes} "
            f"--additional-config '{{\"neffbuild\": {{\"bundle\": \"{root}\"}}}}'") in line
    doc = json.loads(cli("inspect", str(built.bundle), "--vllm-config", "--json").stdout)
    assert doc["additional_config"] == {"neffbuild": {"bundle": root}} and doc["command"] == line
    assert doc["model"] == root and doc["engine_args"]["num_gpu_blocks_override"] == POOL
    [warning] = doc["warnings"]
    assert "no tokenizer" in warning and "--tokenizer" in warning
    hf = json.loads((built.bundle / "config.json").read_text())  # what vLLM reads of the model: the bundle's own
    manifest = json.loads((built.bundle / "manifest.json").read_text())
    assert hf["architectures"] == ["GptOssForCausalLM"] and hf["torch_dtype"] == "float32"
    assert {k: hf[k] for k in manifest["graph_inputs"]["model_config"]} == manifest["graph_inputs"]["model_config"]
    assert "config.json" in manifest["files"]  # listed and checksummed like every file
