"""The manifest identifies artifacts only: its bytes are pinned for a fixed recipe and toolchain.

Per-build records (compile times, hosts, dates) live in build-info.json, so the manifest of a
recipe depends on nothing but its inputs (two independent compiles of one key give byte-identical manifests:
tests/test_build.py, ``test_concurrent_builds_share_a_cache_and_compile_each_key_once``). To accept an intended
format change, rewrite the golden file with ``python -m tests.test_manifest_golden`` and review the diff.
"""

import hashlib
import json
from pathlib import Path

import pytest

from neffbuild import grid
from neffbuild import recipe as R
from neffbuild.bundle import manifest, paths
from neffbuild.compiler.graphs import (
    example_inputs,
    input_signature,
    target_graph,
)
from neffbuild.memory import recipe_kv_layout
from neffbuild.models.gpt_oss.weights import stacked_shapes
from neffbuild.runtime.bundle.schema import problems
from tests.conftest import TINY

GOLDEN = Path(__file__).parent / "golden" / "manifest-tiny.json"
TOOLCHAIN = {"backend": "inductor", "torch": "2.13.0+cpu", "python": "3.11.7", "machine": "x86_64", "device": "cpu",
             "flags": []}


def _fake(text: str) -> dict:
    return {"sha256": hashlib.sha256(text.encode()).hexdigest(), "bytes": len(text) * 1000}


def golden_text() -> str:
    r = R.load(TINY)
    files, artifacts = {}, []
    for t in grid.targets(r):
        rel = paths.artifact_path(t.label, "pt2")
        files[rel] = _fake(t.label)
        artifacts.append({"label": t.label, "family": t.family, "batch": t.batch, "ctx": t.ctx,
                          "query_len": t.query_len, "file": rel, **files[rel],
                          "cache_key": _fake("k" + t.label)["sha256"],
                          "input_signature": input_signature(example_inputs(target_graph(r, t))),
                          "compile_label": t.label})
    files[paths.WEIGHTS_PATH] = _fake("weights")
    files[paths.RECIPE_PATH] = _fake(r.to_yaml())
    weights = {"file": paths.WEIGHTS_PATH, "tensors": {k: {"dtype": "float32", "shape": list(v)}
                                                        for k, v in sorted(stacked_shapes(r.model.config).items())}}
    m = manifest.build(r, toolchain=TOOLCHAIN, kv_layout=recipe_kv_layout(r), artifacts=list(reversed(artifacts)),
                       weights=weights, files=files)
    return manifest.dumps(m)


def test_manifest_bytes_are_pinned():
    text = golden_text()
    assert text == GOLDEN.read_text(encoding="utf-8"), "manifest format changed; see this module's docstring"


def test_manifest_holds_no_per_build_fields_and_passes_its_schema():
    m = json.loads(golden_text())
    assert not problems(m)
    for word in ("compile_seconds", "created", "host", "wall_s"):
        assert word not in golden_text()
    assert all(set(a) == {"label", "family", "batch", "ctx", "query_len", "file", "sha256", "bytes", "cache_key",
                          "input_signature", "compile_label"} for a in m["artifacts"])


if __name__ == "__main__":
    GOLDEN.write_text(golden_text(), encoding="utf-8")
    print(f"wrote {GOLDEN}")


@pytest.mark.parametrize("par,needle", [
    ({}, "parallel.tp"),
    ([], "must be an object"),
    ({"tp": 2, "dp": 1, "ep": 1, "world_size": 4, "pieces": {}}, "must be tp x dp"),
    ({"tp": 2, "dp": 1, "ep": 1, "world_size": 2, "pieces": {"tp0": []}}, "parallel.pieces"),
])
def test_a_malformed_parallel_field_is_a_schema_problem(par, needle):
    """`parallel: {}` in an unsharded manifest (digests recomputed) was a KeyError in generate."""
    m = json.loads(GOLDEN.read_text())
    assert problems(m) == []
    found = problems(dict(m, parallel=par))
    assert any(needle in str(p) for p in found), found
    good = {"tp": 2, "dp": 1, "ep": 1, "world_size": 2, "pieces": {"tp0": {"file": "weights/tp0.safetensors",
                                                                           "tensors": {}}}}
    assert problems(dict(m, parallel=good)) == []
