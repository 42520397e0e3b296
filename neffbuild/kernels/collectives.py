"""In-graph collectives over process groups named by string (``_c10d_functional`` ops).

``torch.export`` records these as ``_c10d_functional.*`` + ``wait_tensor`` nodes and
AOTInductor compiles them; at run time the artifact resolves the group name in the
process's registry, so one artifact serves every rank that registered its own group
under the same name. Tracing needs only a registered placeholder of the right size.
"""

import torch

_C = torch.ops._c10d_functional


def all_reduce_sum(x: torch.Tensor, group: str) -> torch.Tensor:
    return _C.wait_tensor(_C.all_reduce(x, "sum", group))


def all_gather_rows(x: torch.Tensor, group_size: int, group: str) -> torch.Tensor:
    """[N, ...] on each rank -> [group_size * N, ...], in group-rank order."""
    return _C.wait_tensor(_C.all_gather_into_tensor(x.contiguous(), group_size, group))


def reduce_scatter_rows(x: torch.Tensor, group_size: int, group: str) -> torch.Tensor:
    """[group_size * N, ...] summed over ranks; each rank keeps its own [N, ...] chunk."""
    return _C.wait_tensor(_C.reduce_scatter_tensor(x.contiguous(), "sum", group_size, group))


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
