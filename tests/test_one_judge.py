"""One judge of a bundle for every engine: each defect ``neffbuild generate`` refuses, the vLLM plugin's start-up
refuses with the same message (through the plugin's own open, ``startup.open_configured``: no vLLM needed), and
a model config or weight table that contradicts the recipe's rules is refused by the runtime itself."""

from __future__ import annotations

import json

import pytest

from neffbuild.errors import NeffbuildError
from neffbuild.vllm.config import PluginConfig
from neffbuild.vllm.startup import open_configured
from tests.helpers import gi, run_cli, tampered

pytestmark = pytest.mark.slow


def _weights(fn):
    def edit(root, m):
        fn(m["weights"]["tensors"])

    return edit


def _layer_types(g):
    g["model_config"]["layer_types"] = ["full_attention"] * len(g["model_config"]["layer_types"])


# (edit, what the message names): each a bundle defect, consistent checksums unless the edit breaks the files.
DEFECTS = [
    (gi(lambda g: g["model_config"].update(rms_norm_eps=2.0)), "graph_inputs.model_config.rms_norm_eps"),
    (gi(lambda g: g["model_config"].update(num_attention_heads=3)), "graph_inputs.model_config.num_attention_heads"),
    (gi(lambda g: g["model_config"].update(vocab_size=2**30)), "graph_inputs.model_config.vocab_size"),
    (gi(lambda g: g["model_config"].update(intermediate_size=48)), "implies weight"),
    (gi(lambda g: g["model_config"]["rope_parameters"].update(rope_type="linear")), "rope_parameters.rope_type"),
    (gi(lambda g: g["model_config"].update(num_hidden_layers=4)), "graph_inputs.model_config"),
    (gi(lambda g: g["model_config"].update(sliding_window=-5)), "graph_inputs.model_config.sliding_window"),
    (gi(lambda g: g.update(num_seqs_buckets=[4, 2])), "num_seqs_buckets"),
    (_weights(lambda t: t.pop("lm_head")), "lm_head"),
    (gi(lambda g: g.update(block_size=0)), "block_size"),
]
IDS = ["eps", "heads-split", "vocab-bound", "weights-vs-config", "rope-type", "layers", "window",
       "buckets-order", "weight-missing", "block-size"]


@pytest.mark.parametrize("edit,needle", DEFECTS, ids=IDS)
def test_generate_and_the_plugin_refuse_the_same_bundles_in_the_same_words(built, tmp_path, edit, needle):
    root = tampered(built.bundle, tmp_path / "b", edit)
    code, out, err, unhandled = run_cli("generate", str(root), "--prompt-ids", "1,2", "--json")
    assert unhandled is None and code == 1, (out, err)
    generate_says = json.loads(out)["error"]["message"]
    with pytest.raises(NeffbuildError) as refused:
        open_configured(PluginConfig(str(root)))
    assert str(refused.value) == generate_says
    if needle is not None:
        assert needle in generate_says, generate_says


def test_the_plugin_opens_what_generate_serves(built):
    bundle = open_configured(PluginConfig(str(built.bundle)))
    facts = bundle.facts
    assert (facts.arch, facts.weights_dtype, facts.experts, facts.kv_dtype) == ("gpt_oss", "float32", "dense",
                                                                              "float32")
    assert facts.layer_buffers == (0, 0) and list(facts.kv_heads) == list(range(facts.config.num_key_value_heads))
    assert facts.engine_dtypes() == ("float32", "auto")
