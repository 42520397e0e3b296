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
    return {g.name: torch.tensor([blocks.row(r, g.name, width) for r in rids], dtype=torch.long).reshape(len(rids), width)
            for g in blocks.groups}


def greedy(stepper: Stepper, prefill: Prefill, blocks: BlockManager, prompts: Sequence[Sequence[int]],
           max_new_tokens: int, *, on_step: Callable[[StepPlan, torch.Tensor], None] | None = None) -> Generation:
    """Greedy tokens per prompt: prompts are prefilled one by one, then decoded as one batch.

    Every DP rank runs ``max_new_tokens - 1`` steps (a rank without prompts runs empty ones).
    """
    rids = list(range(len(prompts)))
    computed, nxt = [len(p) for p in prompts], []
    for rid, prompt in enumerate(prompts):
        blocks.reserve(rid, len(prompt), len(prompt))  # prefill reads no cache: keep only what decode reads
        rows = {g: t[0] for g, t in tables_for(blocks, [rid], [len(prompt)]).items()}
        nxt.append(int(prefill(prompt, stepper.kv_caches, rows)[-1].argmax()))
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


def prometheus(plans: Sequence[StepPlan]) -> str:
    """Executions per batch bucket and the batch padding ratio, Prometheus text format."""
    executions = Counter(f"decode_b{p.batch}" for p in plans)
    rows, padding = sum(p.batch for p in plans), sum(p.padding for p in plans)
    lines = ["# TYPE neffbuild_neff_execution_count counter"]
    lines += [f'neffbuild_neff_execution_count{{bucket="{k}"}} {v}' for k, v in sorted(executions.items())]
    lines += ["# TYPE neffbuild_batch_padding_ratio gauge", f"neffbuild_batch_padding_ratio {padding / rows if rows else 0.0:.6f}"]
    return "\n".join(lines) + "\n"
