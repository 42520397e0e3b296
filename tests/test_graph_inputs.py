"""One bundle contract: ``GraphInputs`` (runtime/graph_inputs.py) is what the writer emits and every
reader decodes, and the step-input table (runtime/step_inputs.py) gives both the traced example
inputs and the signatures the manifest schema expects, for every family and layout."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from neffbuild import grid
from neffbuild import recipe as R
from neffbuild.bundle.manifest import graph_inputs
from neffbuild.compiler.graphs import example_inputs, input_signature, kv_layout_for, spec_for, spec_from_graph_inputs
from neffbuild.runtime.graph_inputs import GraphInputs
from neffbuild.runtime.manifest_schema import expected_draft_signature, expected_signature

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {
    "plain": {},
    "eagle3": {"speculative": {"method": "eagle3", "num_speculative_tokens": 2, "draft": {"random_seed": 1}}},
    "tp2_ep2": {"parallel": {"tp": 2, "ep": 2}},
    "fp8": {"neuron_config": {"num_seqs_buckets": [1, 4], "decode_context_length_buckets": [128, 256],
                              "fp8_packed_kv": True}},
}


def _recipe(name: str):
    raw = yaml.safe_load((ROOT / "recipes" / "gpt-oss-tiny.yaml").read_text())
    return R.from_dict(dict(raw, **VARIANTS[name]), base_dir=ROOT / "recipes")


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_graph_inputs_round_trip_through_json(name):
    r = _recipe(name)
    gi = GraphInputs.from_recipe(r, kv_layout_for(r))
    doc = json.loads(json.dumps(graph_inputs(r, kv_layout_for(r))))
    assert GraphInputs.from_json(doc) == gi and gi.to_json() == doc
    assert gi.config() == r.model.config and gi.kv_layout == kv_layout_for(r)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_traced_inputs_and_manifest_signatures_come_from_one_table(name):
    r = _recipe(name)
    doc = graph_inputs(r, kv_layout_for(r))
    gi = GraphInputs.from_json(doc)
    for t in grid.targets(r):
        want = (expected_draft_signature if t.family == grid.DRAFT else expected_signature)(
            doc, t.batch, t.ctx, t.query_len)
        assert input_signature(example_inputs(spec_for(r, t)), t.family) == want, t.label
        # A reader rebuilding the graph from the manifest gets the recipe's graph (the manifest stores the
        # config's own Hugging Face keys, the recipe the keys it was given: the same config).
        back, there = spec_from_graph_inputs(gi, t.family, t.batch, t.ctx, t.query_len), spec_for(r, t)
        assert back.config == there.config and back.draft_config == there.draft_config
        assert dataclasses.replace(back, hf_config={}) == dataclasses.replace(there, hf_config={})
