"""The eager decode graph behind the runtime's ``Artifacts`` protocol (the ``--check`` reference)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from neffbuild.runtime.kv.cache import KVLayout
from neffbuild.runtime.step.dispatch import Grid


@dataclass
class EagerArtifacts:
    """Every label runs the same eager module (it takes any shape): the oracle for compiled steps."""

    grid: Grid
    kv_layout: KVLayout
    num_swa: int
    module: torch.nn.Module

    def artifact(self, label: str):
        return torch.no_grad()(self.module.forward)
