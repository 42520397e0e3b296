"""The engine's parts: a request, where its KV comes from (``KVSource``), who drafts (``Proposer``).

The engine (serve/engine.py) is one loop per rank; a mode is a choice of parts, never a loop:

* ``KVSource`` -- how an admitted request gets its prompt's KV into this rank's blocks.
  ``admit(reqs, blocks)`` reserves each request's blocks (under ``req.key``), fills them,
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
  draft is replicated on every rank (see that module).

* World (serve/world.py): one process, or the bundle's tp x dp ranks (``--dp N`` for an
  unsharded bundle) as gloo processes; each DP group owns ``requests[g::dp]``.

Not here: the step itself (runtime/step.py, stateless about requests), block accounting
(runtime/blocks.py), the CLI.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from neffbuild.runtime.blocks import FULL_GROUP, SLIDING_GROUP, BlockManager


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


def block_rows(blocks: BlockManager, keys: Sequence, upto: Sequence[int]) -> dict[str, torch.Tensor]:
    """{group: [R, W]} rows for the requests, W = blocks of the longest (never the pool or max_model_len)."""
    width = max((-(-n // blocks.block_size) for n in upto), default=1)
    return {g.name: torch.tensor([blocks.row(k, g.name, width) for k in keys], dtype=torch.long)
            .reshape(len(keys), width) for g in blocks.groups}


class BlockRows:
    """The engine's ``{group: [R, W]}`` tables, kept from step to step and updated in place.

    Building a table costs ~10 us per group (torch.tensor of a few rows), more than the rest of
    the engine's step. So the tables live in one flat ``array('q')`` buffer that a tensor view
    shares (``torch.frombuffer``): while the live requests and the width stay the same, a step
    rewrites only the rows of requests whose blocks changed (``BlockManager.version``), in pure
    Python; a request joining or leaving, or a wider table, builds a new buffer. The tensors of
    one call are valid, read-only, until the next call (the Stepper reads them in the step).
    The buffer is never resized: every write is one row of exactly ``W`` ids.
    """

    def __init__(self, blocks: BlockManager):
        self.blocks = blocks
        self._keys: list = []
        self._width = -1
        self._versions: list[int] = []
        self._buf = array("q")
        self._rows: dict[str, torch.Tensor] = {}

    def __call__(self, keys: Sequence, upto: Sequence[int]) -> dict[str, torch.Tensor]:
        blocks, bs = self.blocks, self.blocks.block_size
        width = max((-(-n // bs) for n in upto), default=1)
        versions = [blocks.version(k) for k in keys]
        if width != self._width or list(keys) != self._keys or not keys:
            self._rebuild(list(keys), width)
        elif versions != self._versions:
            R = len(keys)
            for i, (k, v, old) in enumerate(zip(keys, versions, self._versions, strict=True)):
                if v != old:
                    for gi, g in enumerate(blocks.groups):
                        at = (gi * R + i) * width
                        self._buf[at: at + width] = array("q", blocks.row(k, g.name, width))
        self._versions = versions
        return self._rows

    def _rebuild(self, keys: list, width: int) -> None:
        groups = self.blocks.groups
        self._keys, self._width = keys, width
        if not keys:
            self._buf = array("q")
            self._rows = {g.name: torch.zeros((0, width), dtype=torch.long) for g in groups}
            return
        self._buf = array("q", [b for g in groups for k in keys for b in self.blocks.row(k, g.name, width)])
        view = torch.frombuffer(self._buf, dtype=torch.long).view(len(groups), len(keys), width)
        self._rows = {g.name: view[gi] for gi, g in enumerate(groups)}


class KVSource(Protocol):
    collective: bool

    def admit(self, reqs: list[Request], blocks: BlockManager) -> None: ...

    def close(self) -> None: ...


class Proposer(Protocol):
    k: int

    def on_prefill(self, req: Request, prompt: list[int], aux: torch.Tensor, full_row: torch.Tensor) -> None: ...

    def propose(self, reqs: list[Request], blocks: BlockManager) -> str | None: ...

    def after_step(self, req: Request, emitted: list[int], aux: torch.Tensor | None, first_pos: int) -> None: ...


class LocalPrefill:
    """KV source: the model's eager prefill in this process (``Session.prefill``), one prompt at a time.

    ``lockstep_group``: a sharded MoE that gathers across DP groups prefills on every rank at
    once, padded to the same length; then every rank calls ``admit`` every step.
    """

    def __init__(self, prefill, kv_caches, *, lockstep_group=None, aux_layers: tuple[int, ...] = (),
                 proposer: Proposer | None = None):
        self.prefill, self.kv_caches, self.aux_layers, self.proposer = prefill, kv_caches, aux_layers, proposer
        self.group = lockstep_group
        self.collective = self.group is not None

    def admit(self, reqs: list[Request], blocks: BlockManager) -> None:
        pads = _lockstep([r.prompt for r in reqs], self.group) if self.collective else [0] * len(reqs)
        for n, pad_to in enumerate(pads):
            kw = {"pad_to": pad_to} if self.collective else {}
            if self.aux_layers:
                kw["aux_layers"] = self.aux_layers
            if n >= len(reqs):  # no n-th request here: take part in the prefill's collectives only
                none = torch.zeros(1, dtype=torch.long)
                self.prefill([], self.kv_caches, {g.name: none for g in blocks.groups}, **kw)
                continue
            r = reqs[n]
            r.key = r.key if r.key is not None else f"req-{r.index}"
            N = len(r.prompt)
            blocks.reserve(r.key, N, N)  # prefill reads no cache: keep only what decode reads
            rows = {g: t[0] for g, t in block_rows(blocks, [r.key], [N]).items()}
            out = self.prefill(r.prompt, self.kv_caches, rows, **kw)
            logits, aux = out if self.aux_layers else (out, None)
            r.computed, r.next = N, int(logits[-1].argmax())
            r.tokens.append(r.next)
            if self.proposer is not None and aux is not None:
                self.proposer.on_prefill(r, r.prompt, aux, rows[FULL_GROUP])

    def close(self) -> None:
        pass


def _lockstep(prompts: Sequence[Sequence[int]], group) -> list[int]:
    """The padded length of every prefill all ranks run together: MAX over ranks of the count and the lengths."""
    import torch.distributed as dist

    count = torch.tensor([len(prompts)])
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    if int(count) == 0:
        return []
    lengths = torch.zeros(int(count), dtype=torch.long)
    lengths[: len(prompts)] = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    dist.all_reduce(lengths, op=dist.ReduceOp.MAX, group=group)
    return lengths.tolist()


__all__ = ["FULL_GROUP", "SLIDING_GROUP", "BlockRows", "KVSource", "LocalPrefill", "Proposer", "Request", "block_rows"]
