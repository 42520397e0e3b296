"""The test oracle's fill-ins: vLLM native GPT-OSS at data parallel with expert parallelism on CPU (vLLM 0.32).

Loaded in every vLLM worker of the *native* run only (tests/test_vllm_parallel.py, benchmarks/vllm_parallel.py):
``vllm serve CKPT ... --worker-extension-cls tests.vllm_scripts.dp_ep_collectives.NativeDpEp``. vLLM resolves that
class in each worker before it builds the worker and its process groups (``WorkerWrapperBase.init_worker``), so
importing this module is early enough; the plugin's runs never import it.

Why it is needed: at DP > 1 vLLM's MoE layers dispatch and combine naively (``MoERunner._maybe_dispatch`` /
``_maybe_combine``, or the modular kernel's ``MoEPrepareAndFinalizeNaiveDPEP``) through the EP group's all2all
manager, which on CPU is always ``AgRsAll2AllManager`` (cpu_communicator.py): its dispatch calls the DP group's
``all_gatherv`` (every DP rank's hidden states and router logits, ``sizes[r]`` rows from rank ``r``) and its
combine ``reduce_scatterv`` (the sum over the DP ranks of the experts' outputs, each rank keeping its own rows).
``CpuCommunicator`` inherits both from ``DeviceCommunicatorBase``, where they raise NotImplementedError, so the
first forward of a MoE model at ``--data-parallel-size 2 --enable-expert-parallel`` fails on CPU.

What is filled in: those two methods, as ``CudaCommunicator`` defines them (dim 0 only for ``all_gatherv``; a list
in gives a list out; equal sizes may be omitted), with plain torch.distributed ops on the group's own process group
(``device_group``, the gloo group CpuCommunicator's other collectives use): ``all_gatherv`` pads each rank's rows
to the largest ``sizes`` entry, all-gathers, and keeps ``sizes[r]`` rows of rank ``r``'s part (copies only);
``reduce_scatterv`` all-reduces (SUM) the whole input and keeps this rank's rows (at dp 2 the sum of two addends is
the same in either order, so the rows equal NCCL's per-root reduce). With those, the next gap shows: the CPU
experts ignore vLLM's expert map (``experts_apply`` below). Nothing else changes: the model, its weights, the
router, the fused-MoE kernel, the scheduler and vLLM's DP coordination and dummy batches are vLLM's own. The
collectives step aside where vLLM defines them itself; the expert map is written for vLLM 0.32's CPU experts.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from vllm.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase
from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator
from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

CALLS: Counter = Counter()  # per worker: how often vLLM called each filled-in collective


def _sizes(sizes: list[int] | None, rows: int, world: int) -> list[int]:
    """Rows per rank: ``sizes``, or ``rows`` split evenly (omitted when every rank has as many, as CUDA's)."""
    if sizes is None:
        if rows % world:
            raise ValueError(f"{rows} rows do not split over {world} ranks and no sizes were given")
        return [rows // world] * world
    if len(sizes) != world:
        raise ValueError(f"sizes {sizes}: one entry per rank expected ({world} ranks)")
    return list(sizes)


def all_gatherv(self, input_: torch.Tensor | list[torch.Tensor], dim: int = 0, sizes: list[int] | None = None):
    """Every rank's rows, rank by rank: ``sum(sizes)`` rows (``world * rows`` when ``sizes`` is None)."""
    if dim != 0:
        raise NotImplementedError("only dim 0 all-gatherv is supported")  # CudaCommunicator's limit too
    CALLS["all_gatherv"] += 1
    world, me = self.world_size, self.rank_in_group

    def one(t: torch.Tensor) -> torch.Tensor:
        per_rank = _sizes(sizes, t.shape[0] * world, world)
        if t.shape[0] != per_rank[me]:
            raise ValueError(f"rank {me} has {t.shape[0]} rows, sizes say {per_rank[me]}")
        padded = t.new_zeros((max(per_rank), *t.shape[1:]))
        padded[:t.shape[0]] = t
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded, group=self.device_group)
        return torch.cat([part[:n] for part, n in zip(parts, per_rank, strict=True)])

    return one(input_) if isinstance(input_, torch.Tensor) else [one(t) for t in input_]


def reduce_scatterv(self, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None) -> torch.Tensor:
    """The sum over the ranks of ``input_``, this rank's ``sizes[rank]`` rows of it (an even share without sizes)."""
    CALLS["reduce_scatterv"] += 1
    if dim < 0:
        dim += input_.dim()
    total = input_.movedim(0, dim).contiguous().clone()  # the layout CudaCommunicator reduces
    per_rank = _sizes(sizes, total.shape[0], self.world_size)
    if sum(per_rank) != total.shape[0]:
        raise ValueError(f"sizes {per_rank} do not add up to the input's {total.shape[0]} rows")
    dist.all_reduce(total, group=self.device_group)
    start = sum(per_rank[:self.rank_in_group])
    return total[start:start + per_rank[self.rank_in_group]].movedim(0, dim).contiguous()


_FILL = {"all_gatherv": all_gatherv, "reduce_scatterv": reduce_scatterv}
FILLED = [name for name in _FILL if getattr(CpuCommunicator, name) is getattr(DeviceCommunicatorBase, name)]
for _name in FILLED:
    setattr(CpuCommunicator, _name, _FILL[_name])

_experts_apply = CPUUnquantizedExperts.apply


def experts_apply(self, *, topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor | None,
                  **rest):
    """vLLM's ``expert_map`` (global expert id -> this rank's slot, -1 elsewhere), applied before its CPU kernel.

    ``CPUUnquantizedExperts.apply`` hands ``cpu_fused_moe`` the global ids with this rank's half of the weights
    and ignores ``expert_map``: the kernel indexes past its weights (a segfault, cpu_fused_moe.cpp). Here an id
    becomes its local slot, and a route to an expert of the other rank keeps slot 0 with weight 0: its term in the
    kernel's weighted sum is an exact zero, so the rank's output is the sum over its own experts, as vLLM's GPU
    kernels compute with the same map (-1: skipped); the combine then adds the ranks' sums."""
    if expert_map is not None:
        CALLS["expert_map"] += 1
        local = expert_map[topk_ids.long()]
        topk_weights = torch.where(local >= 0, topk_weights, torch.zeros_like(topk_weights)).contiguous()
        topk_ids = local.clamp(min=0).to(torch.int32).contiguous()
    return _experts_apply(self, topk_weights=topk_weights, topk_ids=topk_ids, expert_map=expert_map, **rest)


CPUUnquantizedExperts.apply = experts_apply
FILLED.append("expert_map")

class NativeDpEp:
    """vLLM's worker extension (importing it installs the fill-in); ``dp_ep_fill_in`` through vLLM's dev-mode
    /collective_rpc tells a test which methods were filled in and how often vLLM called them."""

    def dp_ep_fill_in(self) -> dict:
        return {"filled": FILLED, "calls": dict(CALLS)}
