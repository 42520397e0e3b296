"""EAGLE3 as an engine part: the proposer that runs the bundle's draft artifacts.

Each engine step with drafts: **verify** (the target runs ``[next token, d1..dk]`` at query
1+k) -> **accept** (serve/engine.py: the longest prefix of drafts equal to the target's
argmax, plus the bonus token: exactly what plain greedy emits) -> **propose** (here: one
draft call catches up on the rows the target just verified and proposes k new drafts).

The family is the step API's choice (runtime/step/stepper.py): with-spec only when every request
hands k drafts and ``max_position + k + 1 <= max_model_len``; the veto rides in the step's
one MAX all-reduce, so all DP ranks run the same target artifact. A request with no
verified rows (right after a DI transfer: no aux hidden states yet) or no room gets no
drafts, so that step runs ``target_nospec``; its aux output then feeds the next draft call.

**The draft is sharded like the target** (models/eagle3/sharding.py): a TP rank holds its heads of
the draft's attention, its KV heads in its draft KV buffer, and vocab / tp rows of its LM head, all
in the bundle's weights dtype, in the same ``tp{r}`` weight pieces as its slice of the target. Every
TP rank holds the same aux states (the target's outputs are all-reduced) and its draft graph
all-reduces the o-proj and gathers each rank's best (value, id) from the LM head, so every TP rank
proposes the same drafts; the token embedding is looked up as the target's (its rows, then an
all-reduce over the TP group).

KV for rejected tokens needs no work: ``computed`` advances by the emitted count only; the
slots past it hold rejected drafts, which the causal mask hides and the next step
overwrites before any query can see them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from neffbuild.models.eagle3.config import Eagle3Config
from neffbuild.runtime.bundle.eager import draft_prefill_on
from neffbuild.runtime.kv.blocks import FULL_GROUP, BlockManager
from neffbuild.runtime.parallel import ParallelLayout
from neffbuild.runtime.step.dispatch import DRAFT, StepPlan, plan_draft
from neffbuild.runtime.step.stepper import Stepper
from neffbuild.serve.parts import Request, block_rows

METHOD = "eagle3"
# (draft plan, requests) -> proposed target ids [len(requests), k]: replaces the draft artifact (tests)
DraftFn = Callable[[StepPlan, list], torch.Tensor]


class Eagle3Proposer:
    """Drafts k tokens per request through the bundle's ``draft_b{B}_ctx{S}`` artifacts (or ``draft_fn``)."""

    def __init__(self, stepper: Stepper, dcfg: Eagle3Config, weights: dict, *, draft_fn: DraftFn | None = None,
                 parallel: ParallelLayout | None = None, rank: int = 0):
        self.stepper, self.dcfg, self.grid = stepper, dcfg, stepper.grid
        self.k = self.grid.num_speculative_tokens
        # the prompt's eager catch-up, the runtime's (the vLLM plugin's too); a sharded rank looks up its
        # embedding rows like the graph (in step with its TP group)
        self.catch_up = draft_prefill_on(METHOD, dcfg, weights, self.k, stepper.kv_layout.packed_k, parallel, rank)
        self.draft_fn = draft_fn
        self.plans: list[StepPlan] = []

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.dcfg.aux_layers

    def on_prefill(self, req: Request, prompt: list[int], aux: torch.Tensor, full_row: torch.Tensor) -> None:
        """The draft's KV for prompt positions 0..N-2 (eager), and the first draft call's row."""
        self.catch_up(prompt[1:], aux[:-1], self.stepper.draft_cache, full_row)
        req.verified = ([req.next], aux[-1:], len(prompt) - 1)

    def after_step(self, req: Request, emitted: list[int], aux: torch.Tensor | None, first_pos: int) -> None:
        req.verified = (emitted, aux, first_pos) if aux is not None else None

    def propose(self, reqs: list[Request], blocks: BlockManager) -> str | None:
        """Draft k tokens for every request with verified rows and room for a with-spec step; the draft label."""
        k, ready = self.k, []
        for r in reqs:
            if r.verified is not None and r.computed + k + 1 <= self.grid.max_model_len:
                ready.append(r)
            else:
                r.verified = None  # no room (for good) or no aux rows yet: this step runs without spec
        if not ready:
            return None
        for r in ready:
            blocks.reserve(r.key, r.computed + k + 1, r.computed)
        top = max(r.computed for r in ready)
        if self.draft_fn is not None:
            plan = plan_draft(self.grid, num_reqs=len(ready), max_computed=top)
            drafts = self.draft_fn(plan, ready)
        else:
            full = block_rows(blocks, [r.key for r in ready], [r.computed + k + 1 for r in ready])[FULL_GROUP]
            plan, drafts = self.stepper.draft([r.verified for r in ready], full, max_computed=top)
        for r, d in zip(ready, drafts[: len(ready)].tolist(), strict=True):
            r.drafts, r.verified = d, None
        self.plans.append(plan)
        return plan.label


class EagerSpecArtifacts:
    """Eager target (with aux outputs) for target labels and the eager draft for draft labels."""

    def __init__(self, grid, kv_layout, num_swa: int, target: torch.nn.Module, draft: torch.nn.Module):
        self.grid, self.kv_layout, self.num_swa, self.target, self.draft = grid, kv_layout, num_swa, target, draft

    def artifact(self, label: str):
        module = self.draft if label.startswith(DRAFT) else self.target
        return torch.no_grad()(module.forward)
