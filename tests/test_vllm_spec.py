"""EAGLE3 inside vLLM: vLLM's drafter, rejection sampler and scheduler over the bundle's three families.

One EAGLE3 bundle (k = 3, batch bucket 2, context bucket 128 crossed during the run, the fallback 256: the suite's
one EAGLE3 recipe shape, ``vllm_helpers.eagle3_recipe``, whose graphs ``eagle3_built`` shares), vLLM started with
exactly the settings ``neffbuild inspect --vllm-config --json`` prints (its ``--speculative-config``: the bundle's
``draft/`` folder). Six concurrent greedy requests of different lengths (two at a time in the batch bucket) give
the tokens of vLLM on the same bundle without speculation and of ``neffbuild generate --spec``; then a request
that ends at ``max_model_len`` finishes through ``target_nospec``. A k other than the bundle's stops vLLM's
start-up naming the flag.

The model is made so that drafts are sometimes right (a random draft over a random target accepts nothing, which
would leave acceptance untested): the target's layers are damped and its LM head is its embedding with every
token paired to its neighbour (id ^ 1), so greedy output alternates between a pair for a while and then leaves it;
the draft copies the token two back (its fused state is the target's layer-0 output, its LM head the embedding).
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers import ROOT, build_bundle, cli
from tests.vllm_helpers import (
    SKIP_REASON,
    SPEC_K,
    SPEC_MAX_MODEL_LEN,
    VLLM_PYTHON,
    complete,
    eagle3_recipe,
    have_vllm,
    prom_samples,
    python_json,
    report,
    run_vllm_script,
    save_draft,
    target_config,
    vllm_env,
)

pytestmark = [pytest.mark.skipif(not have_vllm(), reason=SKIP_REASON), pytest.mark.slow]

SCRIPT = Path(__file__).parent / "vllm_scripts" / "spec_generate.py"
K, DAMPING = SPEC_K, 0.15
# vllm.LLM with its engine core in this process (as the serve module's native run): a spawned engine core is a
# second vLLM import, about 18 CPU-seconds a start on the 2-core host; `vllm serve`'s own engine-core process is
# what the serve, stream, dtypes, DI and parallel modules run.
ONE_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def save_alternating_checkpoint(folder: Path) -> Path:
    """The vLLM tests' GPT-OSS with damped layers and an LM head that maps each token to its pair (id ^ 1)."""
    import torch
    import transformers

    from neffbuild.models.gpt_oss.weights import random_state_dict

    cfg = target_config()
    sd = random_state_dict(cfg, seed=0)
    for name in sd:
        if name.endswith(("o_proj.weight", "o_proj.bias", "down_proj", "down_proj_bias")):
            sd[name] = sd[name] * DAMPING
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"][torch.arange(cfg.vocab_size) ^ 1].clone()
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**cfg.to_hf_dict()))
    model.load_state_dict(sd, strict=True)
    model.save_pretrained(folder)
    return folder


def _requests() -> tuple[list[dict], list[dict]]:
    rng = random.Random(5)
    lengths, new = (100, 20, 110, 60, 95, 9), (40, 25, 30, 12, 20, 33)  # 110 + 1 + 3 < 128 < 110 + 30
    six = [{"prompt": [rng.randrange(512) for _ in range(n)], "max_tokens": m}
           for n, m in zip(lengths, new, strict=True)]
    long = [{"prompt": [rng.randrange(512) for _ in range(SPEC_MAX_MODEL_LEN - 12)], "max_tokens": 12}]
    return six, long


@pytest.fixture(scope="module")
def vllm_spec(tmp_path_factory, build_cache, compile_pool):
    folder = tmp_path_factory.mktemp("vllm-spec")
    checkpoint = save_alternating_checkpoint(folder / "ckpt")
    recipe = eagle3_recipe(folder, checkpoint, save_draft(folder / "draft", checkpoint, copying=True))
    bundle = build_bundle(folder, build_cache, recipe, executor=compile_pool).bundle
    settings = folder / "settings.json"
    settings.write_text(cli("inspect", str(bundle), "--vllm-config", "--json").stdout)
    six, long = _requests()
    files = []
    for name, reqs in (("six", six), ("long", long)):
        (folder / f"{name}.json").write_text(json.dumps(reqs))
        files.append(str(folder / f"{name}.json"))
    with open(folder / "six.jsonl", "w") as f:
        for i, r in enumerate(six):
            f.write(json.dumps({"id": str(i), "prompt_ids": r["prompt"], "max_new_tokens": r["max_tokens"]}) + "\n")
    runs = {}
    for name, extra in (("spec", []), ("plain", ["--no-spec"])):
        out = run_vllm_script(SCRIPT, ["--settings", str(settings), "--requests", *files, *extra], **ONE_PROCESS)
        assert out.returncode == 0, out.stderr[-4000:]
        runs[name] = python_json(out.stdout)
    generated = json.loads(cli("generate", str(bundle), "--spec", "--requests", str(folder / "six.jsonl"),
                               "--json").stdout)
    yield {"settings": json.loads(settings.read_text()), "bundle": bundle, "runs": runs, "generated": generated,
           "checkpoint": checkpoint, "files": files, "settings_file": settings}


