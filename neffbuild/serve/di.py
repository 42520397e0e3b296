"""Disaggregated inference: a prefill worker process and a decode loop, KV moved over NIXL.

The prefill worker (``PrefillWorker``, a spawned process) runs the model's per-layer eager
prefill into its own KV cache and answers ``prefill`` calls on the side channel with the
request's block lists. The decode side (this process) keeps the bundle's artifacts behind the
step API: per prompt it asks for a prefill, reserves its own blocks, pulls the producer's
blocks into them (``runtime/kv_ingest.py``), then runs the last prompt token in its first
decode step, as a DI decode worker does (it never sees prefill logits).

Both sides apply the sliding-window N-1 rule (``runtime/di_prompt.py``) on their own and the
decode side checks that they agree. Before the first decode step every block a request's
query reads must have been transferred (``check_reads``): a read of a never-written block
is a ``KVTransferError``, not garbage tokens.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Self

from neffbuild.errors import KVTransferError
from neffbuild.runtime.blocks import NULL_BLOCK, SLIDING_GROUP
from neffbuild.runtime.di_prompt import di_prompt, strip_leading_null, unwritten_reads
from neffbuild.runtime.kv_ingest import KVAgent, load_nixl
from neffbuild.runtime.step import StepBatch
from neffbuild.serve.greedy import Generation, tables_for

_REQUEST_IDS = itertools.count()


def _window(config) -> int | None:
    return config.sliding_window if config.has_sliding_layers else None


# -- prefill side (runs in the worker process)


class _Producer:
    """The prefill worker's state: its session (eager prefill, own KV), block manager and NIXL agent."""

    def __init__(self, bundle_path: str, n_minus_1: bool):
        from neffbuild.runtime.bundle import open_bundle
        from neffbuild.serve.session import open_session

        bundle = open_bundle(bundle_path)
        self.session = open_session(bundle, reference=True)  # eager: the worker never loads artifacts
        self.blocks = self.session.block_manager()
        self.n_minus_1 = n_minus_1
        cfg, caches = self.session.config, self.session.stepper.kv_caches
        self.agent = KVAgent(f"prefill-{os.getpid()}", caches, cfg.num_hidden_layers,
                             packed_fp8=bundle.kv_layout.packed_k)

    def prefill(self, msg: dict) -> dict:
        """Prefill one prompt (N-1 rule applied here too); answer with its block lists per KV group."""
        self.release_pulled()
        rid, tokens = str(msg["request"]), list(msg["tokens"])
        p = di_prompt(tokens, _window(self.session.config), _n_minus_1=self.n_minus_1)
        self.blocks.reserve(rid, p.kv_len, p.kv_len)  # prefill reads no cache: only what decode reads
        rows = {g: t[0] for g, t in tables_for(self.blocks, [rid], [p.kv_len]).items()}
        t0 = time.perf_counter()
        self.session.prefill(p.tokens[: p.kv_len], self.session.stepper.kv_caches, rows)
        return {"kv_len": p.kv_len, "truncated": p.truncated, "prefill_seconds": time.perf_counter() - t0,
                "blocks": {g.name: strip_leading_null(self.blocks.tables[rid][g.name]) for g in self.blocks.groups}}

    def release_pulled(self) -> None:
        for rid in self.agent.pulled():
            self.blocks.release(rid)


def _worker_main(bundle_path: str, ready, stop, n_minus_1: bool) -> None:
    try:
        producer = _Producer(bundle_path, n_minus_1)
        port = producer.agent.serve({"prefill": producer.prefill})
    except Exception as exc:
        ready.put(("error", f"{type(exc).__name__}: {exc}"))
        return
    ready.put(("ready", port))
    stop.wait()
    producer.agent.close()


