"""Embedded default backend: ``torch.export`` + AOTInductor, artifacts without weights.

Artifacts are compiled with ``aot_inductor.package_constants_in_so=False``: the ``.pt2``
holds code only, and ``load`` binds the bundle's memory-mapped weights as user-managed
constants, so every artifact shares one copy (an artifact run before its constants are
bound crashes, so ``load`` always binds them).

Compiler flags are inductor config assignments ``name=value`` (``value`` parsed as JSON,
else kept as a string), e.g. ``max_autotune=true``. An unknown name is rejected by inductor.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import torch

from neffbuild.compiler.backends.base import Backend
from neffbuild.errors import InvalidInput


def parse_flags(flags) -> dict:
    out = {}
    for flag in flags:
        if "=" not in flag:
            raise InvalidInput(f"compiler.flags: {flag!r} must be name=value for the inductor backend")
        name, value = flag.split("=", 1)
        try:
            out[name.strip()] = json.loads(value)
        except ValueError:
            out[name.strip()] = value
    return out


def available() -> bool:
    return True  # embedded: torch is always here


class InductorBackend(Backend):
    name = "inductor"
    ext = "pt2"

    def __init__(self, flags: tuple[str, ...] = (), device: str = "cpu"):
        self.flags = tuple(flags)
        self.device = device

    @classmethod
    def create(cls, *, target, optlevel, lnc, flags, device):
        return cls(flags=flags, device=device)

    def export(self, module, example_inputs):
        with torch.no_grad():
            return torch.export.export(module, example_inputs, strict=False)

    def graph_text(self, exported) -> str:
        return exported.graph_module.print_readable(print_output=False, include_stride=True, include_device=True)

    def compile(self, exported, workdir: Path) -> Path:
        configs = {"aot_inductor.package_constants_in_so": False}
        configs.update(parse_flags(self.flags))
        path = Path(workdir) / f"artifact.{self.ext}"
        with torch.no_grad():
            torch._inductor.aoti_compile_and_package(exported, package_path=str(path), inductor_configs=configs)
        from neffbuild.compiler.reproducible import normalize_pt2

        normalize_pt2(path)  # same graph, same bytes: two cold builds give one manifest
        return path

    def load(self, path: Path, constants: dict[str, torch.Tensor], device: str = "cpu"):
        from neffbuild.runtime.loaders import load_inductor

        return load_inductor(Path(path), constants, self.fingerprint(), device)

    def fingerprint(self) -> dict:
        return {
            "backend": self.name,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "device": self.device,
            "flags": list(self.flags),
        }
