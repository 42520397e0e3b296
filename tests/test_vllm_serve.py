"""vLLM serves a bundle: `vllm serve` with the plugin over HTTP, token for token with vLLM's native GPT-OSS and
with transformers; every plain decode step ran through an artifact, on vLLM's own KV tensors.

vLLM runs from its own venv (tests/vllm_helpers.py); the module starts vLLM twice: one `vllm serve` with the
plugin (the command line `neffbuild inspect --vllm-config` prints, plus vLLM's worker extension for the plugin's
report, read over vLLM's dev-mode `/collective_rpc`) and one native `vllm.LLM` (VLLM_PLUGINS="": no plugin
loaded at all). Its tests run on one xdist worker (tests/conftest.py groups `vllm_setup`), so each starts once.
The bundle is 4 graphs: batch buckets 2 and 4 x (context bucket 128 + the fallback 512).
"""

from __future__ import annotations

import json
import random

import pytest

from tests.helpers import build_bundle, cli
from tests.vllm_helpers import (
    BATCH_BUCKETS,
    SKIP_REASON,
    Server,
    free_port,
    have_vllm,
    prom_samples,
    python_json,
    run_vllm_script,
    save_checkpoint,
    serve_argv,
    transformers_greedy,
    vllm_env,
    write_recipe,
)

pytestmark = pytest.mark.skipif(not have_vllm(), reason=SKIP_REASON)

# (prompt length, max_tokens): more requests than the largest batch bucket (4); prompts below and above the
# context bucket (128), so decode steps need both context buckets; the batch shrinks from 4 to 1 as they end.
SHAPES = [(5, 40), (100, 60), (37, 20), (130, 30), (9, 90), (60, 50)]
SCRIPT = "tests/vllm_scripts/generate.py"


def _requests() -> list[dict]:
    rng = random.Random(1)
    return [{"prompt": [rng.randrange(512) for _ in range(n)], "max_tokens": m} for n, m in SHAPES]


@pytest.fixture(scope="module")
def vllm_setup(tmp_path_factory, build_cache, compile_pool):
    folder = tmp_path_factory.mktemp("vllm")
    checkpoint = save_checkpoint(folder / "ckpt")
    bundle = build_bundle(folder, build_cache, write_recipe(folder, checkpoint), executor=compile_pool).bundle
    requests = _requests()
    (folder / "requests.json").write_text(json.dumps(requests))
    return folder, checkpoint, bundle, requests


@pytest.fixture(scope="module")
def native(vllm_setup):
    """vLLM's own GPT-OSS through vllm.LLM, no plugin loaded (VLLM_PLUGINS="")."""
    folder, checkpoint, _, _ = vllm_setup
    res = run_vllm_script(SCRIPT, ["--model", str(checkpoint), "--requests", str(folder / "requests.json")],
                          VLLM_PLUGINS="", VLLM_ENABLE_V1_MULTIPROCESSING="0")  # one process: no engine-core spawn
    assert res.returncode == 0, res.stderr[-4000:]
    return python_json(res.stdout)


@pytest.fixture(scope="module")
def oracle(vllm_setup):
    _, checkpoint, _, requests = vllm_setup
    return transformers_greedy(checkpoint, [r["prompt"] for r in requests], [r["max_tokens"] for r in requests])


@pytest.fixture(scope="module")
def served(vllm_setup):
    """The module's one `vllm serve` with the plugin: every request at once, then /metrics and the report."""
    folder, _checkpoint, bundle, requests = vllm_setup
    doc = json.loads(cli("inspect", str(bundle), "--vllm-config", "--json").stdout)
    multiproc = folder / "prom"
    multiproc.mkdir()
    argv = [*serve_argv(doc["model"], doc["engine_args"], doc["additional_config"], free_port()),
            "--worker-extension-cls", "neffbuild.vllm.model.WorkerReport"]
    server = Server(argv, folder / "serve.log", vllm_env(PROMETHEUS_MULTIPROC_DIR=str(multiproc),
                                                         VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE=None))
    try:
        server.wait_ready()
        tokens = server.all_at_once(requests)  # one scheduling round: the largest bucket runs on any host load
        yield tokens, server.metrics(), server.rpc("neffbuild_report")[0]
    finally:
        server.stop()


def test_vllm_native_matches_transformers(native, oracle):
    assert native["tokens"] == oracle  # the two references agree on this checkpoint (fp32, greedy)


def test_the_servers_artifacts_ran_on_vllms_own_kv_tensors(served, vllm_setup):
    _, _, report = served
    assert report["enabled"]
    # the artifacts' KV buffers are vLLM's tensors: same storage (layer pair 0/1 shares one tensor), bundle layout
    assert report["stepper_kv_ptrs"] == [report["vllm_kv_ptrs"][0]] == [report["vllm_kv_ptrs"][1]]
    assert report["kv_shapes"] == [[2, 128, 2, 32, 64]]
    decode, mixed = report["forwards"]["decode"], report["forwards"].get("mixed", 0)
    # every all-decode forward ran one artifact, and every forward that mixed decode rows with a prefill ran one
    # for its decode rows (a request joining while others decode), beside vLLM's eager model for the prompt
    assert sum(report["steps"].values()) == decode + mixed and decode > 0 and mixed > 0
    decode_rows = sum(r["max_tokens"] - 1 for r in vllm_setup[3])  # every token after a request's first is a decode row
    assert report["rows"] == {"artifact": decode_rows}  # none ran eagerly


def test_vllm_serve_over_http_gives_native_and_transformers_tokens(served, native, oracle):
    tokens, _, _ = served
    assert len(tokens) > BATCH_BUCKETS[-1]
    assert tokens == native["tokens"] == oracle


def test_every_decode_forward_of_the_server_ran_an_artifact_across_buckets(served, vllm_setup):
    _, metrics, _ = served
    steps = {dict(k)["label"]: v for k, v in prom_samples(metrics, "neffbuild_vllm_artifact_steps_total").items()}
    batches = {label.split("_")[1] for label in steps}
    contexts = {label.split("_")[2] for label in steps}
    assert batches == {"b2", "b4"} and contexts == {"ctx128", "ctx512"}, steps
    forwards = {dict(k)["kind"]: v for k, v in prom_samples(metrics, "neffbuild_vllm_forwards_total").items()}
    assert sum(steps.values()) == forwards["decode"] + forwards.get("mixed", 0)  # each decode row's forward: one
    rows = {dict(k)["path"]: v for k, v in prom_samples(metrics, "neffbuild_vllm_decode_rows_total").items()}
    assert rows == {"artifact": sum(r["max_tokens"] - 1 for r in vllm_setup[3])}
    # the runtime's own counter (per batch bucket) and the needed_seq histogram are on vLLM's /metrics too
    buckets = {dict(k)["bucket"]: v for k, v in prom_samples(metrics, "neffbuild_neff_execution_count_total").items()}
    assert buckets == {"decode_b2": sum(v for k, v in steps.items() if "_b2_" in k),
                       "decode_b4": sum(v for k, v in steps.items() if "_b4_" in k)}
    count = prom_samples(metrics, "neffbuild_decode_needed_seq_count")
    assert sum(count.values()) == sum(steps.values())  # one needed_seq observation per artifact step
    assert "vllm:" in metrics  # vLLM's own metrics are still there, beside the plugin's
