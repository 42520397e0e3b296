"""The engine's parts: a request, where its KV comes from (``KVSource``), who drafts (``Proposer``).

The engine (serve/engine.py) is one loop per rank; a mode is a choice of parts, never a loop:

* ``KVSource`` -- how an admitted request gets its prompt's KV into this rank's blocks.
  ``admit(reqs, blocks, hold)`` reserves each request's blocks (under ``req.key``), fills them,
  and sets ``req.computed`` (tokens in the KV cache) and ``req.next`` (the token the first
  decode step runs); a source that produces the first generated token itself (local
  prefill) appends it to ``req.tokens``. ``collective`` sources must be called on every
  rank at every step (even with no request), in the same order: their prefill has
  collectives. ``close()`` ends whatever the source started.
  An optional ``check(req)`` (NixlSource) is called while requests wait: a source that can no
  longer serve them raises, naming the next one, instead of the run decoding on.

  - ``LocalPrefill``: the model's eager per-layer prefill in this process (sharded bundles:
    this rank's shard, in lockstep when the MoE gathers across DP groups). With a proposer
    it also returns the prompt's aux hidden states and the proposer fills the draft's KV.
  - ``NixlSource`` (serve/di.py): a prefill worker process prefills, this rank pulls the
    blocks over NIXL; the first decode step runs the last prompt token (``req.next``), and
    there are no aux hidden states yet, so that step runs without spec.

* ``Proposer`` -- optional drafts. ``on_prefill(req, prompt, aux, full_row)`` after a local
  prefill; ``propose(reqs, rows)`` gives ``req.drafts`` (k tokens) to every request that has
  verified rows and room; ``after_step(req, emitted, aux)`` keeps the verified rows for the
  next draft call. ``Eagle3Proposer`` (serve/spec.py) runs the bundle's draft artifacts; the
  draft is sharded over TP like the target (see that module).

* World (serve/world.py): one process, or the bundle's tp x dp ranks (``--dp N`` for an
  unsharded bundle) as gloo processes; each DP group owns ``requests[g::dp]``.

Not here: the step itself (runtime/step/stepper.py, stateless about requests), block accounting
(runtime/kv/blocks.py), the CLI.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from neffbuild.runtime.kv.blocks import FULL_GROUP, SLIDING_GROUP, BlockManager
from neffbuild.runtime.kv.tables import TableBuffer
from neffbuild.runtime.step import dp_sync


@dataclass
class Request:
    """One request: what the user asked for, then the engine's state for it (this rank only)."""

    id: str
    prompt: list[int]
    max_new_tokens: int
    arrival: int = 0  # the decode step at which it may join
    index: int = 0  # position in the request file (results come back in this order)
    key: object = None  # the block manager's key (set by the KV source)
    computed: int = 0  # tokens in the target KV cache (= position of ``next``)
    next: int | None = None  # the token the next decode step runs (the last one emitted)
    tokens: list[int] = field(default_factory=list)  # generated so far
    drafts: list[int] = field(default_factory=list)  # the proposer's k tokens for the next step
    verified: tuple | None = None  # (tokens [n], aux [n, A], first position): the next draft call's rows
    first_step: int | None = None  # the first decode step it ran in
    last_step: int | None = None
    transfer: dict | None = None  # NIXL source: what the pull moved

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.max_new_tokens

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.tokens)

    def result(self) -> dict:
        return {"id": self.id, "tokens": self.tokens[: self.max_new_tokens], "arrival": self.arrival,
                "first_step": self.first_step, "last_step": self.last_step}


