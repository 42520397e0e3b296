"""Sharded bundles inside vLLM: each vLLM worker serves its own rank's artifacts and weight shard over the plugin's
twin groups of vLLM's ranks (neffbuild/vllm/ranks.py), with the settings `neffbuild inspect --vllm-config` prints.

- tp 2 (one DP rank): `vllm serve` with the printed line (its VLLM_CPU_OMP_THREADS_BIND included) answers six
  concurrent greedy requests with the tokens of vLLM's native GPT-OSS at tp 2 on the same checkpoint; both ranks
  ran the same artifact labels step for step (the per-rank metrics); `--tensor-parallel-size 1` against the
  bundle stops start-up in one line naming the flag and both values.

vLLM runs from its own venv (tests/vllm_helpers.py). The module starts vLLM once per configuration (native tp 2,
the plugin at tp 2, the refused start); its tests run on one xdist worker (tests/conftest.py groups
`vllm_parallel`). Each bundle is 2 graphs: batch bucket 4 x (context bucket 128 + the fallback 512).
"""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from neffbuild.bundle.handoff import cpu_binding
from tests.helpers import build_bundle, cli
from tests.vllm_helpers import (
    SKIP_REASON,
    Server,
    free_port,
    have_vllm,
    prom_samples,
    python_json,
    run_vllm_script,
    save_checkpoint,
    serve_argv,
    start_refused,
    vllm_env,
    write_recipe,
)

pytestmark = pytest.mark.skipif(not have_vllm(), reason=SKIP_REASON)

# (prompt length, max_tokens): more requests than the batch bucket (4); decode steps in both context buckets.
SHAPES = [(5, 40), (100, 60), (37, 20), (130, 30), (9, 90), (60, 50)]
SCRIPT = "tests/vllm_scripts/generate.py"


@pytest.fixture(scope="module")
def vllm_parallel(tmp_path_factory, build_cache, compile_pool):
    folder = tmp_path_factory.mktemp("vllm_parallel")
    checkpoint = save_checkpoint(folder / "ckpt")
    tp2 = build_bundle(folder / "tp2", build_cache,
                       _recipe(folder / "tp2", checkpoint, "gpt-oss-vllm-tp2", {"tp": 2}),
                       executor=compile_pool).bundle
    rng = random.Random(1)
    requests = [{"prompt": [rng.randrange(512) for _ in range(n)], "max_tokens": m} for n, m in SHAPES]
    (folder / "requests.json").write_text(json.dumps(requests))
    return folder, checkpoint, {"tp2": tp2}, requests


def _recipe(folder, checkpoint, name: str, parallel: dict):
    folder.mkdir(exist_ok=True)
    return write_recipe(folder, checkpoint, name=name, num_seqs_buckets=(4,), ctx_buckets=(128,), parallel=parallel)


def _printed(bundle) -> dict:
    return json.loads(cli("inspect", str(bundle), "--vllm-config", "--json").stdout)


@pytest.fixture(scope="module")
def native_tp2(vllm_parallel):
    """vLLM's own GPT-OSS at tp 2 on the checkpoint, no plugin loaded (VLLM_PLUGINS="")."""
    folder, checkpoint, _, _ = vllm_parallel
    res = run_vllm_script(SCRIPT, ["--model", str(checkpoint), "--requests", str(folder / "requests.json"),
                                   "--tensor-parallel-size", "2"],
                          VLLM_PLUGINS="", VLLM_CPU_OMP_THREADS_BIND=cpu_binding(2))
    assert res.returncode == 0, res.stderr[-4000:]
    return python_json(res.stdout)["tokens"]


