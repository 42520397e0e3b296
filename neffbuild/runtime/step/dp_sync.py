"""DP sync: one host-side gloo MAX all-reduce per decode step.

Every DP rank must dispatch the same artifact in a step (MoE collectives cross ranks).
Bucket choice is monotonic in (padded batch, needed context), so reducing those inputs
with MAX makes every rank pick the same artifact. Idle ranks contribute 0 and still run
a dummy batch at the synced bucket. A one-rank group costs nothing.

The eager prefill of a bundle whose MoE gathers tokens across DP groups has collectives too: ``lockstep``
gives every rank the same list of padded prompt lengths, so each runs the same prefills (a rank without an
n-th prompt runs an empty one, padded), whichever engine drives it (neffbuild's, or vLLM through the plugin).
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


def lockstep(lengths, group=None) -> tuple[list[int], int]:
    """(the padded length of every prefill all ranks run together: MAX over ranks of the count, then of each n-th
    length; the all-reduces run). This rank's prompts are its first ``len(lengths)`` entries; a one-rank group
    runs none and gets its own lengths."""
    if world_size(group) == 1:
        return [int(n) for n in lengths], 0
    count = torch.tensor([len(lengths)])
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    if int(count) == 0:
        return [], 1
    padded = torch.zeros(int(count), dtype=torch.long)
    padded[: len(lengths)] = torch.tensor([int(n) for n in lengths], dtype=torch.long)
    dist.all_reduce(padded, op=dist.ReduceOp.MAX, group=group)
    return padded.tolist(), 2
