"""Greedy generation: prefill each prompt, then decode the batch through the step API.

The loop owns its requests' block tables (through the optional ``BlockManager``) and hands
them to the ``Stepper`` every step, as a serving engine would. ``decode_seconds`` is the
wall time of the decode steps only (no loading, no prefill).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from neffbuild.runtime.blocks import BlockManager
from neffbuild.runtime.dispatch import StepPlan
from neffbuild.runtime.step import StepBatch, Stepper

# prompt, KV buffers, {group: block row [W]} -> logits [N, vocab] for every prompt position
Prefill = Callable[[Sequence[int], list, dict], torch.Tensor]


@dataclass
class Generation:
    tokens: list[list[int]]  # per prompt: the generated tokens (the first comes from prefill)
    plans: list[StepPlan] = field(default_factory=list)  # one per decode step
    decode_seconds: float = 0.0
    decode_tokens: int = 0  # tokens the decode steps produced

    @property
    def tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0


def tables_for(blocks: BlockManager, rids: Sequence, upto: Sequence[int]) -> dict[str, torch.Tensor]:
    """{group: [R, W]} rows for the requests, W = blocks of the longest (never the pool or max_model_len)."""
    width = max((-(-n // blocks.block_size) for n in upto), default=1)
    return {g.name: torch.tensor([blocks.row(r, g.name, width) for r in rids], dtype=torch.long)
            .reshape(len(rids), width) for g in blocks.groups}


def greedy(stepper: Stepper, prefill: Prefill, blocks: BlockManager, prompts: Sequence[Sequence[int]],
           max_new_tokens: int, *, on_step: Callable[[StepPlan, torch.Tensor], None] | None = None,
           lockstep_group=None) -> Generation:
    """Greedy tokens per prompt: prompts are prefilled one by one, then decoded as one batch.

    Every DP rank runs ``max_new_tokens - 1`` steps (a rank without prompts runs empty ones).
    ``lockstep_group``: ranks whose prefill has collectives across DP groups (a sharded MoE
    that gathers tokens) prefill together, padded to the same length (``Session.lockstep_group``).
    """
    rids = list(range(len(prompts)))
    computed, nxt = [len(p) for p in prompts], []
    pads = _lockstep(prompts, lockstep_group) if lockstep_group is not None else [0] * len(prompts)
    for rid, pad_to in enumerate(pads):
        if rid >= len(prompts):  # no rid-th prompt here: take part in the prefill's collectives only
            none = torch.zeros(1, dtype=torch.long)
            prefill([], stepper.kv_caches, {g.name: none for g in blocks.groups}, pad_to=pad_to)
            continue
        prompt = prompts[rid]
        blocks.reserve(rid, len(prompt), len(prompt))  # prefill reads no cache: keep only what decode reads
        rows = {g: t[0] for g, t in tables_for(blocks, [rid], [len(prompt)]).items()}
        kw = {"pad_to": pad_to} if lockstep_group is not None else {}
        nxt.append(int(prefill(prompt, stepper.kv_caches, rows, **kw)[-1].argmax()))
    gen = Generation([[t] for t in nxt])
    start = time.perf_counter()
    for _ in range(max_new_tokens - 1):
        for rid in rids:
            blocks.reserve(rid, computed[rid] + 1, computed[rid])
        batch = StepBatch([[t] for t in nxt], list(computed), tables_for(blocks, rids, [c + 1 for c in computed]))
        out = stepper.step(batch)
        nxt = out.logits[:, -1].argmax(-1).tolist()
        for rid in rids:
            computed[rid] += 1
            gen.tokens[rid].append(nxt[rid])
        gen.plans.append(out.plan)
        if on_step:
            on_step(out.plan, out.logits[:, -1])
    gen.decode_seconds = time.perf_counter() - start
    gen.decode_tokens = len(rids) * (max_new_tokens - 1)
    for rid in rids:
        blocks.release(rid)
    return gen


def _lockstep(prompts: Sequence[Sequence[int]], group) -> list[int]:
    """The padded length of every prefill all ranks run together: MAX over ranks of the count and the lengths."""
    import torch.distributed as dist

    count = torch.tensor([len(prompts)])
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    lengths = torch.zeros(int(count), dtype=torch.long)
    lengths[: len(prompts)] = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    dist.all_reduce(lengths, op=dist.ReduceOp.MAX, group=group)
    return lengths.tolist()


def prometheus(plans: Sequence[StepPlan]) -> str:
    """Executions per batch bucket and the batch padding ratio, Prometheus text format."""
    executions = Counter(f"decode_b{p.batch}" for p in plans)
    rows, padding = sum(p.batch for p in plans), sum(p.padding for p in plans)
    lines = ["# TYPE neffbuild_neff_execution_count counter"]
    lines += [f'neffbuild_neff_execution_count{{bucket="{k}"}} {v}' for k, v in sorted(executions.items())]
    ratio = padding / rows if rows else 0.0
    lines += ["# TYPE neffbuild_batch_padding_ratio gauge", f"neffbuild_batch_padding_ratio {ratio:.6f}"]
    return "\n".join(lines) + "\n"
