"""CPU instruction-set targets of inductor artifacts, and the check a host makes before loading one.

An AOTInductor artifact is native code compiled for one ``-march``; run on a CPU without the
instructions it uses, it dies with SIGILL. The compile side records, per bundle, the target
(``-march`` value), the vector width inductor generated for, and the CPU features the code may
use; ``missing`` tells an opening host which of those it lacks (read from /proc/cpuinfo, names
as the Linux kernel spells them). Standard library only: the runtime imports this.

Covers x86-64 (the psABI micro-architecture levels and ``native``). On another machine only
``native`` is offered, and the check compares the recorded host features the same way.
"""

from __future__ import annotations

import functools
import platform

NATIVE = "native"
DEFAULT_TARGET = "x86-64-v3"  # portable baseline: every x86 server CPU since 2015 (see docs/recipe.md)

_V2 = ("cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3")
_V3 = _V2 + ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")
_V4 = _V3 + ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
# -march value -> (features the code may use, inductor's cpp.simdlen: the widest vector it emits)
LEVELS: dict[str, tuple[tuple[str, ...], int]] = {
    "x86-64": ((), 0),  # SSE2 only: inductor emits scalar C++ (its vector ISAs start at AVX2)
    "x86-64-v2": (_V2, 0),
    "x86-64-v3": (_V3, 256),  # AVX2
    "x86-64-v4": (_V4, 512),  # AVX-512
}
# The ISA extensions a ``native`` build records from the build host (flags that change which
# instructions the compiler may emit; cache sizes, virtualisation and errata flags do not).
_ISA_PREFIXES = ("sse", "ssse3", "avx", "amx", "fma", "f16c", "bmi", "popcnt", "movbe", "abm", "lzcnt", "adx",
                 "aes", "pclmulqdq", "vaes", "vpclmulqdq", "gfni", "sha_ni", "cx16", "lahf_lm", "xsave", "rdrand",
                 "rdseed", "prfchw", "clflushopt", "clwb", "movdir", "serialize", "waitpkg", "asimd", "sve", "bf16",
                 "i8mm", "fp", "atomics", "crc32", "dotprod")


def targets() -> tuple[str, ...]:
    """The ``compiler.target`` values the inductor backend takes on this machine."""
    return (NATIVE, *LEVELS) if platform.machine() in ("x86_64", "AMD64") else (NATIVE,)


@functools.cache
def host_features() -> frozenset[str]:
    """This CPU's feature flags (``flags`` / ``Features`` of /proc/cpuinfo); empty where unreadable."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                name, _, value = line.partition(":")
                if name.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def isa_features(flags) -> list[str]:
    """The instruction-set extensions among ``flags`` (sorted)."""
    return sorted(f for f in flags if f.startswith(_ISA_PREFIXES))


def resolve(target: str) -> dict:
    """``{"target", "march", "simdlen", "features"}`` for a ``compiler.target`` value (``features``: required)."""
    if target == NATIVE:
        return {"target": NATIVE, "march": NATIVE, "simdlen": None, "features": isa_features(host_features())}
    features, simdlen = LEVELS[target]
    return {"target": target, "march": target, "simdlen": simdlen, "features": sorted(features)}


def missing(required) -> list[str]:
    """The features in ``required`` this host lacks (none when the host's flags cannot be read: no false alarm)."""
    have = host_features()
    if not have:
        return []
    return sorted(f for f in (required or ()) if f not in have)
