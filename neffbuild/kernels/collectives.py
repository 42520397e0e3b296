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