def block_rows(blocks: BlockManager, keys: Sequence, upto: Sequence[int], width: int = 0) -> dict[str, torch.Tensor]:
    """{group: [R, W]} rows for the requests, W = blocks of the longest (never the pool), or ``width`` if wider."""
    width = max(width, *(-(-n // blocks.block_size) for n in upto), 1)
    return {g.name: torch.tensor([blocks.row(k, g.name, width) for k in keys], dtype=torch.long)
            .reshape(len(keys), width) for g in blocks.groups}


class BlockRows:
    """The engine's ``{group: [R, W]}`` tables, kept from step to step and updated in place.

    Between two steps the artifact has run and the interpreter's caches are cold: every torch
    call then costs ~10 us, more than the engine's whole step should. So the tables live in a
    ``TableBuffer`` (runtime/kv/tables.py: one buffer of ``[groups, max_rows, max_width]``
    block ids under a tensor, each row checked when written) and a step writes, in pure Python,
    only the rows whose request or blocks changed (``BlockManager.version``). A row is written
    as the request's blocks (up to ``max_width``), nulls after them, so it reads right at any
    width: a wider or narrower context bucket is another view of the same rows. What a call
    returns (a ``BlockTables`` view, made once per shape) is valid, read-only, until the next
    call: the Stepper reads it within the step, and its input check takes the rows as written
    instead of reading the tensors. A batch beyond the capacity gets fresh tensors (``block_rows``).
    """

    def __init__(self, blocks: BlockManager, max_rows: int, max_width: int):
        self.blocks, self.max_rows, self.max_width = blocks, max_rows, max_width
        self.names = [g.name for g in blocks.groups]
        self.buffer = TableBuffer(self.names, max_rows, max_width)
        self._rows: list[tuple[object, int]] = []  # row i: (key, version) written there
        self._ids: list[list] = [[None] * max_rows for _ in self.names]  # per group, row i's ids as written

    def __call__(self, keys: Sequence, upto: Sequence[int], width: int = 0) -> dict[str, torch.Tensor]:
        """``block_rows(keys, upto)``, at least ``width`` columns wide (null-padded past each row's blocks)."""
        blocks, bs = self.blocks, self.blocks.block_size
        most = -(-max(upto) // bs) if upto else 0
        width = max(width, most, 1)
        n_rows = len(keys)
        if n_rows > self.max_rows or width > self.max_width:
            return block_rows(blocks, keys, upto, width)
        rows, versions = self._rows, blocks.versions
        for i, k in enumerate(keys):
            have = (k, versions.get(k, 0))  # BlockManager.version, without a call per row
            if i < len(rows) and rows[i] == have:
                continue
            self._write_row(i, k)
            if i < len(rows):
                rows[i] = have
            else:
                rows.append(have)
        return self.buffer.view(n_rows, width)

    def rewrite(self, rows: Sequence[int], keys: Sequence) -> None:
        """Rows ``rows`` (of the last call's view) := their requests' blocks now: the kept view shows them (a step
        that changed only these rows' blocks, as at a block boundary)."""
        versions = self.blocks.versions
        for i, k in zip(rows, keys, strict=True):
            self._write_row(i, k)
            self._rows[i] = (k, versions.get(k, 0))

    def _write_row(self, i: int, key) -> None:
        """Row ``i`` of every group := the request's blocks (a group's row written only if it changed)."""
        written = self._ids
        for gi, (ids, run) in enumerate(self.blocks.row_runs(key, self.max_width)):
            if written[gi][i] != ids:  # a reserve often changes one group's row only (a sliding release)
                written[gi][i] = None  # (until the write below has succeeded)
                self.buffer.write(gi, i, ids, run)  # the manager's run: confirmed by the buffer, spares it a scan
                written[gi][i] = ids


class KVSource(Protocol):
    collective: bool

    def admit(self, reqs: list[Request], blocks: BlockManager, hold: Sequence[int] = ()) -> None: ...

    def close(self) -> None: ...


class Proposer(Protocol):
    k: int

    def on_prefill(self, req: Request, prompt: list[int], aux: torch.Tensor, full_row: torch.Tensor) -> None: ...

    def propose(self, reqs: list[Request], blocks: BlockManager) -> str | None: ...

    def after_step(self, req: Request, emitted: list[int], aux: torch.Tensor | None, first_pos: int) -> None: ...


class LocalPrefill:
    """KV source: the model's eager prefill in this process (``ServingRank.prefill``), one prompt at a time.

    ``lockstep_group``: a sharded MoE that gathers across DP groups prefills on every rank at
    once, padded to the same length; then every rank calls ``admit`` every step.
    """

    def __init__(self, prefill, kv_caches, *, lockstep_group=None, aux_layers: tuple[int, ...] = (),
                 proposer: Proposer | None = None):
        self.prefill, self.kv_caches, self.aux_layers, self.proposer = prefill, kv_caches, aux_layers, proposer
        self.group = lockstep_group
        self.collective = self.group is not None

    def admit(self, reqs: list[Request], blocks: BlockManager, hold: Sequence[int] = ()) -> None:
        """``hold``: per request, the positions the engine's first decode reserve will hold (the scheduler's
        ``first_hold``): reserved here already, so that reserve changes nothing and the tables change once."""
        pads = dp_sync.lockstep([len(r.prompt) for r in reqs], self.group)[0] if self.collective else [0] * len(reqs)
        for n, pad_to in enumerate(pads):
            kw = {"pad_to": pad_to, "logits": "last"} if self.collective else {"logits": "last"}
            if self.aux_layers:
                kw["aux_layers"] = self.aux_layers
            if n >= len(reqs):  # no n-th request here: take part in the prefill's collectives only
                none = torch.zeros(1, dtype=torch.long)
                self.prefill([], self.kv_caches, {g.name: none for g in blocks.groups}, **kw)
                continue
            r = reqs[n]
            r.key = r.key if r.key is not None else f"req-{r.index}"
            N = len(r.prompt)
            blocks.reserve(r.key, max(N, hold[n] if n < len(hold) else N), N)  # prefill reads no cache
            rows = {g: t[0] for g, t in block_rows(blocks, [r.key], [N]).items()}
            out = self.prefill(r.prompt, self.kv_caches, rows, **kw)
            logits, aux = out if self.aux_layers else (out, None)
            r.computed, r.next = N, int(logits[-1].argmax())
            r.tokens.append(r.next)
            if self.proposer is not None and aux is not None:
                self.proposer.on_prefill(r, r.prompt, aux, rows[FULL_GROUP])

    def close(self) -> None:
        pass


__all__ = ["FULL_GROUP", "SLIDING_GROUP", "BlockRows", "KVSource", "LocalPrefill", "Proposer", "Request", "block_rows"]
