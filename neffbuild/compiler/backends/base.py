"""The backend interface: compile a (module, example inputs) into one file, load it back."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

import torch


class Backend(ABC):
    name: str
    ext: str  # artifact file extension, without the dot

    @classmethod
    @abstractmethod
    def create(cls, *, target: str, optlevel: int, lnc: int, flags: tuple, device: str) -> Backend:
        """The backend for a recipe's compiler settings (each takes what it uses)."""

    @abstractmethod
    def export(self, module: torch.nn.Module, example_inputs: tuple):
        """Trace the module; the result's text is part of the cache key."""

    @abstractmethod
    def graph_text(self, exported) -> str:
        """Canonical text of the traced graph (no weight values)."""

    @abstractmethod
    def compile(self, exported, workdir: Path) -> Path:
        """Compile into ``workdir``; return the artifact file path."""

    @abstractmethod
    def load(self, path: Path, constants: dict[str, torch.Tensor], device: str = "cpu"):
        """Load an artifact and bind the shared weights; return a callable."""

    @abstractmethod
    def fingerprint(self) -> dict:
        """Toolchain versions and flags: everything outside the graph that changes the output."""
