"""One vLLM forward -> the bundle: every one-token row through one artifact, every longer row (a prompt or a
chunk of one) through the bundle's own eager prefill, on vLLM's KV tensors and tables.

vLLM's model runner hands the model, per forward, the token ids and positions of the scheduled tokens and (in
its forward context) each layer's attention metadata: ``query_start_loc``, ``seq_lens`` and the block table of
the layer's KV cache group (HMA: the sliding group's table for sliding layers, the full group's for full
layers). Request r's tokens are ``[starts[r], starts[r + 1])``, the first at position ``positions[starts[r]]``
(its computed tokens).

- **One-token rows** (every decode row, and a prompt's one-token last chunk, which is the same computation)
  run together as one step of the runtime's Stepper: planned from their own computed counts (the seeds'
  formula), the batch bucket from their count, vLLM's tables trimmed, the artifact writing K/V in place.
- **Longer rows** run ``Bundle.prefill`` one at a time from their first position (the KV of the positions
  before it is already in the tensors), writing K/V through the request's rows of vLLM's tables.

The logits of every request's last token (what vLLM's runner picks without drafts) wait here for
``compute_logits``: the hidden states this returns carry each request's row id at its last token, and
``take_logits`` maps vLLM's pick back. No vLLM layer computes anything, and nothing about a request is kept
between forwards.
"""

from __future__ import annotations

import itertools
import time

import torch
from vllm.forward_context import get_forward_context

from neffbuild.errors import IncompatibleBundle
from neffbuild.runtime import FULL_GROUP, SLIDING_GROUP, StepBatch, Stepper
from neffbuild.vllm.kv import bundle_view
from neffbuild.vllm.metrics import PluginMetrics


