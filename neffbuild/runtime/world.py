"""A rank's place in a sharded bundle's world: world checks, TP/EP groups and their registration.

Two ways onto a world, one result (a ``RankContext``): ``join`` creates every TP and EP group of
a ``ParallelLayout`` (neffbuild's own engine, which starts its ranks itself); ``adopt`` takes the
groups a host engine already made for this rank (``HostGroups``: vLLM's TP, EP and DP groups),
checks their sizes against the layout, and creates nothing. Either way this rank's groups are
registered under the names the compiled graphs use (``TP_GROUP``, ``EP_GROUP``), so one artifact
resolves each rank's own groups, each with an eager twin for Python-side collectives
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


@dataclass(frozen=True)
class HostGroups:
    """The process groups a host engine made for one rank, which a sharded bundle opens onto (``open_bundle(...,
    host_groups=)``): ``rank`` is the rank's place in the bundle's world order (``dp_rank * tp + tp_rank``),
    ``tp`` / ``ep`` the groups of its TP and EP peers (None where that degree is 1), ``dp`` the group the step's
    DP collective runs over (None: no DP sync). ``eager_tp`` / ``eager_ep``: groups of the same ranks for the
    runtime's Python-side collectives, so they never interleave with the artifacts' on one group (default:
    ``tp`` / ``ep`` themselves, for a host whose eager code issues none on them)."""

    rank: int
    tp: object | None = None
    ep: object | None = None
    dp: object | None = None
    eager_tp: object | None = None
    eager_ep: object | None = None


def adopt(layout: ParallelLayout, host: HostGroups, what: str = "bundle") -> RankContext:
    """This rank's context on the host's groups: sizes checked against ``layout``, registered by name, none made."""
    if not 0 <= host.rank < layout.world_size:
        raise IncompatibleBundle(f"{what} was compiled for {layout.describe()}; host rank {host.rank} is outside it")
    mine = {}
    for name, kind, degree, pg, eager in ((TP_GROUP, "tp", layout.tp, host.tp, host.eager_tp),
                                          (EP_GROUP, "ep", layout.ep, host.ep, host.eager_ep)):
        if degree == 1:
            continue
        size = dist.get_world_size(pg) if pg is not None and dist.is_initialized() else 1
        if size != degree:
            raise IncompatibleBundle(f"{what} was compiled for {layout.describe()}: its {kind} group has {degree} "
                                     f"ranks, the host's has {size}; start the engine with the bundle's degrees")
        mine[name], mine[eager_group(name)] = pg, eager if eager is not None else pg
    for name, pg in mine.items():
        register(name, pg)
    return RankContext(layout, host.rank, host.dp, mine)


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
