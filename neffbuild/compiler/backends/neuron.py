"""Neuron backend: torch-neuronx + neuronx-cc -> a NEFF per target, for trn1/trn2.

The Neuron SDK is not on public package indexes, so this backend is detected at run time
(``available()``); the recipe still validates and plans anywhere. Compiler arguments are
built by ``compiler_args`` (unit-tested here); compiling runs only where the SDK imports.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from neffbuild.compiler.backends.base import Backend
from neffbuild.errors import BuildFailed

TOO_MANY_INSTRUCTIONS = re.compile(r"XTP002|[Tt]oo many instructions")
INSTRUCTION_LIMIT = 5_000_000


def available() -> bool:
    return importlib.util.find_spec("torch_neuronx") is not None and importlib.util.find_spec("neuronxcc") is not None


def compiler_args(*, target: str, optlevel: int, lnc: int, flags=(), workdir: Path | None = None) -> list[str]:
    """neuronx-cc arguments for one decode graph."""
    args = [
        f"--target={target}",
        f"--lnc={lnc}",
        f"-O{optlevel}",
        "--model-type=transformer",
        "--auto-cast=none",
        "--enable-saturate-infinity",
    ]
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


class NeuronBackend(Backend):
    name = "neuron"
    ext = "neff"

    def __init__(self, *, target: str, optlevel: int, lnc: int, flags=()):
        self.target, self.optlevel, self.lnc, self.flags = target, optlevel, lnc, tuple(flags)

    def export(self, module, example_inputs):
        return (module, example_inputs)

    def graph_text(self, exported) -> str:
        import torch

        module, example_inputs = exported
        with torch.no_grad():
            ep = torch.export.export(module, example_inputs, strict=False)
        return ep.graph_module.print_readable(print_output=False, include_stride=True)

    def compile(self, exported, workdir: Path) -> Path:
        import torch_neuronx  # noqa: F401  - only on hosts with the SDK

        module, example_inputs = exported
        args = compiler_args(target=self.target, optlevel=self.optlevel, lnc=self.lnc, flags=self.flags, workdir=workdir)
        path = Path(workdir) / f"artifact.{self.ext}"
        try:
            traced = torch_neuronx.trace(module, example_inputs, compiler_args=args, compiler_workdir=str(workdir))
        except Exception as exc:  # the SDK raises its own types
            log = Path(workdir) / "neuronx-cc.log"
            advice = explain_failure(path.stem, (log.read_text() if log.exists() else "") + str(exc))
            raise BuildFailed(advice or f"neuronx-cc failed: {exc}") from exc
        torch_neuronx.save(traced, str(path)) if hasattr(torch_neuronx, "save") else traced.save(str(path))
        return path

    def load(self, path: Path, constants, device: str = "cpu"):
        import torch

        return torch.jit.load(str(path))

    def fingerprint(self) -> dict:
        import importlib.metadata as md

        def version(pkg):
            try:
                return md.version(pkg)
            except md.PackageNotFoundError:
                return None

        return {"backend": self.name, "torch_neuronx": version("torch-neuronx"), "neuronx_cc": version("neuronx-cc"),
                "target": self.target, "optlevel": self.optlevel, "lnc": self.lnc, "flags": list(self.flags)}
