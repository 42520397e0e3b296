"""Embedded default backend: ``torch.export`` + AOTInductor, artifacts without weights.

Artifacts are compiled with ``aot_inductor.package_constants_in_so=False``: the ``.pt2``
holds code only, and ``load`` binds the bundle's memory-mapped weights as user-managed
constants, so every artifact shares one copy (an artifact run before its constants are
bound crashes, so ``load`` always binds them).

The CPU target (``compiler.target``: an x86-64 micro-architecture level or ``native``; a
Neuron target such as ``trn2`` means "not named" and gives the portable default) sets
inductor's ``cpp.march`` (the ``-march`` of every C++ build; torch's own default is
``native``) and ``cpp.simdlen`` (the widest vector ISA it generates for). The resolved
target, its required CPU features and the C++ compiler's version are in the fingerprint,
so they are part of every cache key and of the manifest's toolchain.

Compiler flags are inductor config assignments ``name=value`` (``value`` parsed as JSON,
else kept as a string), e.g. ``max_autotune=true``, from the allow-list in compiler/backends/flag_rules.py.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import sys
import time
from pathlib import Path

import torch

from neffbuild.compiler.backends import objects
from neffbuild.compiler.backends.base import Backend
from neffbuild.compiler.reproducible import normalize_pt2
from neffbuild.errors import InvalidInput
from neffbuild.kernels.moe import native_cpu_ops
from neffbuild.runtime.bundle.loaders import load_inductor
from neffbuild.runtime.native import matmul_dtype

# AOTInductor options whose torch defaults come from the environment at import (AOT_INDUCTOR_*): each shapes the
# C++ build of every artifact, but no cache key names an environment variable. So the backend passes them itself,
# at torch's defaults (a recipe flag may change an allow-listed one, and flags are in the key); a variable left in
# a shell no longer changes an artifact under the same key. The values are artifact-shaping: changing one here
# must come with a fingerprint() change (today's keys were made under exactly these).
PINNED_CONFIGS = {
    "aot_inductor.compile_wrapper_opt_level": "O1",  # AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL: the wrapper's -O
    "aot_inductor.debug_compile": False,  # AOT_INDUCTOR_DEBUG_COMPILE: -O0 -g everywhere
    "aot_inductor.debug_symbols": False,  # AOT_INDUCTOR_DEBUG_SYMBOLS
    "aot_inductor.enable_frame_pointer": True,  # AOT_INDUCTOR_ENABLE_FRAME_POINTER
    "aot_inductor.enable_line_tables": True,  # AOT_INDUCTOR_ENABLE_LINE_TABLES: -g1
}


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

    def __init__(self, flags: tuple[str, ...] = (), device: str = "cpu", target: str | None = None):
        self.flags = tuple(flags)
        self.device = device
        self.cpu = cpu_target(target)

    @classmethod
    def create(cls, *, target, optlevel, lnc, flags, device):
        return cls(flags=flags, device=device, target=target)

    def export(self, module, example_inputs):
        """CPU graphs call the native ops (``kernels.moe.native_cpu_ops``: picked MXFP4 experts, a bf16 LM head); the
        artifact names them and the runtime registers them before an artifact's first call."""
        native = native_cpu_ops() if self.device == "cpu" else contextlib.nullcontext()
        with torch.no_grad(), native:
            return torch.export.export(module, example_inputs, strict=False)

    def graph_text(self, exported) -> str:
        return exported.graph_module.print_readable(print_output=False, include_stride=True, include_device=True)

    def configs(self) -> dict:
        """The inductor config of every compile: the pinned options, the CPU target, then the recipe's flags."""
        configs = {**PINNED_CONFIGS, "aot_inductor.package_constants_in_so": False, "cpp.march": self.cpu["march"]}
        if self.cpu["simdlen"] is not None:
            configs["cpp.simdlen"] = self.cpu["simdlen"]
        configs.update(parse_flags(self.flags))
        return configs

    def compile(self, exported, workdir: Path) -> Path:
        """Compile; ``self.profile`` then says where the time went (lowering vs each C++ build)."""
        configs = self.configs()
        path = Path(workdir) / f"artifact.{self.ext}"
        cpp: list[tuple[str, float, str]] = []
        t0 = time.monotonic()
        with torch.no_grad(), _timed_cpp_builds(cpp):
            torch._inductor.aoti_compile_and_package(exported, package_path=str(path), inductor_configs=configs)
        total = time.monotonic() - t0
        self.profile = {"total_s": round(total, 2), "cpp_s": round(sum(c[1] for c in cpp), 2),
                        "lowering_s": round(total - sum(c[1] for c in cpp), 2),
                        "cpp_builds": [(name, round(s, 2)) for name, s, _ in cpp],
                        "march": sorted({m for *_, cmd in cpp for m in cmd.split() if m.startswith("-march")})}
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
            "cpu_target": dict(self.cpu),
            "cxx": cxx_version(),
            # the decode graph's attention matmuls run in float32 on hosts without fast bf16 ones
            # (runtime.native.matmul_dtype): a graph traced here differs from one traced on such a host
            "bf16_matmul": str(matmul_dtype(torch.bfloat16)).removeprefix("torch."),
        }


