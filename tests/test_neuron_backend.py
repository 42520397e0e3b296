"""Neuron backend: argument construction and failure advice here; integration where the SDK is."""

import pytest

from neffbuild.compiler.backends import get_backend, neuron
from neffbuild.errors import BackendUnavailable


def test_compiler_args():
    args = neuron.compiler_args(target="trn2", optlevel=2, lnc=1, flags=["--verbose=info"])
    assert args[:3] == ["--target=trn2", "--logical-nc-config=1", "--optlevel=2"] and args[-1] == "--verbose=info"
    assert "--model-type=transformer" in args and "--enable-saturate-infinity" not in args
    trn1 = neuron.compiler_args(target="trn1", optlevel=3, lnc=1)
    assert trn1[:2] == ["--target=trn1", "--optlevel=3"]  # trn1 has no logical NeuronCore config
    assert "--enable-saturate-infinity" in trn1


def test_instruction_limit_advice():
    msg = neuron.explain_failure("decode_b8_ctx131072", "ERROR [XTP002] Too many instructions after unroll")
    assert "decode_b8_ctx131072" in msg and "5,000,000" in msg and "optlevel" in msg
    assert neuron.explain_failure("x", "some other error") is None


@pytest.mark.skipif(neuron.available(), reason="the Neuron SDK is installed here")
def test_neuron_backend_unavailable_is_a_clear_error():
    with pytest.raises(BackendUnavailable, match="Neuron SDK"):
        get_backend("neuron")
    assert get_backend("auto").name == "inductor"


@pytest.mark.neuron
@pytest.mark.skipif(not neuron.available(), reason="needs the Neuron SDK (torch-neuronx, neuronx-cc): not installable "
                    "from public indexes, run on a Trainium host")
def test_neuron_compiles_tiny_decode(tmp_path):
    from neffbuild import grid, recipe
    from neffbuild.compiler.graphs import build_graph, target_graph
    from tests.conftest import TINY

    r = recipe.load(TINY)
    t = grid.targets(r)[0]
    module, inputs = build_graph(target_graph(r, t))
    be = get_backend("neuron", target=r.target, optlevel=r.optlevel, lnc=r.lnc)
    assert be.compile(be.export(module, inputs), tmp_path).stat().st_size > 0
