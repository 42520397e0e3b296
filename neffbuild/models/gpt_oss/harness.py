"""Greedy generation through a Decoder: per-layer prefill (eager), then decode steps.

Shared by ``neffbuild generate`` and the tests; the runner decides what executes a step
(the eager graph, or a bundle's compiled artifacts).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from neffbuild.models.gpt_oss.config import GptOssConfig
from neffbuild.models.gpt_oss.decode import SINGLE
from neffbuild.models.gpt_oss.prefill import prefill
from neffbuild.runtime.decoder import Decoder
from neffbuild.runtime.parallel import ParallelLayout


def greedy(decoder: Decoder, cfg: GptOssConfig, stacked: dict, prompts: list[list[int]], max_new_tokens: int,
           *, packed_k: bool = False, rid_base: int = 0, on_step=None, parallel: ParallelLayout = SINGLE,
           rank: int = 0) -> list[list[int]]:
    """Greedy tokens per prompt. Prompts are prefilled one by one, then decoded as one batch.

    On a sharded rank ``stacked`` is its shard; when the MoE gathers tokens across DP groups
    every rank prefills in lockstep (same count, padded to the same length; see prefill).
    """
    nxt = {}
    schedule = _lockstep(prompts, decoder.group) if parallel.ep_gathers else [(len(p), 0) for p in prompts]
    for n, (_, pad_to) in enumerate(schedule):
        if n >= len(prompts):  # this rank has no n-th prompt: take part in the collectives only
            empty = torch.zeros(decoder.max_blocks, dtype=torch.long)
            prefill(cfg, stacked, [], decoder.kv_caches, empty, empty, packed_k=packed_k, parallel=parallel,
                    rank=rank, pad_to=pad_to)
            continue
        prompt, rid = prompts[n], rid_base + n
        decoder.add_request(rid, len(prompt))
        full, swa = decoder.table_rows(rid)
        logits = prefill(cfg, stacked, prompt, decoder.kv_caches, full, swa, packed_k=packed_k, parallel=parallel,
                         rank=rank, pad_to=pad_to)
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


def _lockstep(prompts: list[list[int]], group) -> list[tuple[int, int]]:
    """(index, padded length) of every prefill all ranks run together: MAX over ranks of the count and lengths."""
    count = torch.tensor([len(prompts)])
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    lengths = torch.zeros(int(count), dtype=torch.long)
    lengths[: len(prompts)] = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    dist.all_reduce(lengths, op=dist.ReduceOp.MAX, group=group)
    return [(n, int(v)) for n, v in enumerate(lengths)]


def eager_runner(module, rank: torch.Tensor | None = None):
    """A runner that executes every step with one eager graph (any shape); sharded: bound to ``rank``."""
    forward = torch.no_grad()(module.forward)

    def run(_plan):
        return forward if rank is None else (lambda *args: forward(*args, rank))

    return run
