"""Compiler backends behind one interface; ``get_backend`` resolves ``auto``."""

from __future__ import annotations

from neffbuild.compiler.backends.base import Backend
from neffbuild.errors import BackendUnavailable, InvalidInput

NAMES = ("inductor", "neuron")


def get_backend(name: str, *, target: str = "trn2", optlevel: int = 2, lnc: int = 1, flags=(),
                device: str = "cpu") -> Backend:
    """``auto`` picks neuron when the Neuron SDK imports, else inductor."""
    from neffbuild.compiler.backends import inductor, neuron

    if name == "auto":
        name = "neuron" if neuron.available() else "inductor"
    if name == "inductor":
        return inductor.InductorBackend(flags=tuple(flags), device=device)
    if name == "neuron":
        if not neuron.available():
            raise BackendUnavailable(
                "backend 'neuron' needs the Neuron SDK (torch-neuronx, neuronx-cc), which is not importable here; "
                "run on a Trainium/Inferentia host with the SDK, or use --backend inductor"
            )
        return neuron.NeuronBackend(target=target, optlevel=optlevel, lnc=lnc, flags=tuple(flags))
    raise InvalidInput(f"unknown backend {name!r}; choose one of auto, {', '.join(NAMES)}")
