"""The neuron backend end to end through the CPU stand-in of the Neuron SDK (tests/sdk_standin).

compile -> inspect -> verify -> generate --check on a backend: neuron bundle; the stand-in
catches the two faults the SDK contract guards against (inlined placeholder weights, KV
not declared as state); a bundle for another NeuronCore target or LNC is refused.
"""

import json
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch import nn

from tests.helpers import ROOT, STANDIN, cli, neuron_recipe, standin_env

pytestmark = pytest.mark.slow

PROMPTS = ["--prompt-ids", ",".join(str(i % 200 + 1) for i in range(120)), "--prompt-ids", "7,8,9"]


def _cli(env, *args):
    return cli(*args, env=env, process=True)  # a process: the stand-in SDK must stay out of this one


def test_neuron_bundle_compile_inspect_verify_generate_check(neuron_bundle):
    bundle, env = neuron_bundle.bundle, neuron_bundle.env
    m = json.loads(_cli(env, "inspect", str(bundle), "--json").stdout)
    tc = m["toolchain"]
    assert (tc["backend"], tc["target"], tc["lnc"], tc["weights"]) == ("neuron", "trn2", 2, "separate")
    assert tc["torch_neuronx"] == tc["neuronx_cc"] == "0.0.0+standin"  # SDK versions recorded
    assert sorted(a["file"] for a in m["artifacts"])[0].endswith(".neff") and len(m["artifacts"]) == 4
    weights = m["files"][m["weights"]["file"]]["bytes"]
    assert all(a["bytes"] < weights / 2 for a in m["artifacts"])  # the weights are not inside the NEFFs
    assert _cli(env, "verify", str(bundle)).returncode == 0
    out = _cli(env, "generate", str(bundle), *PROMPTS, "--max-new-tokens", "10", "--check")
    assert out.returncode == 0, out.stderr
    assert "check: tokens equal the eager reference" in out.stderr
    assert "decode_b2_ctx128" in out.stderr and "decode_b2_ctx512" in out.stderr  # crossed a bucket


FAULTY_BUILD = textwrap.dedent("""
    import sys
    from neffbuild import recipe
    from neffbuild.compiler.backends import neuron
    from neffbuild.compiler.builder import compile_recipe
    from neffbuild.compiler.executor import InlineExecutor

    fault = {fault!r}
    proper = neuron.NeuronBackend.trace_options
    neuron.NeuronBackend.trace_options = lambda self, graph: {{**proper(self, graph), **fault}}
    res = compile_recipe(recipe.load(sys.argv[1]), sys.argv[2], executor=InlineExecutor())
    assert not res.failed, res.failed
    print(res.bundle)
""")


@pytest.mark.parametrize("fault", [{"inline_weights_to_neff": True}, {"input_output_aliases": {}}],
                         ids=["inlined_placeholder_weights", "kv_not_declared_state"])
def test_standin_catches_a_wrongly_traced_neff(fault, tmp_path, small_checkpoint):
    """A backend that inlines its placeholder weights, or leaves KV undeclared, fails generate --check."""
    env = standin_env(tmp_path / "cache")
    path = neuron_recipe(tmp_path, small_checkpoint, "faulty", num_seqs_buckets=(1,))
    build = subprocess.run([sys.executable, "-c", FAULTY_BUILD.format(fault=fault), str(path), str(tmp_path / "out")],
                           capture_output=True, text=True, cwd=ROOT, env=env)
    assert build.returncode == 0, build.stderr
    bundle = build.stdout.strip().splitlines()[-1]
    out = _cli(env, "generate", bundle, "--prompt-ids", "5,6,7,8", "--max-new-tokens", "4", "--check")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "--check: tokens differ from the eager reference" in out.stderr
    assert "a real difference" in out.stderr and "margin" in out.stderr  # the rule's verdict, with the margin
    doc = json.loads(_cli(env, "generate", bundle, "--prompt-ids", "5,6,7,8", "--max-new-tokens", "4", "--check",
                          "--json").stdout)  # one document: a second after it would not parse
    assert doc["ok"] is False and doc["error"]["exit_code"] == 1 and doc["check"]["differences"], doc
    assert "tokens" in doc and not doc["check"]["differences"][0]["near_tie"]