# Each further vLLM start is its own fixture, so its time counts against the test that uses it (pytest-timeout's
# 600 s a test: the module fixture alone came near it on a loaded 2-core host).
@pytest.fixture(scope="module")
def native(vllm_spec):
    """vLLM's own EAGLE3 (no plugin) on the original checkpoint with the bundle's draft/ folder."""
    settings = vllm_spec["settings_file"]
    out = run_vllm_script(SCRIPT, ["--settings", str(settings), "--requests", *vllm_spec["files"],
                                   "--native", str(vllm_spec["checkpoint"])], **ONE_PROCESS)
    assert out.returncode == 0, out.stderr[-4000:]
    return python_json(out.stdout)


@pytest.fixture(scope="module")
def refused(vllm_spec):
    settings = vllm_spec["settings_file"]
    return run_vllm_script(SCRIPT, ["--settings", str(settings), "--requests", vllm_spec["files"][0],
                                    "--num-speculative-tokens", str(K - 1)], **ONE_PROCESS)


def test_inspect_prints_the_speculative_config_with_the_bundles_draft_folder(vllm_spec):
    spec = vllm_spec["settings"]["engine_args"]["speculative_config"]
    assert spec == {"method": "eagle3", "num_speculative_tokens": K, "disable_padded_drafter_batch": True,
                    "model": str(Path(vllm_spec["bundle"]).resolve() / "draft")}
    draft = json.loads((Path(spec["model"]) / "config.json").read_text())
    assert draft["architectures"] == ["LlamaForCausalLMEagle3"] and draft["model_type"] == "llama"
    assert draft["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # the bundle's own: one numbering
    assert (Path(spec["model"]) / "model.safetensors").is_file()


def test_speculation_gives_the_tokens_of_the_same_bundle_without_it_and_of_neffbuild_generate(vllm_spec):
    spec, plain = vllm_spec["runs"]["spec"]["runs"], vllm_spec["runs"]["plain"]["runs"]
    generated = [r["tokens"] for r in sorted(vllm_spec["generated"]["requests"], key=lambda r: int(r["id"]))]
    six, _ = _requests()
    assert [len(t) for t in spec[0]["tokens"]] == [r["max_tokens"] for r in six]
    assert spec[0]["tokens"] == plain[0]["tokens"] == generated
    assert spec[1]["tokens"] == plain[1]["tokens"]  # the request that ends at max_model_len


def test_draft_and_target_spec_steps_run_and_drafts_are_accepted(vllm_spec):
    report, counters = vllm_spec["runs"]["spec"]["report"], vllm_spec["runs"]["spec"]["runs"][0]["spec"]
    families = report["families"]
    assert families["draft"] > 0 and families["target_spec"] > 0
    labels = set(report["steps"])
    assert {"draft_b2_ctx128", "draft_b2_ctx256", "decode_b2_s4_ctx128", "decode_b2_s4_ctx256"} <= labels
    assert 0 < counters["num_accepted_tokens"] < counters["num_draft_tokens"]  # some drafts right, some not
    # the same drafts as neffbuild's own engine on the six requests: the same accepted count
    assert counters["num_accepted_tokens"] == sum(s["accepted"] for s in vllm_spec["generated"]["steps"])
    plain = vllm_spec["runs"]["plain"]["report"]["families"]
    assert set(plain) == {"target_nospec"}  # the same bundle without speculation: its target_nospec graphs
    assert report["draft_prompt_kv"] == {}  # the DI check's digests: off unless NEFFBUILD_VLLM_DRAFT_KV_DIGEST=1


def test_vllm_native_eagle3_on_the_checkpoint_and_the_bundles_draft_gives_the_same_tokens(vllm_spec, native):
    """The third oracle: vLLM's own GPT-OSS and EAGLE3 drafter (no plugin) on the original checkpoint and the bundle's
    draft/ folder. Greedy speculation is lossless on both sides, so the tokens agree; the acceptance rates are
    reported side by side (the same drafts on the same states, up to float32 rounding of vLLM's eager kernels)."""
    spec = vllm_spec["runs"]["spec"]
    assert native["report"] == {"enabled": False}  # the plugin stayed out: vLLM alone
    assert native["runs"][0]["tokens"] == spec["runs"][0]["tokens"]
    assert native["runs"][1]["tokens"] == spec["runs"][1]["tokens"]
    ours, theirs = spec["runs"][0]["spec"], native["runs"][0]["spec"]
    assert theirs["num_accepted_tokens"] > 0
    rate = {n: c["num_accepted_tokens"] / c["num_draft_tokens"] for n, c in (("plugin", ours), ("native", theirs))}
    print(f"acceptance rate on the six requests: {rate}")
    assert abs(rate["plugin"] - rate["native"]) <= 0.05, rate


def test_a_request_ending_at_max_model_len_finishes_through_target_nospec(vllm_spec):
    before = vllm_spec["runs"]["spec"]["runs"]
    assert len(before[1]["tokens"][0]) == 12
    assert vllm_spec["runs"]["spec"]["report"]["families"].get("target_nospec", 0) > 0


def test_another_num_speculative_tokens_fails_start_up_naming_the_flag(refused):
    assert refused.returncode != 0
    assert f"--speculative-config: vLLM has num_speculative_tokens {K - 1}, the bundle was compiled for {K}" \
        in refused.stderr, refused.stderr[-3000:]


# -- disaggregated serving with the EAGLE3 bundle (docs/vllm.md, "Disaggregated serving"): one pair of vLLM starts


@pytest.fixture(scope="module")
def spec_di(vllm_spec, tmp_path_factory):
    """The DI launcher on the EAGLE3 bundle (both instances with its printed --speculative-config); the six
    requests at once through its proxy; the decode instance's plugin report and vLLM's spec-decode counters."""
    import urllib.request

    logs = tmp_path_factory.mktemp("spec-di")
    proc = subprocess.Popen(
        [str(VLLM_PYTHON), "-m", "neffbuild.vllm.di", str(vllm_spec["bundle"]), "--port", "0", "--log-dir", str(logs),
         "--vllm-arg=--worker-extension-cls", "--vllm-arg=neffbuild.vllm.model.WorkerReport",
         "--decode-arg=--no-enable-prefix-caching", "--startup-timeout", "400"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        env=vllm_env(VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE=None, NEFFBUILD_VLLM_DRAFT_KV_DIGEST="1"),
        start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert "serving" in line, line + proc.stdout.read()[-3000:]
        proxy, decode = line.split(" at ")[1].split("/v1")[0], line.split("decode ")[1].split(";")[0]
        prefill = line.split("(prefill ")[1].split(",")[0]
        six, _ = _requests()
        with ThreadPoolExecutor(len(six)) as pool:
            tokens = list(pool.map(lambda r: complete(proxy, r["prompt"], r["max_tokens"]), six))
        with urllib.request.urlopen(decode + "/metrics", timeout=30) as r:
            text = r.read().decode()
        counters = {n: sum(prom_samples(text, f"vllm:spec_decode_{n}_total").values())
                    for n in ("num_draft_tokens", "num_accepted_tokens")}
        yield tokens, report(decode), counters, report(prefill)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)


def test_disaggregated_eagle3_gives_the_single_instances_tokens_and_acceptance(vllm_spec, spec_di):
    """Through the launcher: the single spec instance's tokens; on the decode instance no prefill, each transferred
    request's first step one target_nospec row (no aux states yet; vLLM pads that step with k placeholder drafts,
    which it counts as drafted and always rejects) and speculation from its next step on, accepting what the single
    instance accepts. (This draft's attention adds nothing, fc and its LM head propose: the acceptance shows the
    seam, not the draft's transferred prompt KV: the next test checks that.)"""
    tokens, rep, counters, _ = spec_di
    single = vllm_spec["runs"]["spec"]["runs"][0]
    assert tokens == single["tokens"]
    assert rep["prefill_tokens"] == 0
    assert rep["family_rows"].get("target_nospec") == len(tokens), rep["family_rows"]
    assert rep["families"]["target_spec"] > 0 and rep["families"]["draft"] > 0
    base = {n: single["spec"][n] - single["spec_before"].get(n, 0) for n in counters}
    print(f"acceptance: single {base}, DI {counters}")
    assert counters["num_accepted_tokens"] == base["num_accepted_tokens"] > 0
    assert base["num_draft_tokens"] <= counters["num_draft_tokens"] <= base["num_draft_tokens"] + K * len(tokens)


def test_the_drafts_prompt_kv_arrives_as_the_prefill_instance_wrote_it(spec_di):
    """The draft's KV at positions 0..N-2 of each prompt: digested by the prefill instance after drafting over the
    prompt and by the decode instance at its first draft call for the request (which writes from N - 1 on); equal."""
    _, decode, _, prefill = spec_di
    six, _ = _requests()
    spans = {str(len(r["prompt"]) - 1) for r in six}
    assert spans <= set(prefill["draft_prompt_kv"]) and spans <= set(decode["draft_prompt_kv"]), (prefill, decode)
    for span in spans:
        assert decode["draft_prompt_kv"][span] == prefill["draft_prompt_kv"][span], span
        assert prefill["draft_prompt_kv"][span][1] > 0  # written: not the zeros of a block nobody wrote
