"""Greedy generation through a Decoder: per-layer prefill (eager), then decode steps.

Shared by ``neffbuild generate`` and the tests; the runner decides what executes a step
(the eager graph, or a bundle's compiled artifacts).
"""

from __future__ import annotations

import torch

from neffbuild.models.gpt_oss.config import GptOssConfig
from neffbuild.models.gpt_oss.prefill import prefill
from neffbuild.runtime.decoder import Decoder


def greedy(decoder: Decoder, cfg: GptOssConfig, stacked: dict, prompts: list[list[int]], max_new_tokens: int,
           *, packed_k: bool = False, rid_base: int = 0, on_step=None) -> list[list[int]]:
    """Greedy tokens per prompt. Prompts are prefilled one by one, then decoded as one batch."""
    nxt = {}
    for n, prompt in enumerate(prompts):
        rid = rid_base + n
        decoder.add_request(rid, len(prompt))
        full, swa = decoder.table_rows(rid)
        logits = prefill(cfg, stacked, prompt, decoder.kv_caches, full, swa, packed_k=packed_k)
        decoder.requests[rid].num_computed = len(prompt)
        nxt[rid] = int(logits[-1].argmax())
    out = {rid: [tok] for rid, tok in nxt.items()}
    for _ in range(max_new_tokens - 1):
        plan, logits = decoder.step(nxt)
        nxt = {rid: int(t) for rid, t in zip(nxt, logits.argmax(-1).tolist(), strict=False)}
        for rid, tok in nxt.items():
            out[rid].append(tok)
        if on_step:
            on_step(plan, logits)
    return [out[rid_base + n] for n in range(len(prompts))]


def eager_runner(module):
    """A runner that executes every step with one eager graph (any shape)."""

    def run(_plan):
        return torch.no_grad()(module.forward)

    return run
