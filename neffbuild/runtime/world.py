"""A rank's place in a sharded bundle's world: world checks, TP/EP group creation and registration.

``join`` creates every TP and EP group of a ``ParallelLayout`` and registers this rank's
under the names the compiled graphs use (``TP_GROUP``, ``EP_GROUP``), so one artifact
resolves each rank's own groups; each has an eager twin for Python-side collectives
(``parallel.eager_group``). Thin: standard library and torch only.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from neffbuild.errors import IncompatibleBundle
from neffbuild.runtime.parallel import EP_GROUP, TP_GROUP, ParallelLayout, eager_group, rank_tensor


@dataclass
class RankContext:
    """One rank's place in the world: its rank, its groups (registered by name), the DP-sync group."""

    parallel: ParallelLayout
    rank: int
    world_group: object | None
    groups: dict

    @property
    def rank_input(self) -> torch.Tensor:
        return rank_tensor(self.rank)


def check_world(layout: ParallelLayout, what: str = "bundle", group=None) -> int:
    """This process's rank in ``group`` (default: the world); a size that differs from the layout is refused."""
    live = dist.is_available() and dist.is_initialized()
    size = dist.get_world_size(group) if live else 1
    if size != layout.world_size:
        how = "a world of 1 (no torch.distributed process group)" if not live else f"a group of {size} ranks"
        raise IncompatibleBundle(
            f"{what} was compiled for {layout.describe()}, but this process runs in {how}; start "
            f"{layout.world_size} processes (`neffbuild generate` does this itself) or rebuild with a matching "
            f"parallel section")
    return dist.get_rank(group) if live else 0


def join(layout: ParallelLayout, what: str = "bundle", group=None) -> RankContext:
    """Create the TP and EP groups and register this rank's under the graphs' names.

    ``group`` is the bundle's world (default: the whole torch.distributed world; pass a
    subgroup when the job also holds other processes, e.g. a prefill worker). Collective
    over ``group``: every member calls it. Rank ids are ranks within ``group``.
    """
    rank = check_world(layout, what, group)
    if layout.world_size == 1:
        return RankContext(layout, 0, None, {})
    whole = group is None or group is dist.group.WORLD
    to_global = (lambda r: r) if whole else (lambda r: dist.get_global_rank(group, r))
    mine = {}
    for name, groups in ((TP_GROUP, layout.tp_groups()), (EP_GROUP, layout.ep_groups())):
        for ranks in groups:
            if not whole and rank not in ranks:
                continue  # outside the default world's collective creation, only members take part
            for key in (name, eager_group(name)):  # the graphs' group, then its eager twin (parallel.eager_group)
                pg = dist.new_group([to_global(r) for r in ranks], use_local_synchronization=not whole)
                if rank in ranks:
                    mine[key] = pg
    for name, pg in mine.items():
        register(name, pg)
    return RankContext(layout, rank, group or dist.group.WORLD, mine)


def register(name: str, group) -> None:
    """Make ``name`` resolve to ``group`` for functional collectives (replacing an older one)."""
    from torch._C._distributed_c10d import (
        _register_process_group,
        _unregister_process_group,
    )

    with contextlib.suppress(RuntimeError, ValueError):
        _unregister_process_group(name)
    _register_process_group(name, group)
