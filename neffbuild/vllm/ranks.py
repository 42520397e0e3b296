"""A vLLM worker's place in a sharded bundle's world: the ``HostGroups`` the bundle opens onto.

vLLM makes one torch.distributed world of every rank (``tp x dp``; its DP ranks' engine cores join it), global
rank ``dp_rank * tp + tp_rank``: the bundle's own rank order (``ParallelLayout``), which is checked, not assumed.
The plugin does not run its collectives on vLLM's groups themselves but on twins, gloo groups of the same ranks
made here when the model is built (every rank builds it at once):

- vLLM issues its own collectives on its groups (its shared-memory all-reduce and the DP group's per-step
  ``coordinate_batch_across_dp`` on the CPU group) at points the plugin does not see; on a twin, the order of the
  plugin's collectives is the plugin's alone, so the two libraries can never wait on each other's;
- the artifacts' in-graph collectives and the eager prefill's must not share a group either (a gloo worker and
  the GIL: neffbuild/kernels/collectives.py), so TP and EP each get two twins, as ``world.join`` makes them.

The DP group's twin carries the runtime's one MAX all-reduce per step (``Stepper.plan``): vLLM's own per-step
coordination is a fixed ``[4, dp]`` tensor inside its runner, with no room for the bucket inputs.
"""

from __future__ import annotations

from neffbuild.errors import IncompatibleBundle
from neffbuild.runtime import HostGroups


def host_groups(facts, what: str) -> HostGroups | None:
    """This worker's groups for a bundle whose world has more than one rank (None for one rank); collective over
    vLLM's world: every vLLM worker calls it, in the same order."""
    layout = facts.parallel
    if layout.world_size == 1:
        return None
    import torch.distributed as dist
    from vllm.distributed import parallel_state as ps

    tp_group, dp_group = ps.get_tp_group(), ps.get_dp_group()
    rank = dp_group.rank_in_group * layout.tp + tp_group.rank_in_group
    if not dist.is_initialized() or dist.get_rank() != rank or dist.get_world_size() != layout.world_size:
        here = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        raise IncompatibleBundle(
            f"{what} was compiled for {layout.describe()}: its rank {rank} (dp rank x tp + tp rank) is vLLM's global "
            f"rank {here[0]} of {here[1]} (start vLLM with --tensor-parallel-size {layout.tp} --data-parallel-size "
            f"{layout.dp} and no pipeline parallelism)")

    def twin(ranks: list[int]):
        return dist.new_group(sorted(ranks), backend="gloo", use_local_synchronization=True)

    groups = {}
    if layout.tp > 1:
        groups.update(tp=twin(tp_group.ranks), eager_tp=twin(tp_group.ranks))
    if layout.ep > 1:
        first = rank // layout.ep * layout.ep  # the bundle's EP groups: ep consecutive ranks
        ep_ranks = list(range(first, first + layout.ep))
        groups.update(ep=twin(ep_ranks), eager_ep=twin(ep_ranks))
    if layout.dp > 1:
        groups["dp"] = twin(dp_group.ranks)
    return HostGroups(rank, **groups)
