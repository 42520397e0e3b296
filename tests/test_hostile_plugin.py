"""Hostile vLLM plugin settings: a section that would leave the plugin silently inactive is an error, and every
start-up refusal reaches the operator of ``vllm serve`` as one line, no traceback (neffbuild/vllm/config.py,
neffbuild/vllm/startup.py ``one_line_refusals``, neffbuild/vllm/__init__.py).

The table runs without vLLM; the fuzz sends random sections through vLLM's own configuration builder (no engine
started) and checks that vLLM refuses exactly what the table's rules refuse; one real ``vllm serve`` shows the
operator's terminal.
"""

from __future__ import annotations

import json
import random
import subprocess

import pytest

from neffbuild.errors import InvalidInput
from neffbuild.vllm import ARCHITECTURE
from neffbuild.vllm.config import for_architecture
from tests.helpers import ROOT
from tests.vllm_helpers import SKIP_REASON, have_vllm, run_vllm_script, save_checkpoint, serve_argv, vllm_env

SCRIPT = ROOT / "tests" / "vllm_scripts" / "config_sections.py"
ENGINE_ARGS = {"dtype": "float32", "max_model_len": 512, "block_size": 32, "num_gpu_blocks_override": 128,
               "max_num_seqs": 4, "enforce_eager": True}

CASES = [  # (additional_config, architecture, what the error must say; None: no plugin, no error)
    ({"neffbuild": None}, ARCHITECTURE, "--additional-config neffbuild: must be an object"),
    ({"nefbuild": {"bundle": "b"}}, ARCHITECTURE, "--additional-config nefbuild: not a key the neffbuild plugin "
                                                  "reads; did you mean 'neffbuild'?"),
    ({"neffbuid": {"bundle": "b"}}, "LlamaForCausalLM", "did you mean 'neffbuild'?"),
    ({"NeffBuild": {"bundle": "b"}}, ARCHITECTURE, "did you mean 'neffbuild'?"),
    ({"neffbuild": {"bundle": "b"}}, "LlamaForCausalLM", "--additional-config neffbuild: the plugin serves "
                                                         "GptOssForCausalLM checkpoints only; vLLM is serving "
                                                         "LlamaForCausalLM"),
    ({"neffbuild": []}, "LlamaForCausalLM", "neffbuild: must be an object"),
    ({"other_plugin": {"x": 1}}, "LlamaForCausalLM", None),
    ({}, ARCHITECTURE, None),
    (None, ARCHITECTURE, None),
]


@pytest.mark.parametrize(("additional", "architecture", "message"), CASES)
def test_an_inactive_or_misspelled_section_is_an_error(additional, architecture, message):
    if message is None:
        assert for_architecture(additional, architecture, ARCHITECTURE) is None
        return
    with pytest.raises(InvalidInput) as err:
        for_architecture(additional, architecture, ARCHITECTURE)
    assert message in str(err.value) and "\n" not in str(err.value)


def _random_sections(seed: int, n: int) -> list:
    """Random ``additional_config`` values: keys near and far from ``neffbuild``, values of every JSON kind."""
    rng = random.Random(seed)
    keys = ["neffbuild", "nefbuild", "neffbuilds", "Neffbuild", "neff_build", "kv_transfer", "x", "neuron_config"]
    values = [None, [], "artifacts/b", 3, {}, {"bundle": "/nonexistent/b"}, {"bundle": ""},
              {"bundle": "/nonexistent/b", "verify": "none"}, {"bundel": "b"}, {"bundle": "b", "trusted_keys": "k"}]
    return [{rng.choice(keys): rng.choice(values) for _ in range(rng.randint(0, 2))} for _ in range(n)]


def _expected(additional: dict, architecture: str) -> str:
    try:
        settings = for_architecture(additional, architecture, ARCHITECTURE)
    except InvalidInput as err:
        return f"InvalidInput: {err}"
    return "ok" if settings is None else "BundleError"  # a valid section: the plugin opens the bundle (absent)


@pytest.mark.skipif(not have_vllm(), reason=SKIP_REASON)
@pytest.mark.parametrize("architecture", ["-", "LlamaForCausalLM"])
def test_random_sections_through_vllms_config_builder_refuse_what_the_rules_refuse(tmp_path, architecture):
    sections = _random_sections(seed=54 + len(architecture), n=14)
    checkpoint = save_checkpoint(tmp_path / "ckpt")
    out = run_vllm_script(SCRIPT, [str(checkpoint), architecture, json.dumps(sections)], timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    arch = ARCHITECTURE if architecture == "-" else architecture
    for section, outcome in zip(sections, got, strict=True):
        want = _expected(section, arch)
        assert outcome == want or (want == "BundleError" and outcome.startswith("BundleError:")), (section, outcome)
    assert {o.split(":")[0] for o in got} >= {"ok", "InvalidInput"}  # the seed reaches both kinds of outcome


@pytest.mark.slow  # starts `vllm serve` (its API server only: the refusal comes before any engine process)
@pytest.mark.skipif(not have_vllm(), reason=SKIP_REASON)
def test_vllm_serve_with_a_bad_section_stops_with_one_line_and_no_traceback(tmp_path):
    checkpoint = save_checkpoint(tmp_path / "ckpt")
    argv = serve_argv(checkpoint, ENGINE_ARGS, {"neffbuild": {"bundle": "b", "verify": "none"}}, port=1)
    out = subprocess.run(argv, env=vllm_env(), capture_output=True, text=True, timeout=300)
    lines = [line for line in out.stderr.splitlines() if "neffbuild" in line]
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "Traceback" not in out.stdout, out.stderr[-3000:]
    assert lines == ["error: --additional-config neffbuild.verify: 'sizes' or 'full' (got 'none')"], out.stderr[-3000:]
