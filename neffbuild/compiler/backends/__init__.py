"""Compiler backends behind one interface; ``get_backend`` resolves ``auto`` (registry order)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from neffbuild import registry
from neffbuild.errors import BackendUnavailable

if TYPE_CHECKING:  # base.py imports torch; the package stays torch-free for neuron_rules (recipe validation)
    from neffbuild.compiler.backends.base import Backend

NAMES = tuple(registry.BACKENDS)


def get_backend(name: str, *, target: str = "trn2", optlevel: int = 2, lnc: int = 1, flags=(),
                device: str = "cpu") -> Backend:
    """``auto`` picks the first available backend in the registry (neuron where the Neuron SDK imports)."""
    if name == registry.AUTO:
        name = next(n for n, e in registry.BACKENDS.items() if e.get("available")())
    entry = registry.backend(name)
    if not entry.get("available")():
        raise BackendUnavailable(
            f"backend {name!r} needs the Neuron SDK (torch-neuronx, neuronx-cc), which is not importable here; "
            "run on a Trainium/Inferentia host with the SDK, or use --backend inductor"
        )
    return entry.get("compile_side").create(target=target, optlevel=optlevel, lnc=lnc, flags=tuple(flags),
                                            device=device)
