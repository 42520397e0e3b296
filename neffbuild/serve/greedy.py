"""Greedy generation of a prompt list: the engine (serve/engine.py) with local prefill, no proposer.

A convenience for tests and scripts that hold a Stepper and a prefill function: every prompt
arrives at step 0 and asks for ``max_new_tokens`` tokens (the first comes from prefill). It
is not a loop of its own: more prompts than the largest batch bucket (or than the pool
holds) wait and join as others leave, exactly as ``generate --requests`` serves them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from neffbuild.runtime.blocks import BlockManager
from neffbuild.runtime.dispatch import StepPlan
from neffbuild.runtime.step import Stepper
from neffbuild.serve.engine import Engine
from neffbuild.serve.parts import LocalPrefill, Request, block_rows

# prompt, KV buffers, {group: block row [W]} -> logits [N, vocab] for every prompt position
Prefill = Callable[[Sequence[int], list, dict], torch.Tensor]
tables_for = block_rows  # the name older callers use


@dataclass
class Generation:
    tokens: list[list[int]]  # per prompt: the generated tokens (the first comes from prefill)
    plans: list[StepPlan] = field(default_factory=list)  # one per decode step
    decode_seconds: float = 0.0
    decode_tokens: int = 0  # tokens the decode steps produced

    @property
    def tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0


def greedy(stepper: Stepper, prefill: Prefill, blocks: BlockManager, prompts: Sequence[Sequence[int]],
           max_new_tokens: int, *, on_step: Callable[[StepPlan, torch.Tensor], None] | None = None,
           lockstep_group=None) -> Generation:
    """Greedy tokens per prompt through the engine; ``lockstep_group``: see ``LocalPrefill``."""
    hook = (lambda plan, out: on_step(plan, out.logits[:, -1])) if on_step else None
    engine = Engine(stepper, blocks, LocalPrefill(prefill, stepper.kv_caches, lockstep_group=lockstep_group),
                    on_step=hook)
    reqs = [Request(str(n), list(p), max_new_tokens, index=n) for n, p in enumerate(prompts)]
    engine.run(reqs)
    st = engine.stats
    return Generation([r.tokens for r in reqs], list(st.plans), sum(st.step_seconds), sum(st.step_tokens))


def prometheus(plans: Sequence[StepPlan]) -> str:
    """Executions per batch bucket and the batch padding ratio, Prometheus text format."""
    executions = Counter(f"decode_b{p.batch}" for p in plans)
    rows, padding = sum(p.batch for p in plans), sum(p.padding for p in plans)
    lines = ["# TYPE neffbuild_neff_execution_count counter"]
    lines += [f'neffbuild_neff_execution_count{{bucket="{k}"}} {v}' for k, v in sorted(executions.items())]
    ratio = padding / rows if rows else 0.0
    lines += ["# TYPE neffbuild_batch_padding_ratio gauge", f"neffbuild_batch_padding_ratio {ratio:.6f}"]
    return "\n".join(lines) + "\n"