class BundleDecoder:
    """The plugin's per-forward dispatch; holds the bundle, the Stepper (built on vLLM's tensors) and counters."""

    def __init__(self, bundle, attention_layers, hidden_size: int):
        self.bundle, self.layers, self.hidden_size = bundle, list(attention_layers), hidden_size
        self.block_size = bundle.kv_layout.block_size
        sliding = [a for a in self.layers if a.sliding_window is not None]
        full = [a for a in self.layers if a.sliding_window is None]
        self.full_name = full[0].layer_name
        self.sliding_name = sliding[0].layer_name if sliding else None
        self.metrics = PluginMetrics(bundle.grid.max_model_len)
        self.stepper: Stepper | None = None
        self._buffers: list[torch.Tensor] | None = None
        self._pending: torch.Tensor | None = None  # this forward's logits, one row per request [R, vocab]

    # -- vLLM's KV tensors as the bundle's buffers (once: vLLM binds them after the model is built)
    def kv_buffers(self) -> list[torch.Tensor]:
        """Buffer j is the one tensor vLLM gave every layer the bundle maps to j (``facts.layer_buffers``)."""
        if self._buffers is None:
            facts, out = self.bundle.facts, []
            for j in range(self.bundle.kv_layout.num_buffers):
                layers = [i for i, b in enumerate(facts.layer_buffers) if b == j]
                tensors = [_tensor(self.layers[i].kv_cache) for i in layers]
                if len({t.data_ptr() for t in tensors}) != 1:
                    raise IncompatibleBundle(
                        f"neffbuild: layers {layers} have KV tensors of their own; the bundle's layers {layers} share "
                        f"KV buffer {j}, as vLLM's hybrid KV cache manager lays them out (do not pass "
                        "--disable-hybrid-kv-cache-manager)")
                out.append(bundle_view(tensors[0], self.bundle.kv_layout.dtype))
            self._buffers = out
        return self._buffers

    def _stepper(self) -> Stepper:
        if self.stepper is None:
            self.stepper = Stepper(self.bundle, kv_caches=self.kv_buffers())
        return self.stepper

    # -- one forward
    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states for vLLM's runner: zeros but each request's row id at its last token (``take_logits``)."""
        self._pending = None
        T = positions.shape[0]
        hidden = torch.zeros(T, self.hidden_size, dtype=torch.float32)
        metadata = get_forward_context().attn_metadata
        if not isinstance(metadata, dict) or self.full_name not in metadata or input_ids is None \
                or not _bound(self.layers[0].kv_cache):
            return hidden  # vLLM's profile and dummy runs: nothing to compute, nothing to write
        start = time.perf_counter()
        starts = metadata[self.full_name].query_start_loc.tolist()
        lengths = [b - a for a, b in itertools.pairwise(starts)]
        ones = [r for r, n in enumerate(lengths) if n == 1]
        longer = [r for r, n in enumerate(lengths) if n > 1]
        self.metrics.forward("decode" if not longer else "mixed" if ones else "prefill")
        logits: list[torch.Tensor | None] = [None] * len(lengths)
        if ones:
            for r, row in zip(ones, self._decode(metadata, input_ids, positions, ones, starts), strict=True):
                logits[r] = row
        for r in longer:
            logits[r] = self._prefill(metadata, input_ids, positions, r, starts)
        live = [r for r, n in enumerate(lengths) if n > 0]
        self._pending = torch.stack([logits[r] for r in live]).float() if live else None
        for i, r in enumerate(live):
            hidden[starts[r + 1] - 1, 0] = i  # row ids: compute_logits maps vLLM's picks back
        self.metrics.seconds("forward", time.perf_counter() - start)
        return hidden

    def _decode(self, metadata, input_ids, positions, rows: list[int], starts: list[int]) -> torch.Tensor:
        """The artifact for requests ``rows`` (one token each, at token index ``starts[r]``): logits [len, vocab]."""
        full = metadata[self.full_name]
        at = torch.tensor([starts[r] for r in rows], dtype=torch.long)
        index = torch.tensor(rows, dtype=torch.long)
        computed = positions.index_select(0, at).long()
        live = computed // self.block_size + 1  # [R] each row's own blocks (columns [0, live))
        width = int(computed.max()) // self.block_size + 1
        beyond = torch.arange(width) >= live[:, None]  # [R, width]: the columns past each row's blocks
        tables = {FULL_GROUP: _table(full.block_table, index, width, beyond)}
        if self.sliding_name is not None:
            tables[SLIDING_GROUP] = _table(metadata[self.sliding_name].block_table, index, width, beyond)
        batch = StepBatch(tokens=[[t] for t in input_ids.index_select(0, at).tolist()],
                          num_computed=computed.tolist(), block_tables=tables)
        stepper = self._stepper()
        ran = time.perf_counter()
        out = stepper.run(stepper.plan(batch), batch)
        self.metrics.seconds("run", time.perf_counter() - ran)  # Stepper.run: inputs + the artifact
        self.metrics.artifact(out.plan.label, out.plan.needed_seq)
        self.metrics.decode_rows("artifact", len(rows))
        return out.logits[:, 0]  # [R, vocab]

    def _prefill(self, metadata, input_ids, positions, r: int, starts: list[int]) -> torch.Tensor:
        """Request ``r``'s prompt tokens (or a chunk of them) through the bundle's eager prefill: [vocab]."""
        a, b = starts[r], starts[r + 1]
        first = int(positions[a])
        rows = {FULL_GROUP: metadata[self.full_name].block_table[r].long()}
        if self.sliding_name is not None:
            rows[SLIDING_GROUP] = metadata[self.sliding_name].block_table[r].long()
        ran = time.perf_counter()
        out = self.bundle.prefill(input_ids[a:b], self.kv_buffers(), rows, start=first, logits="last")
        self.metrics.seconds("prefill", time.perf_counter() - ran)
        self.metrics.prefill_tokens(b - a)
        return out[0]

    def take_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """This forward's logits for the rows vLLM's runner picked (``hidden_states[:, 0]``: the row ids), once."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        return pending.index_select(0, hidden_states[:, 0].long())


def _table(table: torch.Tensor, rows: torch.Tensor, width: int, beyond: torch.Tensor) -> torch.Tensor:
    """vLLM's rows cut to the columns this step can touch, columns past each row's live blocks nulled.

    vLLM's persistent block table keeps ids of earlier requests past a row's own blocks; the artifact reads
    whole head-trimmed rows (masked by position), so the step's view holds the row's own blocks only. A copy:
    vLLM's table is left as it is (the Stepper's checks then range-check every id it holds).
    """
    return table.index_select(0, rows)[:, :width].long().masked_fill(beyond, 0)  # a new tensor (0: the null block)


def _bound(kv_cache) -> bool:
    t = _tensor(kv_cache) if isinstance(kv_cache, (list, tuple)) and kv_cache else kv_cache
    return isinstance(t, torch.Tensor) and t.numel() > 0


def _tensor(kv_cache) -> torch.Tensor:
    return kv_cache[0] if isinstance(kv_cache, (list, tuple)) else kv_cache
