"""Prompt lists through the engine's own API, for tests and scripts (the product has one entry point:
``neffbuild.serve.result.generate``).

Every prompt arrives at step 0 and asks for ``max_new_tokens`` tokens (the first from prefill);
more prompts than the largest batch bucket (or than the pool holds) wait and join as others leave,
exactly as ``generate --requests`` serves them. Each returns an ``EngineRun``.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from neffbuild.serve.engine import Engine, EngineStats
from neffbuild.serve.parts import LocalPrefill, Request

_REQUEST_IDS = itertools.count()


@dataclass
class EngineRun:
    requests: list[Request]
    stats: EngineStats

    @property
    def tokens(self) -> list[list[int]]:
        return [r.tokens for r in self.requests]

    @property
    def plans(self) -> list:
        return list(self.stats.plans)

    @property
    def transfers(self) -> list[dict]:
        return [r.transfer for r in self.requests]

    @property
    def decode_seconds(self) -> float:
        return sum(self.stats.step_seconds)


def _run(session, source, prompts, max_new_tokens, *, proposer=None, on_step=None, blocks=None, keys=None):
    engine = Engine(session.stepper, blocks if blocks is not None else session.block_manager(), source, proposer,
                    on_step=on_step)
    reqs = [Request(str(n), list(p), max_new_tokens, index=n, key=keys[n] if keys else None)
            for n, p in enumerate(prompts)]
    try:
        engine.run(reqs)
    finally:
        source.close()
    return EngineRun(reqs, engine.stats)


def greedy(session, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
           on_step: Callable | None = None, blocks=None) -> EngineRun:
    """Greedy tokens per prompt, local prefill; ``on_step(plan, last logits [R, vocab])`` after each step."""
    hook = (lambda plan, out: on_step(plan, out.logits[:, -1])) if on_step else None
    source = LocalPrefill(session.prefill, session.kv_caches, lockstep_group=session.lockstep_group)
    return _run(session, source, prompts, max_new_tokens, on_step=hook, blocks=blocks)


def spec(session, dcfg, weights: dict, prompts, max_new_tokens: int, *, draft_fn=None) -> EngineRun:
    """Speculative greedy tokens per prompt (EAGLE3 through the stepper's draft artifacts, or ``draft_fn``)."""
    from neffbuild.serve.spec import Eagle3Proposer

    proposer = Eagle3Proposer(session.stepper, dcfg, weights, draft_fn=draft_fn)
    source = LocalPrefill(session.prefill, session.kv_caches, lockstep_group=session.lockstep_group,
                          aux_layers=proposer.aux_layers, proposer=proposer)
    return _run(session, source, prompts, max_new_tokens, proposer=proposer)


def di(session, addresses, prompts, max_new_tokens: int, *, check_reads: bool = True, alive=None,
       request_ids: Sequence[str] | None = None, _n_minus_1: bool = True) -> EngineRun:
    """Greedy tokens per prompt, prefill in the prefill group at ``addresses`` (a port, or every rank's
    (host, port)). A sharded bundle's TP ranks pass the same ``request_ids``; the default names are this
    process's own."""
    from neffbuild.serve.di import NixlSource

    prefix = "" if request_ids else f"{os.getpid()}-{next(_REQUEST_IDS)}-"
    source = NixlSource(session, addresses, alive=alive, prefix=prefix, check_reads=check_reads,
                        _n_minus_1=_n_minus_1)
    return _run(session, source, prompts, max_new_tokens, keys=request_ids)
