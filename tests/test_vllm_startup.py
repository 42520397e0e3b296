"""A bundle that does not fit vLLM's configuration stops `vllm serve` at start-up: exit non-zero within 60 s,
one error naming the vLLM flag and both values, and the port never answers (nothing serves). The plugin's check
runs while vLLM builds its configuration (neffbuild/vllm/startup.py), so `vllm serve` stops in its API server
before it spawns an engine process.

The flags come from `neffbuild inspect --vllm-config` (which fit), then one is changed per case; the bundle is
the vLLM test bundle (tests/test_vllm_serve.py builds the same recipe, so the compile cache serves it).
"""

from __future__ import annotations

import json
import re

import pytest

from tests.helpers import build_bundle, cli
from tests.vllm_helpers import (
    SKIP_REASON,
    free_port,
    have_vllm,
    save_checkpoint,
    serve_argv,
    start_refused,
    vllm_env,
    write_recipe,
)

pytestmark = pytest.mark.skipif(not have_vllm(), reason=SKIP_REASON)

# Two real starts: a flag of the cache's shape and the model's config. The other flags' messages are the same rule
# over the same view (tests/test_vllm_checks.py's table); each real start costs a vLLM import (~10 s of a core).
CASES = [  # (engine argument changed, value, what the error must say)
    ("block_size", 64, "--block-size: vLLM has block_size 64, the bundle was compiled for 32"),
    ("hf_overrides", json.dumps({"hidden_size": 128}), "the checkpoint (vllm serve MODEL / --hf-overrides): vLLM has "
                                                       "hidden_size 128, the bundle was compiled for 256"),
]


@pytest.fixture(scope="module")
def fitting(tmp_path_factory, build_cache, compile_pool):
    folder = tmp_path_factory.mktemp("vllm_start")
    checkpoint = save_checkpoint(folder / "ckpt")
    bundle = build_bundle(folder, build_cache, write_recipe(folder, checkpoint), executor=compile_pool).bundle
    doc = json.loads(cli("inspect", str(bundle), "--vllm-config", "--json").stdout)
    return folder, checkpoint, doc


@pytest.mark.parametrize(("arg", "value", "message"), CASES, ids=[c[0] for c in CASES])
def test_a_mismatch_fails_vllm_start_up_naming_the_flag(fitting, arg, value, message):
    folder, _checkpoint, doc = fitting
    port = free_port()
    argv = serve_argv(doc["model"], {**doc["engine_args"], arg: value}, doc["additional_config"], port)
    log = folder / f"{arg}.log"
    returncode, served, elapsed = start_refused(argv, log, vllm_env(), port)
    text = log.read_text(errors="replace")
    assert returncode != 0 and not served
    assert elapsed < 60, f"start-up failed after {elapsed:.0f} s"
    assert message in text, text[-3000:]
    assert "does not fit this vLLM configuration (nothing will serve)" in text
    assert "Traceback" not in text and returncode == 1, text[-3000:]  # the refusal alone (startup.py)
    # it stopped while vLLM built its configuration, in the API server: no engine or worker process had started
    assert set(re.findall(r"^\((\w+) pid=\d+\)", text, re.M)) <= {"APIServer"}, text[-3000:]
