"""The plugin's eager attention on the bundle's KV layout equals vLLM's CPU kernel (tests/vllm_scripts/
attention_check.py, run in the vLLM venv): prefill, decode and chunk rows, full and sliding-window layers,
sinks; K and V land plain where the artifacts read them, while vLLM's own kernel keeps K transposed (why the
plugin has an attention of its own, docs/architecture.md)."""

import pytest

from tests.vllm_helpers import SKIP_REASON, have_vllm, python_json, run_vllm_script

pytestmark = pytest.mark.skipif(not have_vllm(), reason=SKIP_REASON)


def test_plugin_attention_matches_vllms_cpu_kernel_on_the_bundle_layout():
    res = run_vllm_script("tests/vllm_scripts/attention_check.py", [], timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = python_json(res.stdout)
    assert doc["plain_k"] and doc["vllm_k_transposed"]
    assert max(doc["diff"].values()) < 1e-5, doc
