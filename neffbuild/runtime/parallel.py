"""The parallel layout of a bundle (tp, dp, ep) and the process groups its artifacts use.

World = tp x dp ranks. Rank r is TP rank ``r % tp`` of DP group ``r // tp``; the ranks of
one DP group hold the same requests and split the attention heads. Experts are split over
EP groups of ``ep`` consecutive ranks (``ep`` divides the world), EP rank ``r % ep``; each
EP group holds every expert once. When an EP group sits inside one DP group
(``tp % ep == 0``) its ranks hold the same tokens and the MoE combines with one all-reduce;
otherwise the group gathers its ranks' tokens, each rank applies its own experts, and a
reduce-scatter sums the experts' outputs and hands each rank back its own rows.

Compiled graphs name their groups by fixed strings (``TP_GROUP``, ``EP_GROUP``), never by
rank lists, so one artifact serves every rank: each rank registers ITS groups under those
names (``join``) before running an artifact, and each group's eager twin (``eager_group``).
Standard library only at import (torch inside ``rank_tensor``), so the recipe validator uses
the same layout rules without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

TP_GROUP = "neffbuild_tp"  # the group an attention all-reduce runs over
EP_GROUP = "neffbuild_ep"  # the group the MoE combine runs over


def eager_group(name: str) -> str:
    """The name of ``name``'s eager twin: the same ranks in a process group of their own, which eager (Python)
    collectives use, so artifacts and eager code never share a group (why: ``neffbuild.kernels.collectives``)."""
    return f"{name}_eager"


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1
    dp: int = 1
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.dp

    @property
    def sharded(self) -> bool:
        """True when a rank's graph holds a shard and runs collectives (tp or ep above 1)."""
        return self.tp > 1 or self.ep > 1

    @property
    def ep_gathers(self) -> bool:
        """The EP group spans DP groups, so the MoE gathers tokens (else one all-reduce)."""
        return self.ep > 1 and self.tp % self.ep != 0

    @property
    def ep_combine(self) -> str:
        """How the MoE output is combined across the EP group (none, all_reduce, gather_reduce_scatter)."""
        return "none" if self.ep == 1 else ("gather_reduce_scatter" if self.ep_gathers else "all_reduce")

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def dp_rank(self, rank: int) -> int:
        return rank // self.tp

    def ep_rank(self, rank: int) -> int:
        return rank % self.ep

    def tp_groups(self) -> list[list[int]]:
        return [list(range(g * self.tp, (g + 1) * self.tp)) for g in range(self.dp)]

    def ep_groups(self) -> list[list[int]]:
        return [list(range(g * self.ep, (g + 1) * self.ep)) for g in range(self.world_size // self.ep)]

    def to_json(self) -> dict:
        return {"tp": self.tp, "dp": self.dp, "ep": self.ep, "world_size": self.world_size}

    @classmethod
    def from_json(cls, d: dict) -> ParallelLayout:
        return cls(int(d.get("tp", 1)), int(d.get("dp", 1)), int(d.get("ep", 1)))

    def describe(self) -> str:
        ep = f"ep {self.ep} ({'gather + reduce-scatter' if self.ep_gathers else 'all-reduce'} MoE combine)" \
            if self.ep > 1 else "ep 1 (experts replicated)"
        return f"tp {self.tp} x dp {self.dp} = {self.world_size} ranks; {ep}"


@dataclass(frozen=True)
class ParallelSection:
    """The manifest's ``parallel`` section (sharded bundles only; docs/bundle-format.md), one type for the
    builder that writes it and every reader. Which pieces a rank maps is the architecture's rule
    (``models/<arch>/sharding.py``); the builder records its answer per rank in ``rank_pieces``, so a
    reader maps data and restates no rule."""

    parallel: ParallelLayout
    pieces: dict  # piece name -> {file, tensors}, like the manifest's ``weights``
    rank_pieces: tuple[tuple[str, ...], ...]  # per world rank: the pieces it maps besides ``weights.file``
    shard_layout: dict  # split tensor -> {over: "tp"|"ep", axis}
    kv_heads: dict  # "tp{r}" -> the model KV heads TP rank r holds

    def pieces_of(self, rank: int) -> tuple[str, ...]:
        return self.rank_pieces[rank]

    def to_json(self) -> dict:
        return dict(self.parallel.to_json(), ep_combine=self.parallel.ep_combine, pieces=self.pieces,
                    rank_pieces=[list(p) for p in self.rank_pieces], shard_layout=self.shard_layout,
                    kv_heads=self.kv_heads)

    @classmethod
    def of_manifest(cls, manifest: dict) -> ParallelSection | None:
        """A manifest's section, or None for an unsharded bundle."""
        return cls.from_json(manifest["parallel"]) if "parallel" in manifest else None

    @classmethod
    def from_json(cls, d: dict) -> ParallelSection:
        """From a schema-checked manifest field (runtime/bundle/reader.py checks it before anything reads it)."""
        return cls(ParallelLayout.from_json(d), dict(d["pieces"]), tuple(tuple(p) for p in d["rank_pieces"]),
                   dict(d.get("shard_layout", {})), dict(d.get("kv_heads", {})))


def rank_tensor(rank: int) -> torch.Tensor:
    """The rank id a sharded artifact takes as its last input (it picks the rank's experts)."""
    import torch  # lazy: ParallelLayout is torch-free (the recipe validator imports it)

    return torch.tensor([rank], dtype=torch.long)
