"""In-graph collectives over process groups named by string (``_c10d_functional`` ops).

``torch.export`` records these as ``_c10d_functional.*`` + ``wait_tensor`` nodes and
AOTInductor compiles them; at run time the artifact resolves the group name in the
process's registry, so one artifact serves every rank that registered its own group
under the same name. Tracing needs only a registered placeholder of the right size.

Eager calls (prefill, the eager reference, the draft's prefill) run the same collective through
``torch.distributed``'s Python API over the group's eager twin (``parallel.eager_group``), never
through the functional op over the graphs' group. Why: a gloo worker thread drops its last
reference to a finished collective's tensors while it holds its group's queue lock, and a tensor
Python has seen needs the GIL to go. The functional op and a compiled artifact both enqueue on
that lock while holding the GIL, so an artifact right after an eager collective on the same group
could wait for the worker while the worker waits for the GIL (seen: a tp 2 x dp 2 EAGLE3 run hung
in the draft artifact after the draft's eager prefill). The Python API releases the GIL before it
enqueues, and the twin keeps eager tensors out of the graphs' group.
"""

import torch
import torch.distributed as dist

from neffbuild.runtime.parallel import eager_group

_C = torch.ops._c10d_functional


def _eager(group: str):
    """The eager twin of ``group``, or None while tracing (or when no twin is registered: the functional op)."""
    if torch.compiler.is_compiling():
        return None
    try:
        return dist.distributed_c10d._resolve_process_group(eager_group(group))
    except (RuntimeError, ValueError, KeyError):
        return None


def all_reduce_sum(x: torch.Tensor, group: str) -> torch.Tensor:
    pg = _eager(group)
    if pg is None:
        return _C.wait_tensor(_C.all_reduce(x, "sum", group))
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=pg)
    return out


def all_gather_rows(x: torch.Tensor, group_size: int, group: str) -> torch.Tensor:
    """[N, ...] on each rank -> [group_size * N, ...], in group-rank order."""
    pg = _eager(group)
    if pg is None:
        return _C.wait_tensor(_C.all_gather_into_tensor(x.contiguous(), group_size, group))
    out = x.new_empty((group_size * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=pg)
    return out


def reduce_scatter_rows(x: torch.Tensor, group_size: int, group: str) -> torch.Tensor:
    """[group_size * N, ...] summed over ranks; each rank keeps its own [N, ...] chunk."""
    pg = _eager(group)
    if pg is None:
        return _C.wait_tensor(_C.reduce_scatter_tensor(x.contiguous(), "sum", group_size, group))
    out = x.new_empty((x.shape[0] // group_size, *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x.contiguous(), group=pg)
    return out


def vocab_parallel_embed(table: torch.Tensor, ids: torch.Tensor, tp_rank: torch.Tensor, group: str) -> torch.Tensor:
    """Token embedding from a vocabulary-split table: ``table`` [V/tp, H] holds rows
    [tp_rank * V/tp, (tp_rank + 1) * V/tp); each rank looks up the ids in its range (zeros elsewhere) and the
    group sums, so every rank gets the full rows. ids [...] int64, tp_rank [1] -> [..., H]."""
    n = table.shape[0]
    local = ids - tp_rank * n
    mine = (local >= 0) & (local < n)
    rows = table[local.clamp(0, n - 1)].masked_fill(~mine[..., None], 0)
    return all_reduce_sum(rows, group)


def vocab_parallel_gather(local: torch.Tensor, group_size: int, group: str) -> torch.Tensor:
    """Logits over each rank's vocabulary slice [B, ..., V/tp] -> the full vocabulary [B, ..., V] on every rank
    (slices in group-rank order, as ``vocab_parallel_embed`` splits the table)."""
    every = all_gather_rows(local, group_size, group)  # [tp*B, ..., V/tp]
    return every.unflatten(0, (group_size, local.shape[0])).movedim(0, -2).flatten(-2)


def vocab_parallel_argmax(local: torch.Tensor, group_size: int, group: str) -> torch.Tensor:
    """The argmax over the whole vocabulary from each rank's logits over its slice [..., V/tp] (float32), in
    group-rank order as ``vocab_parallel_embed`` splits it: [...] int64 global ids, the same on every rank.

    One all-gather of each rank's best (value, id) pair, not of the logits; ties go to the lowest id, as
    ``argmax`` over the gathered logits would (a rank's first best, then the first rank with the best value).
    The ids travel as float32, exact below 2^24."""
    n = local.shape[-1]
    idx = local.argmax(-1, keepdim=True)  # [..., 1]
    pair = torch.cat([local.gather(-1, idx), idx.to(local.dtype)], dim=-1).reshape(1, -1, 2)  # [1, M, 2]
    every = all_gather_rows(pair, group_size, group)  # [tp, M, 2]
    win = every[..., 0].argmax(0, keepdim=True)  # [1, M]: the first rank holding the best value
    ids = every[..., 1].long() + torch.arange(group_size, device=local.device)[:, None] * n  # [tp, M] global ids
    return ids.gather(0, win).reshape(local.shape[:-1])
