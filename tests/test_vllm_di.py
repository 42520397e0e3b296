"""Disaggregated serving inside vLLM: a prefill instance hands a prompt's KV to a decode instance over vLLM's NIXL
connector in the bundle's layout (neffbuild/vllm/connector.py), through the one-host launcher
(neffbuild/vllm/di.py), token for token with one vLLM instance serving the same bundle.

Run one after another, never two pairs at once (2-core host): the reference instance, then the launcher's pair
(six concurrent completions), then a plain-vLLM prefill instance with a plugin decode instance (the handshake
refuses it). The module's fixture is named ``vllm_setup`` so its tests share test_vllm_serve's xdist group
(tests/conftest.py): one worker runs every vLLM test, one vLLM start at a time.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers import ROOT, build_bundle, cli
from tests.vllm_helpers import (
    BLOCK_SIZE,
    SKIP_REASON,
    VLLM_VENV,
    Server,
    free_port,
    have_vllm,
    save_checkpoint,
    serve_argv,
    vllm_env,
    write_recipe,
)

pytestmark = [pytest.mark.skipif(not have_vllm(), reason=SKIP_REASON), pytest.mark.slow]

# (prompt length, max_tokens): 100-480 tokens (the bundle's max_model_len is 512); 127, 159 and 415 are
# N % block_size == block_size - 1, where the N - 1 rule decides whether a window block is there
SHAPES = [(100, 20), (127, 15), (159, 30), (300, 10), (415, 25), (480, 8)]


def _requests() -> list[dict]:
    rng = random.Random(7)
    return [{"prompt": [rng.randrange(512) for _ in range(n)], "max_tokens": m} for n, m in SHAPES]


def complete(url: str, prompt: list[int], max_tokens: int, timeout: float = 300) -> list[int]:
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "ignore_eos": True, "return_token_ids": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return list(json.loads(r.read())["choices"][0]["token_ids"])


def report(url: str) -> dict:
    req = urllib.request.Request(url + "/collective_rpc", data=json.dumps({"method": "neffbuild_report"}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["results"][0]


@pytest.fixture(scope="module")
def vllm_setup(tmp_path_factory, build_cache, compile_pool):
    folder = tmp_path_factory.mktemp("vllm-di")
    checkpoint = save_checkpoint(folder / "ckpt")
    bundle = build_bundle(folder, build_cache, write_recipe(folder, checkpoint), executor=compile_pool).bundle
    settings = json.loads(cli("inspect", str(bundle), "--vllm-config", "--json").stdout)
    return folder, checkpoint, bundle, settings, _requests()


@pytest.fixture(scope="module")
def reference(vllm_setup):
    """One `vllm serve` with the plugin on the bundle, every request at once (stopped before any pair starts)."""
    folder, _, _, settings, requests = vllm_setup
    argv = serve_argv(settings["model"], settings["engine_args"], settings["additional_config"], free_port())
    server = Server(argv, folder / "reference.log", vllm_env(VLLM_CPU_KVCACHE_SPACE=None))
    try:
        server.wait_ready()
        with ThreadPoolExecutor(len(requests)) as pool:
            return list(pool.map(lambda r: server.complete(r["prompt"], r["max_tokens"]), requests))
    finally:
        server.stop()


@pytest.fixture(scope="module")
def disaggregated(vllm_setup, reference):
    """The launcher's pair and proxy; six concurrent completions through the proxy, then the decode report."""
    folder, _, bundle, _, requests = vllm_setup
    proc = subprocess.Popen(
        [str(VLLM_VENV / "bin" / "python"), "-m", "neffbuild.vllm.di", str(bundle), "--port", "0",
         "--log-dir", str(folder / "di-logs"), "--decode-arg=--worker-extension-cls",
         "--decode-arg=neffbuild.vllm.model.WorkerReport", "--startup-timeout", "400"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        env=vllm_env(VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE=None), start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert "serving" in line, line + proc.stdout.read()[-3000:]
        proxy = line.split(" at ")[1].split("/v1")[0]
        decode = line.split("decode ")[1].split(";")[0]
        with ThreadPoolExecutor(len(requests)) as pool:
            tokens = list(pool.map(lambda r: complete(proxy, r["prompt"], r["max_tokens"]), requests))
        yield tokens, report(decode), proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)


def test_six_concurrent_completions_through_the_pair_give_one_instances_tokens(disaggregated, reference):
    tokens, _, _ = disaggregated
    assert sum(n % BLOCK_SIZE == BLOCK_SIZE - 1 for n, _ in SHAPES) == 3  # the N - 1 rule's edge, three times
    assert [len(t) for t in tokens] == [m for _, m in SHAPES]
    assert tokens == reference


def test_the_decode_instance_ran_no_prefill_and_every_step_through_an_artifact(disaggregated, vllm_setup):
    _, rep, _ = disaggregated
    assert rep["enabled"] and rep["prefill_tokens"] == 0  # the prompts' KV came over NIXL, not from a prefill
    # every token, the first included (the one-token step at position N - 1), came from an artifact
    assert rep["rows"] == {"artifact": sum(m for _, m in SHAPES)}
    assert rep["forwards"] == {"decode": sum(rep["steps"].values())}


def serving(bundle) -> list[str]:
    """Pids of `vllm serve` processes on ``bundle`` (each instance's API server)."""
    return subprocess.run(["pgrep", "-f", f"vllm serve {bundle}"], capture_output=True, text=True).stdout.split()


def test_the_launcher_stops_both_instances_on_sigint(disaggregated, vllm_setup):
    *_, proc = disaggregated
    assert len(serving(vllm_setup[2])) == 2 and proc.poll() is None
    proc.send_signal(signal.SIGINT)  # the launcher alone, as Ctrl-C in its terminal
    assert proc.wait(timeout=120) == 0
    assert serving(vllm_setup[2]) == []


def test_a_plain_vllm_prefill_instance_is_refused_at_the_handshake(vllm_setup, disaggregated, tmp_path):
    """vLLM's own NixlConnector and layout on the prefill side; the plugin's connector on the decode side."""
    from neffbuild.vllm import di

    *_, launcher = disaggregated
    if launcher.poll() is None:  # one pair at a time
        launcher.send_signal(signal.SIGINT)
        launcher.wait(timeout=120)
    _, checkpoint, _, settings, requests = vllm_setup
    ports = [free_port() for _ in range(4)]
    engine = {k: v for k, v in settings["engine_args"].items() if k not in ("load_format",)}
    plain = [*serve_argv(checkpoint, engine, None, ports[0]),
             "--kv-transfer-config", di.kv_transfer_config("prefill", {"kv_connector": "NixlConnector",
                                                                       "kv_buffer_device": "cpu"})]
    env = vllm_env(VLLM_CPU_KVCACHE_SPACE=None, VLLM_SERVER_DEV_MODE="1")
    prefill = di.Instance("prefill", plain, ports[0], ports[2], tmp_path / "plain.log", dict(env, VLLM_PLUGINS=""))
    decode = di.Instance("decode", di.serve_argv(str(VLLM_VENV / "bin" / "vllm"), settings, ports[1], "decode",
                                                 ["--worker-extension-cls", "neffbuild.vllm.model.WorkerReport"]),
                         ports[1], ports[3], tmp_path / "decode.log", env)
    proxy = None
    try:
        deadline = time.monotonic() + 400
        while not (prefill.healthy() and decode.healthy()):
            assert prefill.proc.poll() is None and decode.proc.poll() is None, (tmp_path / "decode.log").read_text()
            assert time.monotonic() < deadline
            time.sleep(1)
        proxy = di.make_proxy(prefill.url, decode.url, 0)
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        with pytest.raises(urllib.error.HTTPError):
            complete(f"http://127.0.0.1:{proxy.server_address[1]}", requests[0]["prompt"], 5, timeout=120)
        rep = report(decode.url)
    finally:
        if proxy is not None:
            proxy.shutdown()
        prefill.stop()
        decode.stop()
    refusals = [ln for ln in (tmp_path / "decode.log").read_text().splitlines() if "neffbuild: refusing" in ln]
    assert refusals and all("vLLM's own KV layout" in ln and "bundle gpt-oss-vllm-0.1.0 sha256:" in ln
                            for ln in refusals), refusals
    assert rep["prefill_tokens"] == 0 and rep.get("rows", {}) == {}  # nothing recomputed, nothing decoded
