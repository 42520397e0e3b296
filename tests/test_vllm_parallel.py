"""Sharded bundles inside vLLM: each vLLM worker serves its own rank's artifacts and weight shard over the plugin's
twin groups of vLLM's ranks (neffbuild/vllm/ranks.py), with the settings `neffbuild inspect --vllm-config` prints.

- tp 2 (one DP rank): `vllm serve` with the printed line (its VLLM_CPU_OMP_THREADS_BIND included) answers six
  concurrent greedy requests with the tokens of vLLM's native GPT-OSS at tp 2 on the same checkpoint; both ranks
  ran the same artifact labels step for step (the per-rank metrics); `--tensor-parallel-size 1` against the
  bundle stops start-up in one line naming the flag and both values.
- `neffbuild generate` on each bundle (its own engine and ranks) gives the tokens vLLM served.
- dp 2 with expert parallel (ep 2: the MoE gathers the two DP ranks' tokens): the same six requests, then the
  seeds' case: one request alone (one DP rank idle, running vLLM's dummy batch) decoding across the 128 context
  bucket gives the tokens of vLLM native at dp 2 / ep 2 (vLLM's own GPT-OSS, with the two DP collectives vLLM
  0.32's CPU communicator lacks and its CPU experts' ignored expert map filled in:
  tests/vllm_scripts/dp_ep_collectives.py) and, for the one alone, of the
  tp 2 (dp 1) bundle; nothing hangs, and both ranks ran the same labels step for step, the idle one included.

vLLM runs from its own venv (tests/vllm_helpers.py). The module starts vLLM once per configuration (native tp 2
and dp 2 / ep 2, the plugin at tp 2 and at dp 2, the refused start); its tests run on one xdist worker
(tests/conftest.py groups `vllm_parallel`). Each bundle is 2 graphs: batch bucket 4 x (context bucket 128 + the
fallback 512).
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

# Both dp 2 servers start at once (dp2_runs): seven vLLM processes each, on a 2-core host whose other xdist workers
# are busy. Measured in a full run: the plugin's API servers came up 4 minutes after its start, past the 300 s a
# single start is given; its tests then have more than pytest's 600 s a test (the module fixture's setup is theirs).
START_LIMIT = 480
pytestmark = [pytest.mark.skipif(not have_vllm(), reason=SKIP_REASON), pytest.mark.timeout(900)]

# (prompt length, max_tokens): more requests than the batch bucket (4); decode steps in both context buckets.
SHAPES = [(5, 40), (100, 60), (37, 20), (130, 30), (9, 90), (60, 50)]
ALONE = (100, 60)  # the seeds' case, served alone after the six: positions 100..159 cross the 128 bucket
SCRIPT = "tests/vllm_scripts/generate.py"
FILL_IN = "tests.vllm_scripts.dp_ep_collectives.NativeDpEp"


@pytest.fixture(scope="module")
def vllm_parallel(tmp_path_factory, build_cache, compile_pool):
    folder = tmp_path_factory.mktemp("vllm_parallel")
    checkpoint = save_checkpoint(folder / "ckpt")
    tp2 = build_bundle(folder / "tp2", build_cache,
                       _recipe(folder / "tp2", checkpoint, "gpt-oss-vllm-tp2", {"tp": 2}),
                       executor=compile_pool).bundle
    dp2 = build_bundle(folder / "dp2", build_cache,
                       _recipe(folder / "dp2", checkpoint, "gpt-oss-vllm-dp2", {"dp": 2, "ep": 2}),
                       executor=compile_pool).bundle
    rng = random.Random(1)
    requests = [{"prompt": [rng.randrange(512) for _ in range(n)], "max_tokens": m} for n, m in [*SHAPES, ALONE]]
    (folder / "requests.json").write_text(json.dumps(requests))
    return folder, checkpoint, {"tp2": tp2, "dp2": dp2}, requests


def _recipe(folder, checkpoint, name: str, parallel: dict):
    folder.mkdir(exist_ok=True)
    return write_recipe(folder, checkpoint, name=name, num_seqs_buckets=(4,), ctx_buckets=(128,), parallel=parallel)


def _printed(bundle) -> dict:
    return json.loads(cli("inspect", str(bundle), "--vllm-config", "--json").stdout)


def _native_tp2(folder, checkpoint) -> list[list[int]]:
    """vLLM's own GPT-OSS at tp 2 on the checkpoint (``vllm.LLM``), no plugin loaded (VLLM_PLUGINS="")."""
    res = run_vllm_script(SCRIPT, ["--model", str(checkpoint), "--requests", str(folder / "requests.json"),
                                   "--tensor-parallel-size", "2"],
                          VLLM_PLUGINS="", VLLM_CPU_OMP_THREADS_BIND=cpu_binding(2))
    assert res.returncode == 0, res.stderr[-4000:]
    return python_json(res.stdout)["tokens"]