@pytest.mark.parametrize("extra,message", [
    ({"STANDIN_NEURON_PLATFORM": "trn1"}, "compiled for trn2 with logical NeuronCore config 2, and this host is trn1"),
    ({"NEURON_LOGICAL_NC_CONFIG": "1"}, "set NEURON_LOGICAL_NC_CONFIG=2"),
])
def test_neuron_bundle_refuses_another_target_or_lnc(neuron_bundle, extra, message):
    bundle, env = neuron_bundle.bundle, neuron_bundle.env
    out = _cli({**env, **extra}, "generate", str(bundle), "--prompt-ids", "1,2", "--max-new-tokens", "2")
    assert out.returncode == 1 and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


# -- the stand-in's own contract, on a two-line module


@pytest.fixture
def sdk(monkeypatch):
    """The stand-in imported in this process, and gone from sys.modules afterwards."""
    monkeypatch.syspath_prepend(str(STANDIN))
    import torch_neuronx

    yield torch_neuronx
    for name in [n for n in sys.modules if n.split(".")[0] in ("torch_neuronx", "neuronxcc")]:
        del sys.modules[name]  # not through monkeypatch: its undo would put them back



class Scale(nn.Module):
    """out = x * w; also writes x * w into ``state`` in place and returns it."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.full((3,), 2.0), requires_grad=False)

    def forward(self, x, state):
        state.copy_(x * self.w)
        return x * self.w, state


ARGS = ["--target=trn2", "--logical-nc-config=2"]


def test_standin_inlined_weights_are_frozen_at_trace_time(sdk):
    m = Scale()
    traced = sdk.trace(m, (torch.ones(3), torch.zeros(3)), compiler_args=ARGS)
    m.w.fill_(5.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sdk.replace_weights(traced, {"w": torch.full((3,), 7.0)})
    assert "does not contain any separated weights" in str(caught[0].message)
    assert torch.equal(traced(torch.ones(3), torch.zeros(3))[0], torch.full((3,), 2.0))


def test_standin_separate_weights_are_replaced(sdk, tmp_path):
    traced = sdk.trace(Scale(), (torch.ones(3), torch.zeros(3)), compiler_args=ARGS, inline_weights_to_neff=False)
    torch.jit.save(traced, tmp_path / "m.neff")
    loaded = torch.jit.load(tmp_path / "m.neff")
    sdk.replace_weights(loaded, {"w": torch.full((3,), 7.0)})
    assert torch.equal(loaded(torch.ones(3), torch.zeros(3))[0], torch.full((3,), 7.0))
    with pytest.raises(ValueError, match="replace_weights: w is"):
        sdk.replace_weights(loaded, {"w": torch.zeros(4)})


def test_standin_writes_back_declared_state_only(sdk):
    x, state = torch.ones(3), torch.zeros(3)
    undeclared = sdk.trace(Scale(), (x, state), compiler_args=ARGS, inline_weights_to_neff=False)
    declared = sdk.trace(Scale(), (x, state), compiler_args=ARGS, inline_weights_to_neff=False,
                         input_output_aliases={state: 1})
    caller = torch.zeros(3)
    undeclared(torch.ones(3), caller)
    assert torch.equal(caller, torch.zeros(3))  # written on the device copy, never in the caller's tensor
    declared(torch.ones(3), caller)
    assert torch.equal(caller, torch.full((3,), 2.0))
    with pytest.raises(ValueError, match="cannot alias output 0"):
        ints = torch.zeros(3, dtype=torch.long)
        sdk.trace(Scale(), (x, ints), compiler_args=ARGS, input_output_aliases={ints: 0})


def test_standin_compiler_refuses_lnc2_on_trn1(sdk):
    with pytest.raises(ValueError, match="NCC_EARG001"):
        sdk.trace(Scale(), (torch.ones(3), torch.zeros(3)), compiler_args=["--target=trn1", "--logical-nc-config=2"])


def test_standin_is_gone_after_a_test_that_used_it():
    """Runs after the stand-in tests above: other tests must see a host without the SDK (``auto`` -> inductor)."""
    from neffbuild.compiler.backends import neuron

    assert "torch_neuronx" not in sys.modules and not neuron.available()
