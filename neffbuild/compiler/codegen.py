"""Read the code AOTInductor generated: the C++ inside a ``.pt2`` (a zip archive).

The step-cost contract (docs/architecture.md) says no per-step work may scale with the KV
pool. A write through a view of a cache input compiles to loops over the whole buffer;
this module finds such loops by their bounds. With a prime ``num_blocks`` no other shape
of the graph is a multiple of it, so any loop bound divisible by ``num_blocks`` is a loop
that scales with the pool (a flat loop over a whole cache half, or the outer loop of a nest).
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

_LOOP = re.compile(r"for\s*\(\s*(?:int64_t|long|int)\s+(\w+)\s*=[^;]*;\s*\1\s*<\s*(?:static_cast<int64_t>\()?(\d+)L?")


def generated_sources(pt2: str | Path) -> dict[str, str]:
    """{member name: text} of every C++ source in the package."""
    with zipfile.ZipFile(pt2) as z:
        return {n: z.read(n).decode(errors="replace") for n in z.namelist() if n.endswith((".cpp", ".h"))}


def loop_bounds(pt2: str | Path) -> list[int]:
    """The constant upper bound of every ``for`` loop in the generated C++."""
    return [int(m.group(2)) for text in generated_sources(pt2).values() for m in _LOOP.finditer(text)]


def pool_loops(pt2: str | Path, num_blocks: int) -> list[int]:
    """Loop bounds that are multiples of ``num_blocks`` (use a prime pool size: see the module docstring)."""
    return [n for n in loop_bounds(pt2) if n % num_blocks == 0]


_ARRAY = re.compile(r"int_array_(\d+)\[\]\s*=\s*\{([^}]*)\}")
_ALLOC = re.compile(r"aoti_torch_empty_strided\(\s*\d+\s*,\s*int_array_(\d+)")


def buffer_shapes(pt2: str | Path) -> list[tuple[int, ...]]:
    """The shape of every buffer the generated wrapper allocates (``aoti_torch_empty_strided``)."""
    shapes = []
    for text in generated_sources(pt2).values():
        arrays = {m.group(1): tuple(int(v.strip().rstrip("L")) for v in m.group(2).split(",") if v.strip())
                  for m in _ARRAY.finditer(text)}
        shapes += [arrays[m.group(1)] for m in _ALLOC.finditer(text) if m.group(1) in arrays]
    return shapes
