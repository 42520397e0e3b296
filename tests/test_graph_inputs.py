"""One bundle contract: ``GraphInputs`` (runtime/bundle/graph_inputs.py) is what the writer emits and every
reader decodes, and the step-input table (runtime/step/inputs.py) gives both the traced example
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
from neffbuild.compiler.graphs import example_inputs, input_signature, target_graph, target_graph_from
from neffbuild.memory import recipe_kv_layout
from neffbuild.runtime.bundle.graph_inputs import GraphInputs
from neffbuild.runtime.bundle.schema import expected_draft_signature, expected_signature

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
    gi = GraphInputs.from_recipe(r, recipe_kv_layout(r))
    doc = json.loads(json.dumps(graph_inputs(r, recipe_kv_layout(r))))
    assert GraphInputs.from_json(doc) == gi and gi.to_json() == doc
    assert gi.config() == r.model.config and gi.kv_layout == recipe_kv_layout(r)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_traced_inputs_and_manifest_signatures_come_from_one_table(name):
    r = _recipe(name)
    doc = graph_inputs(r, recipe_kv_layout(r))
    gi = GraphInputs.from_json(doc)
    for t in grid.targets(r):
        want = (expected_draft_signature if t.family == grid.DRAFT else expected_signature)(
            doc, t.batch, t.ctx, t.query_len)
        assert input_signature(example_inputs(target_graph(r, t)), t.family) == want, t.label
        # A reader rebuilding the graph from the manifest gets the recipe's graph: the same cell of the same
        # GraphInputs (random weights in the default form), so the same spec and pre-key.
        back, there = target_graph_from(gi, t.family, t.batch, t.ctx, t.query_len), target_graph(r, t)
        assert back == there and back.spec() == there.spec()
        assert back.config == there.config and back.draft_config == there.draft_config


def test_a_graphs_spec_is_its_cell_and_the_bundles_shapes():
    """Another bucket shapes no other graph: its spec (the pre-key's input) stays; a bundle-wide shape or the
    weights' form changes every one. dp counts only in a sharded graph."""
    r = _recipe("plain")
    cell = next(t for t in grid.targets(r) if t.ctx == 128)
    spec = target_graph(r, cell).spec()
    more = r.replace(num_seqs_buckets=(*r.num_seqs_buckets, 8),
                     decode_context_length_buckets=(*r.decode_context_length_buckets, 384))
    assert target_graph(more, cell).spec() == spec
    assert target_graph(r.replace(dp=2), cell).spec() == spec
    for changed in (r.replace(num_blocks=r.num_blocks + 16), r.replace(fp8_packed_kv=True), r.replace(tp=2),
                    r.replace(model=dataclasses.replace(r.model, weights_dtype="bfloat16"))):
        assert target_graph(changed, cell).spec() != spec


@pytest.mark.parametrize("name", ["plain", "fp8", "eagle3"])
def test_what_the_runtime_passes_matches_the_table(name):
    """attn_metadata / draft_inputs (+ graph_view) build exactly the table's inputs, FP8 caches as bytes."""
    import torch

    from neffbuild.runtime.kv import cache as kv_cache
    from neffbuild.runtime.step import attn_metadata, draft_inputs

    r = _recipe(name)
    doc, kv = graph_inputs(r, recipe_kv_layout(r)), recipe_kv_layout(r)
    caches, draft_cache = kv_cache.allocate(kv), kv_cache.allocate_draft(kv)
    for t in grid.targets(r):
        R = max(1, t.batch - 1)  # a padded batch
        table = torch.ones(R, 3, dtype=torch.long)
        if t.family == grid.DRAFT:
            aux = torch.zeros(t.query_len, 3 * r.model.config.hidden_size)
            rows = [(list(range(t.query_len)), aux, 5)] * R
            args = draft_inputs.build_draft(rows, table, batch=t.batch, ctx=t.ctx, query_len=t.query_len,
                                            block_size=r.block_size, hidden_size=aux.shape[-1]).as_args(draft_cache)
            want = expected_draft_signature(doc, t.batch, t.ctx, t.query_len)
        else:
            tokens = torch.zeros(R, t.query_len, dtype=torch.long)
            args = attn_metadata.build(tokens, torch.full((R,), 5), table, table, batch=t.batch, ctx=t.ctx,
                                       block_size=r.block_size, num_swa=r.num_swa).as_args(caches)
            want = expected_signature(doc, t.batch, t.ctx, t.query_len)
        assert input_signature(args, t.family) == want, t.label
