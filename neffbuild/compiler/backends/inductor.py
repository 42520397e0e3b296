"""Embedded default backend: ``torch.export`` + AOTInductor, artifacts without weights.

Artifacts are compiled with ``aot_inductor.package_constants_in_so=False``: the ``.pt2``
holds code only, and ``load`` binds the bundle's memory-mapped weights as user-managed
constants, so every artifact shares one copy (an artifact run before its constants are
bound crashes, so ``load`` always binds them).

Compiler flags are inductor config assignments ``name=value`` (``value`` parsed as JSON,
else kept as a string), e.g. ``max_autotune=true``, from the allow-list in compiler/backends/flag_rules.py.
"""

from __future__ import annotations

import contextlib
import platform
import time
from pathlib import Path

import torch

from neffbuild.compiler.backends.base import Backend
from neffbuild.compiler.reproducible import normalize_pt2
from neffbuild.errors import InvalidInput
from neffbuild.runtime.loaders import load_inductor


def parse_flags(flags) -> dict:
    """Inductor config assignments from the allow-list only (compiler/backends/flag_rules.py), checked again here:
    a Recipe built without the validator must not reach an option that names a program or a path."""
    from neffbuild.compiler.backends.flag_rules import inductor_problem, parse_value

    out = {}
    for flag in flags:
        why = inductor_problem(flag)
        if why:
            raise InvalidInput(f"compiler.flags: {flag!r}: {why}")
        name, value = flag.split("=", 1)
        out[name.strip()] = parse_value(value.strip())
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
        """Compile; ``self.profile`` then says where the time went (lowering vs each C++ build)."""
        configs = {"aot_inductor.package_constants_in_so": False}
        configs.update(parse_flags(self.flags))
        path = Path(workdir) / f"artifact.{self.ext}"
        cpp: list[tuple[str, float]] = []
        t0 = time.monotonic()
        with torch.no_grad(), _timed_cpp_builds(cpp):
            torch._inductor.aoti_compile_and_package(exported, package_path=str(path), inductor_configs=configs)
        total = time.monotonic() - t0
        self.profile = {"total_s": round(total, 2), "cpp_s": round(sum(s for _, s in cpp), 2),
                        "lowering_s": round(total - sum(s for _, s in cpp), 2),
                        "cpp_builds": [(name, round(s, 2)) for name, s in cpp]}
        normalize_pt2(path)  # same graph, same bytes: two cold builds give one manifest
        return path

    def load(self, path: Path, constants: dict[str, torch.Tensor], device: str = "cpu"):
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


@contextlib.contextmanager
def _timed_cpp_builds(out: list):
    """Record (output name, seconds) of every C++ compile/link inductor runs (profile only; no effect)."""
    try:
        from torch._inductor.cpp_builder import CppBuilder
    except ImportError:
        yield
        return
    original = CppBuilder.build

    def build(self, *args, **kwargs):
        t0 = time.monotonic()
        try:
            return original(self, *args, **kwargs)
        finally:
            name = Path(str(getattr(self, "_name", ""))).suffix or Path(str(getattr(self, "_target_file", ""))).suffix
            out.append((name.lstrip(".") or "?", time.monotonic() - t0))

    CppBuilder.build = build
    try:
        yield
    finally:
        CppBuilder.build = original
