"""Neuron backend: torch-neuronx + neuronx-cc -> one NEFF (a TorchScript module) per target.

Traced per the SDK's documented contract (torch-neuronx "Tracing API for Inference"):

- **weights apart from the NEFF**: ``inline_weights_to_neff=False``; the workers trace with
  placeholder weights, so an inlined NEFF would carry them. The runtime binds the bundle's
  weights with ``torch_neuronx.replace_weights`` (``runtime/bundle/loaders.py``, the one loading
  path, which ``load`` here uses too). Placeholders are zero-stride views, so the saved
  module carries no weight-sized bytes.
- **KV caches are declared state**: the traced wrapper returns the updated KV buffers and
  ``input_output_aliases`` maps each KV input to its output, so the device updates the
  cache in place (an undeclared input is never written back to the caller's tensor).
- inputs are flattened (7 step tensors, then the KV buffers); outputs are
  ``(*kv_buffers, *visible)`` so the alias indices do not depend on the family.

The SDK is not on public package indexes, so this backend is detected at run time
(``available()``). Tests run it through a CPU stand-in (``tests/sdk_standin``); what that
proves and what only a Trainium host proves is in docs/neuron.md.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from neffbuild.compiler.backends.base import Backend
from neffbuild.errors import BuildFailed
from neffbuild.runtime.bundle.loaders import NEURON_WEIGHT_PREFIX, load_neuron

TOO_MANY_INSTRUCTIONS = re.compile(r"XTP002|[Tt]oo many instructions")
INSTRUCTION_LIMIT = 5_000_000
LNC_TARGETS = ("trn2", "trn3")  # --logical-nc-config exists on these; trn1 runs LNC 1 only


def available() -> bool:
    return importlib.util.find_spec("torch_neuronx") is not None and importlib.util.find_spec("neuronxcc") is not None


def compiler_args(*, target: str, optlevel: int, lnc: int, flags=(), workdir: Path | None = None) -> list[str]:
    """neuronx-cc arguments for one decode graph (names from the neuronx-cc CLI reference)."""
    args = [f"--target={target}"]
    if target in LNC_TARGETS:
        args.append(f"--logical-nc-config={lnc}")
    args += [f"--optlevel={optlevel}", "--model-type=transformer", "--auto-cast=none"]
    if target == "trn1":
        args.append("--enable-saturate-infinity")  # only trn1 needs it (trn2 accepts and ignores it)
    if workdir is not None:
        args.append(f"--logfile={Path(workdir) / 'neuronx-cc.log'}")
    return args + list(flags)


def explain_failure(label: str, log_text: str) -> str | None:
    """Recognise known compiler failures and say what to do."""
    if TOO_MANY_INSTRUCTIONS.search(log_text):
        return (
            f"{label}: neuronx-cc hit the instruction limit (XTP002, {INSTRUCTION_LIMIT:,} instructions); "
            "lower this bucket (smaller decode_context_length_buckets or num_seqs_buckets) or compiler.optlevel"
        )
    return None


class StatefulStep(nn.Module):
    """The traced function: flat inputs; returns the updated KV buffers first, then the step's outputs."""

    def __init__(self, model: nn.Module, num_head: int):
        super().__init__()
        self.model = model  # weights appear as ``model.<name>`` (NEURON_WEIGHT_PREFIX)
        self.num_head = num_head

    def forward(self, *flat):
        caches = flat[self.num_head:]
        out = self.model(*flat[: self.num_head], tuple(caches))
        visible = out if isinstance(out, tuple) else (out,)
        return (*caches, *visible)


@dataclass
class NeuronGraph:
    """What ``export`` hands to ``compile``: the wrapper, its flat inputs, and the graph text for the key."""

    module: StatefulStep
    inputs: tuple
    num_state: int
    text: str


def zero_stride_placeholders(module: nn.Module) -> None:
    """Replace the weights by zero-stride views of one zero: same shapes and dtypes, no bytes to save."""
    for name in list(module.state_dict()):
        *path, leaf = name.split(".")
        owner = module.get_submodule(".".join(path))
        value = getattr(owner, leaf)
        placeholder = torch.zeros((), dtype=value.dtype).expand(value.shape)
        if isinstance(value, nn.Parameter):
            setattr(owner, leaf, nn.Parameter(placeholder, requires_grad=False))
        else:
            owner.register_buffer(leaf, placeholder, persistent=True)


def sdk_version(module: str, dist: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        try:
            return getattr(importlib.import_module(module), "__version__", None)
        except ImportError:
            return None


class NeuronBackend(Backend):
    name = "neuron"
    ext = "neff"

    def __init__(self, *, target: str, optlevel: int, lnc: int, flags=()):
        self.target, self.optlevel, self.lnc, self.flags = target, optlevel, lnc, tuple(flags)

    @classmethod
    def create(cls, *, target, optlevel, lnc, flags, device):
        if target not in ("trn1", "trn2", "trn3"):
            from neffbuild.errors import InvalidInput

            raise InvalidInput(f"compiler.target: got {target!r}, a CPU target for the inductor backend; the neuron "
                               f"backend takes trn1 or trn2 (set compiler.backend: inductor to build for a CPU)")
        return cls(target=target, optlevel=optlevel, lnc=lnc, flags=flags)

    def export(self, module, example_inputs):
        with torch.no_grad():
            ep = torch.export.export(module, example_inputs, strict=False)
        text = ep.graph_module.print_readable(print_output=False, include_stride=True)
        *head, caches = example_inputs
        zero_stride_placeholders(module)
        return NeuronGraph(StatefulStep(module, len(head)).eval(), (*head, *caches), len(caches), text)

    def graph_text(self, exported: NeuronGraph) -> str:
        return exported.text

    def trace_options(self, graph: NeuronGraph) -> dict:
        """Weights apart from the NEFF; every KV buffer declared state, aliased to its output."""
        state = graph.inputs[len(graph.inputs) - graph.num_state:]
        return {"inline_weights_to_neff": False, "input_output_aliases": {t: i for i, t in enumerate(state)}}

    def compile(self, exported: NeuronGraph, workdir: Path) -> Path:
        import torch_neuronx  # only on hosts with the SDK

        args = compiler_args(target=self.target, optlevel=self.optlevel, lnc=self.lnc, flags=self.flags,
                             workdir=workdir)
        path = Path(workdir) / f"artifact.{self.ext}"
        try:
            traced = torch_neuronx.trace(exported.module, exported.inputs, compiler_args=args,
                                         compiler_workdir=str(workdir), **self.trace_options(exported))
        except Exception as exc:  # the SDK raises its own types
            log = Path(workdir) / "neuronx-cc.log"
            advice = explain_failure(path.stem, (log.read_text() if log.exists() else "") + str(exc))
            raise BuildFailed(advice or f"neuronx-cc failed: {exc}") from exc
        torch.jit.save(traced, str(path))
        return path

    def load(self, path: Path, constants, device: str = "cpu"):
        return load_neuron(Path(path), constants, self.fingerprint(), device)

    def fingerprint(self) -> dict:
        return {"backend": self.name, "torch": torch.__version__,
                "torch_neuronx": sdk_version("torch_neuronx", "torch-neuronx"),
                "neuronx_cc": sdk_version("neuronxcc", "neuronx-cc"),
                "target": self.target, "optlevel": self.optlevel, "lnc": self.lnc, "flags": list(self.flags),
                "weights": "separate", "weight_prefix": NEURON_WEIGHT_PREFIX, "kv_state": "input_output_aliases"}