def cpu_target(target: str | None) -> dict:
    """The resolved CPU target: a named -march level or native; anything else (a Neuron target, None) is the
    portable default (native where the machine has no levels)."""
    from neffbuild.runtime.bundle import cpu_features

    choices = cpu_features.targets()
    if target not in choices:
        target = cpu_features.DEFAULT_TARGET if cpu_features.DEFAULT_TARGET in choices else cpu_features.NATIVE
    return cpu_features.resolve(target)


_DEFAULT_CXX = "clang++" if sys.platform == "darwin" else "g++"  # inductor's own default (config.cpp.cxx)


@functools.cache
def cxx_version() -> str:
    """The first line of ``<cxx> --version`` for the C++ compiler inductor runs (part of every key).

    Inductor's config is read where this process has imported it (a compile worker, a recipe's ``cpp.cxx``
    flag applied); elsewhere its default is computed the way inductor computes it (``$CXX``, else g++):
    importing ``torch._inductor`` for this one value (dynamo comes with it) took a cache-hit ``neffbuild compile``
    from 2.1 to 3.3 CPU-seconds."""
    config = sys.modules.get("torch._inductor.config")
    setting = config.cpp.cxx if config is not None else (None, os.environ.get("CXX", _DEFAULT_CXX))
    cxx = setting[-1] if isinstance(setting, (tuple, list)) else setting
    line = objects.version_line(str(cxx))
    if line is None:
        return f"{cxx}: unavailable"
    return line or f"{cxx}: no version"


@contextlib.contextmanager
def _timed_cpp_builds(out: list):
    """Record (output name, seconds, command) of every C++ compile/link inductor runs (the profile), and take a
    compile-only step's object from the machine's object cache where the same bytes were compiled by the same
    command before (compiler/backends/objects.py; the name then ends in ``:kept``)."""
    try:
        from torch._inductor.cpp_builder import CppBuilder
    except ImportError:
        yield
        return
    original = CppBuilder.build
    keep = objects.enabled()

    def build(self, *args, **kwargs):
        t0 = time.monotonic()
        try:
            cmd = str(self.get_command_line())
        except Exception:  # profile only: a torch without the method
            cmd = ""
        parts = objects.builder_parts(self) if keep and cmd else None
        k = objects.key(cmd, parts[0]) if parts else None
        kept = k is not None and objects.fetch(k, parts[1])
        try:
            if not kept:
                result = original(self, *args, **kwargs)
                if k is not None:
                    objects.store(k, parts[1])
                return result
        finally:
            name = Path(str(getattr(self, "_name", ""))).suffix or Path(str(getattr(self, "_target_file", ""))).suffix
            out.append(((name.lstrip(".") or "?") + (":kept" if kept else ""), time.monotonic() - t0, cmd))

    CppBuilder.build = build
    try:
        yield
    finally:
        CppBuilder.build = original
