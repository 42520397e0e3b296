"""Stand-in for ``torch_neuronx.utils`` (tests only)."""

from __future__ import annotations

import os

# The platform this "host" reports; tests set it to play a trn1 or trn2 machine.
PLATFORM_ENV = "STANDIN_NEURON_PLATFORM"


def get_platform_target() -> str:
    """The instance's platform string (``trn1``, ``inf2``, ``trn2``), as the SDK documents."""
    return os.environ.get(PLATFORM_ENV, "trn2")
