"""vLLM serves the deployment's bundles from the bundle alone: bf16 weights with MXFP4 experts compiled from an
MXFP4 checkpoint, with bf16 KV and with packed-FP8 KV. vLLM starts on the bundle folder with exactly what
``neffbuild inspect BUNDLE --vllm-config --json`` prints, after the checkpoint folder was moved away, and six
concurrent greedy requests give the tokens ``neffbuild generate`` gives on the same bundle. A flag that
disagrees with the bundle's dtypes stops vLLM's start-up with one line naming it.

vLLM CPU 0.32 cannot serve the MXFP4 checkpoint itself on a CPU without AMX ("No MXFP4 MoE backend"): the
plugin computes everything with the bundle's own weights (neffbuild/vllm/model.py)."""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers import build_bundle, cli
from tests.mxfp4_checkpoint import write_mxfp4_checkpoint
from tests.vllm_helpers import (
    SKIP_REASON,
    Server,
    free_port,
    have_vllm,
    serve_argv,
    target_config,
    vllm_env,
    write_recipe,
)

pytestmark = [pytest.mark.skipif(not have_vllm(), reason=SKIP_REASON), pytest.mark.slow]

SHAPES = [(5, 24), (100, 16), (37, 30), (200, 12), (9, 20), (60, 28)]  # (prompt length, max_tokens)
FORMS = {"bf16-kv": {"kv_dtype": "bfloat16"}, "fp8-kv": {"fp8_packed_kv": True}}


def _prompts():
    return [[(7 * i + 13 * n) % 512 for i in range(n)] for n, _ in SHAPES]


@pytest.fixture(scope="module")
def vllm_dtype_bundles(tmp_path_factory, build_cache, compile_pool):
    """Two bundles of one MXFP4 checkpoint (batch bucket 4 and the fallback context only, one graph each: a bucket
    of max_model_len folds into it; choosing among buckets inside vLLM is test_vllm_serve's), then the checkpoint
    folder moved away: the serving host has the vllm_dtype_bundles."""
    folder = tmp_path_factory.mktemp("vllm-dtypes")
    checkpoint = write_mxfp4_checkpoint(folder / "ckpt", target_config())
    out = {}
    for name, neuron in FORMS.items():
        recipe = write_recipe(folder, checkpoint, name=f"mxfp4-{name}", num_seqs_buckets=(4,), ctx_buckets=(512,),
                              neuron=neuron)
        out[name] = build_bundle(folder, build_cache, recipe, executor=compile_pool).bundle
    checkpoint.rename(folder / "moved-away")
    return folder, out


def _generate(bundle, folder) -> list[list[int]]:
    """``neffbuild generate`` on the same requests (a request file: each its own max_new_tokens)."""
    path = folder / "requests.jsonl"
    path.write_text("".join(json.dumps({"prompt_ids": p, "max_new_tokens": m}) + "\n"
                            for p, (_, m) in zip(_prompts(), SHAPES, strict=True)))
    res = cli("generate", str(bundle), "--requests", str(path), "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout)["tokens"]


@pytest.mark.parametrize("form", list(FORMS))
def test_vllm_serves_the_bundle_alone_with_generates_tokens(vllm_dtype_bundles, form):
    folder, built = vllm_dtype_bundles
    bundle = built[form]
    doc = json.loads(cli("inspect", str(bundle), "--vllm-config", "--json").stdout)
    args = doc["engine_args"]
    assert doc["model"] == str(bundle.resolve()) and args["load_format"] == "dummy"
    assert (args["dtype"], args.get("kv_cache_dtype", "auto")) == ("bfloat16", "fp8" if form == "fp8-kv" else "auto")
    server = Server(serve_argv(doc["model"], args, doc["additional_config"], free_port()) +
                    ["--worker-extension-cls", "neffbuild.vllm.model.WorkerReport"], folder / f"{form}.log",
                    vllm_env(VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE=None))
    try:
        server.wait_ready()
        with ThreadPoolExecutor(len(SHAPES)) as pool:
            tokens = list(pool.map(lambda pm: server.complete(pm[0], pm[1]),
                                   zip(_prompts(), [m for _, m in SHAPES], strict=True)))
        report = server.rpc("neffbuild_report")[0]
    finally:
        server.stop()
    assert tokens == _generate(bundle, folder)
    assert report["rows"] == {"artifact": sum(m - 1 for _, m in SHAPES)}
    assert report["prefill_tokens"] == sum(n for n, _ in SHAPES)
    assert report["kv_shapes"] == [[2, 128, 2, 32, 64]]


@pytest.mark.parametrize(("form", "flag", "value", "needle"), [
    ("fp8-kv", "kv_cache_dtype", "auto", "--kv-cache-dtype: vLLM has kv_cache_dtype 'auto', the bundle was compiled "
                                         "for 'fp8'"),
    ("bf16-kv", "dtype", "float32", "--dtype: vLLM has dtype 'float32', the bundle was compiled for 'bfloat16'"),
])
def test_a_dtype_flag_that_disagrees_stops_start_up_in_one_line(vllm_dtype_bundles, form, flag, value, needle):
    _, built = vllm_dtype_bundles
    doc = json.loads(cli("inspect", str(built[form]), "--vllm-config", "--json").stdout)
    argv = serve_argv(doc["model"], {**doc["engine_args"], flag: value}, doc["additional_config"], free_port())
    res = subprocess.run(argv, env=vllm_env(VLLM_CPU_KVCACHE_SPACE=None), capture_output=True, text=True,
                         timeout=180)
    assert res.returncode != 0 and needle in res.stderr, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
