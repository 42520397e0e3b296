"""Disaggregated inference: a prefill group and the engine, KV moved over NIXL.

The prefill group (``serve/prefill_worker.py``: P spawned rank processes, ``--prefill-tp``)
runs the model's per-layer eager prefill into its own KV cache and answers ``prefill`` calls
on the side channel with the request's block lists. The decode side is the engine
(``serve/engine.py``) with ``NixlSource`` as its KV source: per admitted request it asks for a
prefill, reserves its own blocks, pulls the producer's blocks into them
(``runtime/di/ingest.py``), then runs the last prompt token in its first decode step, as a DI
decode worker does (it never sees prefill logits).

Both sides apply the sliding-window N-1 rule (``runtime/di/prompt.py``) on their own and the
decode side checks that they agree. Before the first decode step every block a request's
query reads must have been transferred (``check_reads``): a read of a never-written block
is a ``KVTransferError``, not garbage tokens.
"""

from __future__ import annotations

import time

from neffbuild.errors import KVTransferError, PrefillWorkerLost
from neffbuild.runtime.di.prompt import unwritten_reads
from neffbuild.runtime.kv.blocks import NULL_BLOCK, SLIDING_GROUP
from neffbuild.serve.parts import Request
from neffbuild.serve.prefill_worker import connect_decode, pull_prompt


def _window(config) -> int | None:
    return config.sliding_window if config.has_sliding_layers else None


# -- decode side


class NixlSource:
    """KV source (serve/parts.py): the prefill group prefills, this rank pulls its heads over NIXL.

    Per admitted request: ``prefill`` on the group's rank 0 (every decode TP rank of the
    request asks; rank 0 runs it once), reserve this rank's blocks for the pull, one READ per
    prefill rank drawn from, ``release``. Then ``computed = N - 1`` and ``next`` = the last
    prompt token: the first decode step recomputes it (no prefill logits, no aux hidden
    states: with a proposer that step runs without spec). ``prefix`` keeps request names of
    several decode groups apart on one prefill group (the decode TP ranks of one group share it).
    A prefill rank that dies is ``PrefillWorkerLost`` naming the request by its id (within 30 s).
    """

    collective = False

    def __init__(self, session, addresses, *, alive=None, prefix: str = "", check_reads: bool = True,
                 _n_minus_1: bool = True):
        self.config, self.prefix, self.check_reads, self.n_minus_1 = session.config, prefix, check_reads, _n_minus_1
        self.pullers = session.parallel.tp
        self.kv = connect_decode(session, [addresses] if isinstance(addresses, int) else addresses, alive=alive)
        self.transfers: list[dict] = []
        self._next_check = 0.0

    def check(self, waiting: Request) -> None:
        """Between admissions (at most every 0.5 s): a prefill group that died while this rank decodes is
        ``PrefillWorkerLost`` naming ``waiting``, the next request it can no longer serve, not a run that
        decodes on for minutes before it notices."""
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + 0.5
        if not self.kv.alive():
            raise PrefillWorkerLost(waiting.id, "the prefill group is gone (a rank's side channel closed) before "
                                                "this request was prefilled")

    def admit(self, reqs, blocks, hold=()) -> None:  # ``hold`` unused: the pull reserves what it moves
        for r in reqs:
            r.key = r.key if r.key is not None else f"req-{r.index}"
            wire = f"{self.prefix}{r.key}"
            try:
                r.transfer = pull_prompt(self.kv, blocks, self.config, r.prompt, wire, pullers=self.pullers,
                                         n_minus_1=self.n_minus_1, key=r.key)
            except PrefillWorkerLost as exc:  # name the request as the user did (its id), the wire name after
                raise PrefillWorkerLost(r.id, f"{exc.detail} (prefill request {wire})") from None
            self.transfers.append(r.transfer)
            r.computed, r.next = len(r.prompt) - 1, int(r.prompt[-1])  # the first step runs the last prompt token
            if self.check_reads:
                blocks.reserve(r.key, r.computed + 1, r.computed)  # what that step reserves (idempotent)
                _check_first_reads(blocks, r.key, r.computed, _window(self.config))

    def close(self) -> None:
        self.kv.close()


def _check_first_reads(blocks, key, pos: int, window) -> None:
    for g in blocks.groups:
        missing = unwritten_reads(blocks.tables[key][g.name], pos, blocks.block_size,
                                  window if g.name == SLIDING_GROUP else None)
        if missing:
            raise KVTransferError(f"request {key}: the first decode step at position {pos} reads {g.name}-group "
                                  f"logical blocks {missing} that were never transferred (null block {NULL_BLOCK})")