def _serve(folder, bundle, name: str, requests: list[dict]):
    """`vllm serve` with the printed line (its env too): every request but the last at once, then the last alone;
    the tokens, /metrics before and after the last, and the workers' reports (vLLM's dev-mode /collective_rpc to
    the plugin's worker extension: every TP worker of the first DP rank)."""
    return _drive(plugin_server(folder, bundle, name), requests, "neffbuild_report", settle=True)


def plugin_server(folder, bundle, name: str) -> Server:
    """`vllm serve` of the bundle with the printed line and env, the plugin's worker report, vLLM's dev mode."""
    doc = _printed(bundle)
    multiproc = folder / f"prom-{name}"
    multiproc.mkdir()
    argv = [*serve_argv(doc["model"], doc["engine_args"], doc["additional_config"], free_port()),
            "--worker-extension-cls", "neffbuild.vllm.model.WorkerReport"]
    env = {k: v for k, v in doc["env"].items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    return Server(argv, folder / f"{name}.log", vllm_env(PROMETHEUS_MULTIPROC_DIR=str(multiproc),
                                                         VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE=None, **env))


def native_server(folder, checkpoint, bundle, name: str) -> Server:
    """vLLM's own GPT-OSS on the checkpoint (no plugin: VLLM_PLUGINS="") with the bundle's printed parallel and
    serving settings (its weights loaded, not dummy), and the oracle's fill-ins for dp 2 / ep 2 on CPU: the two DP
    collectives vLLM 0.32's CPU communicator lacks, the expert map its CPU experts ignore
    (tests/vllm_scripts/dp_ep_collectives.py; inert at tp 2)."""
    doc = _printed(bundle)
    args = {k: v for k, v in doc["engine_args"].items() if k != "load_format"}
    argv = [*serve_argv(checkpoint, args, None, free_port()), "--worker-extension-cls", FILL_IN,
            "--api-server-count", "1"]  # vLLM's default at dp 2 is 2 API server processes: 1 starts sooner
    return Server(argv, folder / f"{name}.log",
                  vllm_env(VLLM_PLUGINS="", VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE=None,
                           VLLM_CPU_OMP_THREADS_BIND=doc["env"]["VLLM_CPU_OMP_THREADS_BIND"]))


def _drive(server: Server, requests: list[dict], rpc: str, settle: bool):
    """Every request but the last at once, then the last alone: (tokens, /metrics after, ``rpc``'s results,
    /metrics before the last); ``settle``: wait for the plugin's per-rank step counters to stop between."""
    try:
        server.wait_ready(START_LIMIT)
        *together, alone = requests
        with ThreadPoolExecutor(len(together)) as pool:
            tokens = list(pool.map(lambda r: server.complete(r["prompt"], r["max_tokens"]), together))
        before = _settled(server) if settle else server.metrics()
        tokens.append(server.complete(alone["prompt"], alone["max_tokens"]))
        return tokens, _settled(server) if settle else server.metrics(), server.rpc(rpc), before
    finally:
        server.stop()


def _settled(server, limit: float = 30) -> str:
    """/metrics once the ranks stopped stepping: DP ranks run a few idle steps after the last request ends, and a
    scrape between two ranks' steps would see one rank a step ahead."""
    import time

    def steps(text: str):
        return prom_samples(text, "neffbuild_vllm_artifact_steps_total"), \
            prom_samples(text, "neffbuild_vllm_step_digest")

    end, last = time.monotonic() + limit, server.metrics()
    while time.monotonic() < end:
        time.sleep(1)
        now = server.metrics()
        if steps(now) == steps(last):
            return now
        last = now
    raise AssertionError(f"the ranks still stepped {limit} s after the last request")


@pytest.fixture(scope="module")
def tp2_runs(vllm_parallel):
    """The plugin's tp 2 server starts, vLLM native's tp 2 run goes beside its start-up (their start-ups overlap:
    a vLLM start leaves the host's CPUs idle much of the time), then the requests go to the plugin's server."""
    folder, checkpoint, bundles, requests = vllm_parallel
    server = plugin_server(folder, bundles["tp2"], "tp2")
    try:
        native = _native_tp2(folder, checkpoint)
    except BaseException:
        server.stop()
        raise
    return _drive(server, requests, "neffbuild_report", settle=True), native


@pytest.fixture(scope="module")
def served_tp2(tp2_runs):
    return tp2_runs[0]


@pytest.fixture(scope="module")
def native_tp2(tp2_runs):
    return tp2_runs[1]


def test_the_printed_settings_of_a_tp2_bundle_start_vllm_at_tp2_bound_one_part_of_the_cpus_per_rank(vllm_parallel):
    doc = _printed(vllm_parallel[2]["tp2"])
    assert doc["engine_args"]["tensor_parallel_size"] == 2 and doc["engine_args"]["data_parallel_size"] == 1
    assert "enable_expert_parallel" not in doc["engine_args"]  # ep 1: every rank holds every expert
    assert len(doc["env"]["VLLM_CPU_OMP_THREADS_BIND"].split("|")) == 2
    assert "VLLM_CPU_OMP_THREADS_BIND='" in doc["command"]  # quoted: "0|1" is a pipe to a shell


def test_tp2_serves_six_concurrent_requests_with_vllm_natives_tokens_at_tp2(served_tp2, native_tp2):
    tokens, *_ = served_tp2
    assert tokens == native_tp2


def test_both_tp_ranks_ran_their_own_shard_and_the_same_artifacts_step_for_step(served_tp2, vllm_parallel):
    _, metrics, reports, _ = served_tp2
    assert sorted(r["rank"] for r in reports) == [0, 1]
    assert all(r["kv_shapes"] == [[2, 128, 1, 32, 64]] for r in reports)  # one of the 2 KV heads per rank
    assert reports[0]["steps"] == reports[1]["steps"] and reports[0]["step_digest"] == reports[1]["step_digest"]
    decode_rows = sum(r["max_tokens"] - 1 for r in vllm_parallel[3])  # the six and the one alone
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


@pytest.fixture(scope="module")
def dp2_runs(vllm_parallel):
    """The plugin's dp 2 run, then vLLM native's at dp 2 / ep 2 (tokens and the fill-in's report from DP rank 0's
    worker), the same requests. The native server starts with the plugin's, so their start-ups overlap (a vLLM
    start leaves the host's CPUs idle much of the time); the requests go to one server, then the other."""
    folder, checkpoint, bundles, requests = vllm_parallel
    native = native_server(folder, checkpoint, bundles["dp2"], "native-dp2")
    try:
        plugin = _serve(folder, bundles["dp2"], "dp2", requests)
        tokens, _, reports, _ = _drive(native, requests, "dp_ep_fill_in", settle=False)
    finally:
        native.stop()
    return plugin, (tokens, reports)


@pytest.fixture(scope="module")
def served_dp2(dp2_runs):
    return dp2_runs[0]


@pytest.fixture(scope="module")
def native_dp2(dp2_runs):
    return dp2_runs[1]


def _per_rank(metrics: str, name: str, key: str = "label") -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for labels, v in prom_samples(metrics, name).items():
        d = dict(labels)
        out.setdefault(d["rank"], {})[d.get(key, "")] = v
    return out


def test_the_printed_settings_of_a_dp2_ep2_bundle_start_vllm_with_expert_parallel(vllm_parallel):
    doc = _printed(vllm_parallel[2]["dp2"])
    args = doc["engine_args"]
    assert (args["tensor_parallel_size"], args["data_parallel_size"], args["enable_expert_parallel"]) == (1, 2, True)
    assert "--enable-expert-parallel" in doc["command"] and len(doc["env"]["VLLM_CPU_OMP_THREADS_BIND"].split("|")) == 2


def test_dp2_ep2_serves_vllm_natives_tokens_at_dp2_ep2_and_the_one_alone_the_dp1_bundles(served_dp2, served_tp2,
                                                                                       native_dp2):
    tokens, *_ = served_dp2
    native, reports = native_dp2
    assert tokens == native  # the six together, then the seeds' case alone (one DP rank idle)
    # vLLM's own MoE ran at dp 2 / ep 2: in every step (DP rank 0 busy or idle) its dispatch gathered both DP
    # ranks' tokens, its experts ran on the rank's half (the expert map) and its combine summed over the ranks
    assert reports[0]["filled"] == ["all_gatherv", "reduce_scatterv", "expert_map"], reports
    assert min(reports[0]["calls"].get(k, 0) for k in reports[0]["filled"]) >= ALONE[1], reports
    assert tokens[-1] == served_tp2[0][-1]  # the same request alone on the dp 1 (tp 2) bundle


@pytest.mark.parametrize("name", ["tp2", "dp2"])
def test_neffbuild_generate_on_each_sharded_bundle_gives_the_tokens_vllm_served(vllm_parallel, served_tp2, served_dp2,
                                                                              name):
    """The second oracle: neffbuild's own engine on the same bundle (its ranks over its own gloo world), each
    request with its own max_new_tokens."""
    folder, _, bundles, requests = vllm_parallel
    path = folder / f"requests-{name}.jsonl"
    path.write_text("".join(json.dumps({"prompt_ids": r["prompt"], "max_new_tokens": r["max_tokens"]}) + "\n"
                            for r in requests))
    res = cli("generate", str(bundles[name]), "--requests", str(path), "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    served = {"tp2": served_tp2, "dp2": served_dp2}[name][0]
    assert json.loads(res.stdout)["tokens"] == served


def test_both_dp_ranks_ran_the_same_artifacts_step_for_step_the_idle_one_included(served_dp2):
    _, metrics, _, before = served_dp2
    steps, earlier = (_per_rank(m, "neffbuild_vllm_artifact_steps_total") for m in (metrics, before))
    assert set(steps) == {"0", "1"} and steps["0"] == steps["1"]
    digests = {dict(k)["rank"]: v for k, v in prom_samples(metrics, "neffbuild_vllm_step_digest").items()}
    assert len(digests) == 2 and digests["0"] == digests["1"]  # the same labels in the same order
    # the request alone: both ranks stepped through both context buckets together, one of them idle throughout
    alone = {rank: {k: v - earlier[rank].get(k, 0) for k, v in steps[rank].items()} for rank in steps}
    assert alone["0"] == alone["1"] and {k for k, v in alone["0"].items() if v} == {"decode_b4_ctx128",
                                                                                   "decode_b4_ctx512"}
    forwards, forwards_before = (_per_rank(m, "neffbuild_vllm_forwards_total", "kind") for m in (metrics, before))
    idle = {rank: forwards[rank].get("idle", 0) - forwards_before[rank].get("idle", 0) for rank in forwards}
    assert max(idle.values()) >= ALONE[1] - 1 > min(idle.values()), forwards  # the busy rank: at most a few