class PrefillWorker:
    """The prefill process: ``with PrefillWorker(bundle) as w: ... w.port``."""

    def __init__(self, bundle_path: str, *, timeout: float = 180.0, _n_minus_1: bool = True):
        load_nixl()  # fail here, with the extra to install, before spawning anything
        ctx = mp.get_context("spawn")
        self._ready, self._stop = ctx.Queue(), ctx.Event()
        self.process = ctx.Process(target=_worker_main, args=(str(bundle_path), self._ready, self._stop, _n_minus_1),
                                   daemon=True, name="neffbuild-prefill")
        self.timeout, self.port = timeout, None

    def __enter__(self) -> Self:
        self.process.start()
        deadline = time.monotonic() + self.timeout
        while self.port is None:
            try:
                kind, value = self._ready.get(timeout=1.0)
            except Exception:
                if not self.process.is_alive() or time.monotonic() > deadline:
                    self.__exit__(None, None, None)
                    raise KVTransferError(f"prefill worker did not start (exit code {self.process.exitcode})") from None
                continue
            if kind == "error":
                self.__exit__(None, None, None)
                raise KVTransferError(f"prefill worker failed to start: {value}")
            self.port = value
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self.process.join(timeout=20)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


# -- decode side


@dataclass
class DIGeneration(Generation):
    transfers: list[dict] = field(default_factory=list)  # per prompt: kv_len, blocks, bytes, seconds


def ingest(agent: KVAgent, blocks, config, prompt: Sequence[int], *, n_minus_1: bool = True) -> tuple[str, dict]:
    """Have the worker prefill one prompt and pull its KV into this side's blocks; (request id, transfer)."""
    rid = f"{os.getpid()}-{next(_REQUEST_IDS)}"
    p = di_prompt(prompt, _window(config), _n_minus_1=n_minus_1)
    reply = agent.call("prefill", request=rid, tokens=list(p.tokens))
    if reply["kv_len"] != p.kv_len:
        raise KVTransferError(f"request {rid}: the prefill worker computed KV for {reply['kv_len']} tokens, this "
                              f"decode worker expects {p.kv_len}; both sides must apply the same N-1 rule")
    blocks.reserve(rid, p.kv_len, p.kv_len)  # the pull counts as kv_len computed tokens
    groups = [g.name for g in blocks.groups]
    local = [strip_leading_null(blocks.tables[rid][g]) for g in groups]
    res = agent.pull(rid, [reply["blocks"][g] for g in groups], local)
    return rid, {"kv_len": p.kv_len, "truncated": p.truncated, "blocks": res.blocks, "bytes": res.bytes,
                 "pull_seconds": res.seconds, "prefill_seconds": reply["prefill_seconds"]}


def _check_first_reads(blocks, rids, positions, window) -> None:
    for rid, pos in zip(rids, positions, strict=True):
        for g in blocks.groups:
            missing = unwritten_reads(blocks.tables[rid][g.name], pos, blocks.block_size,
                                      window if g.name == SLIDING_GROUP else None)
            if missing:
                raise KVTransferError(f"request {rid}: the first decode step at position {pos} reads {g.name}-group "
                                      f"logical blocks {missing} that were never transferred (null block {NULL_BLOCK})")


def generate_di(session, port: int, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                check_reads: bool = True, _n_minus_1: bool = True) -> DIGeneration:
    """Greedy tokens per prompt with prefill in the worker on ``port``; decoded here as one batch."""
    cfg, stepper = session.config, session.stepper
    blocks = session.block_manager()
    agent = KVAgent(f"decode-{os.getpid()}-{next(_REQUEST_IDS)}", stepper.kv_caches, cfg.num_hidden_layers,
                    packed_fp8=stepper.kv_layout.packed_k)
    try:
        agent.connect(port)
        rids, transfers = [], []
        for prompt in prompts:
            rid, t = ingest(agent, blocks, cfg, prompt, n_minus_1=_n_minus_1)
            rids.append(rid)
            transfers.append(t)
    finally:
        agent.close()
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


def run_di(bundle_path: str, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> DIGeneration:
    """``generate --di``: one prefill worker process, this process decodes through the bundle's artifacts."""
    from neffbuild.runtime.bundle import open_bundle
    from neffbuild.serve.session import open_session

    bundle = open_bundle(bundle_path)
    session = open_session(bundle)
    for label in bundle.labels:  # load now: decode_seconds must not include loading
        bundle.artifact(label)
    with PrefillWorker(bundle_path) as worker:
        return generate_di(session, worker.port, prompts, max_new_tokens)
