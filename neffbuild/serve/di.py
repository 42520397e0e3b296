"""Disaggregated inference: a prefill group and a decode loop, KV moved over NIXL.

The prefill group (``serve/prefill_worker.py``: P spawned rank processes, ``--prefill-tp``)
runs the model's per-layer eager prefill into its own KV cache and answers ``prefill`` calls
on the side channel with the request's block lists. The decode side (this process) keeps the
bundle's artifacts behind the step API: per prompt it asks for a prefill, reserves its own blocks, pulls the producer's
blocks into them (``runtime/kv_ingest.py``), then runs the last prompt token in its first
decode step, as a DI decode worker does (it never sees prefill logits).

Both sides apply the sliding-window N-1 rule (``runtime/di_prompt.py``) on their own and the
decode side checks that they agree. Before the first decode step every block a request's
query reads must have been transferred (``check_reads``): a read of a never-written block
is a ``KVTransferError``, not garbage tokens.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from neffbuild.errors import KVTransferError
from neffbuild.runtime.blocks import NULL_BLOCK, SLIDING_GROUP
from neffbuild.runtime.di_prompt import unwritten_reads
from neffbuild.runtime.kv_ingest import KVIngest
from neffbuild.runtime.step import StepBatch
from neffbuild.serve.greedy import Generation, tables_for
from neffbuild.serve.prefill_worker import PrefillGroup, connect_decode, decode_tp, pull_prompt

PrefillWorker = PrefillGroup  # the name callers used before the group had P ranks

_REQUEST_IDS = itertools.count()


def _window(config) -> int | None:
    return config.sliding_window if config.has_sliding_layers else None


# -- decode side


@dataclass
class DIGeneration(Generation):
    transfers: list[dict] = field(default_factory=list)  # per prompt: kv_len, blocks, bytes, seconds


def ingest(kv: KVIngest, blocks, config, prompt: Sequence[int], *, pullers: int = 1,
           n_minus_1: bool = True) -> tuple[str, dict]:
    """Have the worker prefill one prompt and pull its KV into this side's blocks; (request id, transfer)."""
    rid = f"{os.getpid()}-{next(_REQUEST_IDS)}"
    return rid, pull_prompt(kv, blocks, config, prompt, rid, pullers=pullers, n_minus_1=n_minus_1)


def _check_first_reads(blocks, rids, positions, window) -> None:
    for rid, pos in zip(rids, positions, strict=True):
        for g in blocks.groups:
            missing = unwritten_reads(blocks.tables[rid][g.name], pos, blocks.block_size,
                                      window if g.name == SLIDING_GROUP else None)
            if missing:
                raise KVTransferError(f"request {rid}: the first decode step at position {pos} reads {g.name}-group "
                                      f"logical blocks {missing} that were never transferred (null block {NULL_BLOCK})")


def generate_di(session, addresses, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                check_reads: bool = True, alive=None, _n_minus_1: bool = True) -> DIGeneration:
    """Greedy tokens per prompt with prefill in the prefill group at ``addresses`` (a port, or every rank's
    (host, port)); decoded here as one batch."""
    cfg, stepper = session.config, session.stepper
    blocks = session.block_manager()
    kv = connect_decode(session, [addresses] if isinstance(addresses, int) else addresses, alive=alive)
    try:
        rids, transfers = [], []
        for prompt in prompts:
            rid, t = ingest(kv, blocks, cfg, prompt, pullers=decode_tp(session), n_minus_1=_n_minus_1)
            rids.append(rid)
            transfers.append(t)
    finally:
        kv.close()
    computed = [len(p) - 1 for p in prompts]  # the first decode step runs the last prompt token
    nxt = [int(p[-1]) for p in prompts]
    gen = DIGeneration([[] for _ in prompts], transfers=transfers)
    start = time.perf_counter()
    for step in range(max_new_tokens):
        for rid, c in zip(rids, computed, strict=True):
            blocks.reserve(rid, c + 1, c)
        if step == 0 and check_reads:
            _check_first_reads(blocks, rids, computed, _window(cfg))
        batch = StepBatch([[t] for t in nxt], list(computed), tables_for(blocks, rids, [c + 1 for c in computed]))
        out = stepper.step(batch)
        nxt = out.logits[:, -1].argmax(-1).tolist()
        for n in range(len(rids)):
            computed[n] += 1
            gen.tokens[n].append(nxt[n])
        gen.plans.append(out.plan)
    gen.decode_seconds = time.perf_counter() - start
    gen.decode_tokens = len(rids) * max_new_tokens
    for rid in rids:
        blocks.release(rid)
    return gen


def run_di(bundle_path: str, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
           prefill_tp: int | None = None) -> DIGeneration:
    """``generate --di``: a prefill group of ``prefill_tp`` ranks (default: the bundle's tp), this process decodes
    through the bundle's artifacts."""
    from neffbuild.runtime.bundle import open_bundle
    from neffbuild.serve.session import open_session

    bundle = open_bundle(bundle_path)
    session = open_session(bundle)
    for label in bundle.labels:  # load now: decode_seconds must not include loading
        bundle.artifact(label)
    with PrefillGroup(bundle_path, prefill_tp) as group:
        return generate_di(session, group.addresses, prompts, max_new_tokens, alive=group.alive)