def _serve(folder, bundle, name: str, requests: list[dict]):
    """`vllm serve` with the printed line (its env too): every request at once, then /metrics and every worker's
    report (vLLM's dev-mode /collective_rpc to the plugin's worker extension)."""
    doc = _printed(bundle)
    multiproc = folder / f"prom-{name}"
    multiproc.mkdir()
    argv = [*serve_argv(doc["model"], doc["engine_args"], doc["additional_config"], free_port()),
            "--worker-extension-cls", "neffbuild.vllm.model.WorkerReport"]
    env = {k: v for k, v in doc["env"].items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    server = Server(argv, folder / f"{name}.log", vllm_env(PROMETHEUS_MULTIPROC_DIR=str(multiproc),
                                                           VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE=None,
                                                           **env))
    try:
        server.wait_ready()
        with ThreadPoolExecutor(len(requests)) as pool:
            tokens = list(pool.map(lambda r: server.complete(r["prompt"], r["max_tokens"]), requests))
        return tokens, server.metrics(), server.rpc("neffbuild_report")
    finally:
        server.stop()


@pytest.fixture(scope="module")
def served_tp2(vllm_parallel):
    folder, _, bundles, requests = vllm_parallel
    return _serve(folder, bundles["tp2"], "tp2", requests)


def test_the_printed_settings_of_a_tp2_bundle_start_vllm_at_tp2_bound_one_part_of_the_cpus_per_rank(vllm_parallel):
    doc = _printed(vllm_parallel[2]["tp2"])
    assert doc["engine_args"]["tensor_parallel_size"] == 2 and doc["engine_args"]["data_parallel_size"] == 1
    assert "enable_expert_parallel" not in doc["engine_args"]  # ep 1: every rank holds every expert
    assert len(doc["env"]["VLLM_CPU_OMP_THREADS_BIND"].split("|")) == 2
    assert "VLLM_CPU_OMP_THREADS_BIND='" in doc["command"]  # quoted: "0|1" is a pipe to a shell


def test_tp2_serves_six_concurrent_requests_with_vllm_natives_tokens_at_tp2(served_tp2, native_tp2):
    tokens, _, _ = served_tp2
    assert tokens == native_tp2


def test_both_tp_ranks_ran_their_own_shard_and_the_same_artifacts_step_for_step(served_tp2, vllm_parallel):
    _, metrics, reports = served_tp2
    assert sorted(r["rank"] for r in reports) == [0, 1]
    assert all(r["kv_shapes"] == [[2, 128, 1, 32, 64]] for r in reports)  # one of the 2 KV heads per rank
    assert reports[0]["steps"] == reports[1]["steps"] and reports[0]["step_digest"] == reports[1]["step_digest"]
    decode_rows = sum(r["max_tokens"] - 1 for r in vllm_parallel[3])
    assert all(r["rows"] == {"artifact": decode_rows} for r in reports)  # every decode row through an artifact
    steps = prom_samples(metrics, "neffbuild_vllm_artifact_steps_total")
    by_rank = {rank: {dict(k)["label"]: v for k, v in steps.items() if dict(k)["rank"] == rank} for rank in "01"}
    assert by_rank["0"] == by_rank["1"] == reports[0]["steps"]  # /metrics: per rank, the same counts
    digests = {dict(k)["rank"]: v for k, v in prom_samples(metrics, "neffbuild_vllm_step_digest").items()}
    assert digests == {"0": reports[0]["step_digest"], "1": reports[0]["step_digest"]}


def test_tp1_against_a_tp2_bundle_stops_start_up_naming_the_flag_and_both_values(vllm_parallel):
    folder, _, bundles, _ = vllm_parallel
    doc, port = _printed(bundles["tp2"]), free_port()
    argv = serve_argv(doc["model"], {**doc["engine_args"], "tensor_parallel_size": 1}, doc["additional_config"], port)
    status, served, elapsed = start_refused(argv, folder / "tp1.log", vllm_env(), port)
    text = (folder / "tp1.log").read_text(errors="replace")
    assert status == 1 and not served and elapsed < 60, text[-3000:]
    assert "--tensor-parallel-size: vLLM has tensor_parallel_size 1, the bundle was compiled for 2 (pass " \
           "--tensor-parallel-size 2)" in text, text[-3000:]
    assert set(re.findall(r"^\((\w+) pid=\d+\)", text, re.M)) <= {"APIServer"}  # refused before any engine started
