"""The source files that shape a traced graph, and their digest (part of every pre-key).

Found, not listed: the modules reachable by imports (at module top or inside functions) from
the graph definitions (``compiler/graphs.py``, ``models/``, ``compiler/backends/``) and the
kernels. A runtime module the graphs never import (``runtime/step/histogram.py``, ``runtime/step/stepper.py``)
is not among them, so editing it leaves every pre-key valid.
"""

from __future__ import annotations

import ast
import functools
import hashlib
from pathlib import Path

ROOTS = ("neffbuild/kernels", "neffbuild/models", "neffbuild/compiler/graphs.py", "neffbuild/compiler/backends")
PACKAGES = ("neffbuild",)


def _module_file(root: Path, name: str) -> Path | None:
    base = root.joinpath(*name.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def _imports(root: Path, path: Path) -> set[Path]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name.split(".")[0] in PACKAGES:
                parts = name.split(".")
                for i in range(1, len(parts) + 1):  # a package's __init__ runs before its submodules
                    f = _module_file(root, ".".join(parts[:i]))
                    if f is not None:
                        out.add(f)
    return out


def graph_sources(root: Path) -> list[Path]:
    """Every source file under ``root`` reachable from the graph definitions, sorted."""
    todo = []
    for rel in ROOTS:
        p = root / rel
        todo += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    seen: set[Path] = set()
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        todo += _imports(root, f) - seen
    return sorted(seen)


def digest(root: Path) -> str:
    h = hashlib.sha256()
    for f in graph_sources(root):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


@functools.cache
def source_digest() -> str:
    """sha256 over the source that shapes a graph in this checkout."""
    import neffbuild

    return digest(Path(neffbuild.__file__).resolve().parent.parent)
