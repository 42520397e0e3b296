"""Every decode row through an artifact under a streaming load: requests arrive staggered while others decode,
long prompts are chunked (``--max-num-batched-tokens``), so most forwards mix prefill chunks with decode rows;
the decode rows run the artifact of their own batch bucket beside vLLM's eager model for the chunks, and each
request's tokens equal the same request served alone. vLLM is started with exactly the settings ``neffbuild
inspect --vllm-config --json`` prints (its KV memory from the bundle's pool: no VLLM_CPU_KVCACHE_SPACE), plus
vLLM's own flags for the port, the chunk size and the plugin's report."""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers import build_bundle, cli
from tests.vllm_helpers import (
    BATCH_BUCKETS,
    CTX_BUCKETS,
    MAX_MODEL_LEN,
    SKIP_REASON,
    Server,
    free_port,
    have_vllm,
    save_checkpoint,
    serve_argv,
    vllm_env,
    write_recipe,
)

pytestmark = [pytest.mark.skipif(not have_vllm(), reason=SKIP_REASON), pytest.mark.slow]

CHUNK = 256  # prompts over it are chunked: most forwards mix prefill chunks with decode rows
N_REQUESTS = 20


def _requests() -> list[dict]:
    rng = random.Random(7)
    out = []
    for _ in range(N_REQUESTS):
        n = rng.randrange(50, MAX_MODEL_LEN - 40)  # with its max_tokens, within max_model_len
        out.append({"prompt": [rng.randrange(512) for _ in range(n)], "max_tokens": rng.randrange(8, 33),
                    "delay": rng.expovariate(4.0)})  # Poisson arrivals, 4 requests/s
    return out


@pytest.fixture(scope="module")
def vllm_stream(tmp_path_factory, build_cache, compile_pool):
    folder = tmp_path_factory.mktemp("vllm-stream")
    checkpoint = save_checkpoint(folder / "ckpt")
    # the serve module's recipe (both batch buckets, a context bucket and the fallback): its graphs, so the session
    # cache holds them (the serve and DI modules compile them; this module's build is hits, or compiles them first)
    recipe = write_recipe(folder, checkpoint, name="gpt-oss-stream")
    bundle = build_bundle(folder, build_cache, recipe, executor=compile_pool).bundle
    doc = json.loads(cli("inspect", str(bundle), "--vllm-config", "--json").stdout)
    assert doc["engine_args"]["kv_cache_memory_bytes"] > 0 and "VLLM_CPU_KVCACHE_SPACE" not in doc["env"]
    argv = [*serve_argv(doc["model"], doc["engine_args"], doc["additional_config"], free_port()),
            "--max-num-batched-tokens", str(CHUNK), "--worker-extension-cls", "neffbuild.vllm.model.WorkerReport"]
    server = Server(argv, folder / "serve.log", vllm_env(VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE=None))
    requests = _requests()
    try:
        server.wait_ready()

        def arrive(i):
            time.sleep(sum(r["delay"] for r in requests[: i + 1]))
            return server.complete(requests[i]["prompt"], requests[i]["max_tokens"])

        with ThreadPoolExecutor(N_REQUESTS) as pool:
            streamed = list(pool.map(arrive, range(N_REQUESTS)))
        report = server.rpc("neffbuild_report")[0]
        alone = [server.complete(r["prompt"], r["max_tokens"]) for r in requests[:6]]  # one at a time
        yield requests, streamed, report, alone
    finally:
        server.stop()


def test_every_decode_row_of_a_streaming_load_runs_an_artifact(vllm_stream):
    requests, _, report, _ = vllm_stream
    decode_rows = sum(r["max_tokens"] - 1 for r in requests)
    assert set(report["rows"]) == {"artifact"}, report["rows"]  # no decode row ran eagerly
    # one-token rows: every decode row, plus any one-token last chunk of a prompt (the same computation)
    assert report["rows"]["artifact"] >= decode_rows
    assert report["forwards"]["mixed"] > 0  # the load did mix prefill chunks with decode rows
    labels = set(report["steps"])
    assert labels and labels <= {f"decode_b{b}_ctx{c}" for b in BATCH_BUCKETS for c in (*CTX_BUCKETS, MAX_MODEL_LEN)}, \
        labels


def test_streamed_tokens_equal_the_same_requests_served_alone(vllm_stream):
    requests, streamed, _, alone = vllm_stream
    assert [len(t) for t in streamed] == [r["max_tokens"] for r in requests]
    assert streamed[: len(alone)] == alone
