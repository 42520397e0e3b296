"""DP sync: one host-side gloo MAX all-reduce per decode step.

Every DP rank must dispatch the same artifact in a step (MoE collectives cross ranks).
Bucket choice is monotonic in (padded batch, needed context), so reducing those inputs
with MAX makes every rank pick the same artifact. Idle ranks contribute 0 and still run
a dummy batch at the synced bucket. A one-rank group costs nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def world_size(group=None) -> int:
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def sync_step(local_padded_num_reqs: int, local_max_ctx: int, group=None, *, spec_flags: tuple[int, ...] = ()):
    """(MAX over ``group``'s ranks of (padded_num_reqs, max_ctx, *spec_flags) in ONE all-reduce, whether an
    all-reduce ran): the caller counts its own collectives (a process may hold several Steppers)."""
    values = (int(local_padded_num_reqs), int(local_max_ctx), *map(int, spec_flags))
    if world_size(group) == 1:
        return values, False
    t = torch.tensor(values, dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return tuple(int(v) for v in t.tolist()), True
