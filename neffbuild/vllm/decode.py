"""One vLLM forward -> the bundle: every short row through one artifact, every longer row (a prompt or a chunk
of one) through the bundle's own eager prefill, on vLLM's KV tensors and tables.

vLLM's model runner hands the model, per forward, the token ids and positions of the scheduled tokens and (in
its forward context) each layer's attention metadata: ``query_start_loc``, ``seq_lens`` and the block table of
the layer's KV cache group (HMA: the sliding group's table for sliding layers, the full group's for full
layers). Request r's tokens are ``[starts[r], starts[r + 1])``, the first at position ``positions[starts[r]]``
(its computed tokens).

- **Step rows** (one token; with vLLM speculating, up to 1 + k: a decode row's next token and its d <= k drafts)
  run together as one step of the runtime's Stepper: planned from their own computed counts (the seeds'
  formula), the batch bucket from their count, vLLM's tables trimmed, the artifact writing K/V in place. With
  drafts in the step that is the ``target_spec`` artifact (short rows padded, their padded writes masked), else
  ``target_nospec`` (or ``decode`` for a bundle without drafts). A row with no room for k drafts before
  ``max_model_len`` runs its tokens one step at a time through ``target_nospec`` (the seeds' rule), apart; rows
  without drafts beside rows with drafts run apart through ``target_nospec`` too, as do rows whose drafts are
  vLLM's placeholders (``_placeholders``: a DI decode instance's first step for a transferred request, which has
  no aux states to draft from: the seeds' ``target_nospec`` first step, speculation from the next step on).
- **Longer rows** run ``Bundle.prefill`` one at a time from their first position (the KV of the positions
  before it is already in the tensors), writing K/V through the request's rows of vLLM's tables.

The logits vLLM's runner may sample (every position of a step row: the rejection sampler verifies each draft;
the last position of a prefill row) wait here for ``compute_logits``: the hidden states this returns carry a row
id at each of those tokens, and ``take_logits`` maps vLLM's pick back. With EAGLE3 the forward also returns the
target's aux hidden states of every scheduled token (the artifacts' and the prefill's), which vLLM's drafter
consumes (neffbuild/vllm/draft.py). No vLLM layer computes anything, and nothing about a request is kept
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

# The decoder serving each bundle in this process (vLLM's worker builds the target model first, then the drafter,
# whose model finds the target's Stepper and KV here: neffbuild/vllm/draft.py).
_SERVING: dict[str, BundleDecoder] = {}


def serving(bundle: str) -> BundleDecoder:
    """The target's decoder for ``bundle`` in this process (IncompatibleBundle when the target is not the plugin's)."""
    found = _SERVING.get(bundle)
    if found is None:
        raise IncompatibleBundle(f"--speculative-config: the EAGLE3 draft of bundle {bundle} is served by the "
                                 "neffbuild plugin only beside its target (serve the bundle folder itself)")
    return found


def register(bundle: str, decoder: BundleDecoder) -> None:
    _SERVING[bundle] = decoder


class BundleDecoder:
    """The plugin's per-forward dispatch; holds the bundle, the Stepper (built on vLLM's tensors) and counters."""

    def __init__(self, bundle, attention_layers, hidden_size: int):
        self.bundle, self.layers, self.hidden_size = bundle, list(attention_layers), hidden_size
        self.block_size = bundle.kv_layout.block_size
        sliding = [a for a in self.layers if a.sliding_window is not None]
        full = [a for a in self.layers if a.sliding_window is None]
        self.full_name = full[0].layer_name
        self.sliding_name = sliding[0].layer_name if sliding else None
        self.metrics = PluginMetrics(bundle.grid.max_model_len, bundle.facts.rank)
        self.synced = bundle.group is not None  # dp > 1: every forward takes part in the DP step (``forward``)
        self.lockstep = bundle.facts.parallel.ep_gathers  # the prefill's MoE gathers across DP groups too
        self.stepper: Stepper | None = None
        self.draft_layer = None  # EAGLE3: the draft model's vLLM Attention (its KV tensor: the draft's buffer)
        self.aux_layers: tuple[int, ...] = ()  # EAGLE3 with vLLM speculating: the forward returns their states
        self.k = 0  # drafts per row vLLM schedules (0: vLLM does not speculate)
        self.handed: dict[tuple[int, int], tuple[int, ...]] = {}  # the last draft call's (position, token) -> drafts
        self.arrived: dict[int, int] = {}  # this forward's rows with placeholder drafts (DI: just transferred)
        self._buffers: list[torch.Tensor] | None = None
        self._pending: torch.Tensor | None = None  # this forward's logits, one row per id [P, vocab]

    def speculate(self, num_speculative_tokens: int, draft_layer) -> None:
        """vLLM speculates with the bundle's draft: step rows carry up to k drafts, the draft's KV is vLLM's tensor
        for ``draft_layer`` (the forward returns aux states once vLLM asks: the model's set_aux_hidden_state_layers)."""
        self.k, self.draft_layer = num_speculative_tokens, draft_layer

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

    def draft_buffer(self) -> torch.Tensor | None:
        """The draft's KV buffer: vLLM's tensor for the draft model's layer, in the bundle's layout.

        vLLM's hybrid KV manager puts the draft's layer in a KV cache group of its own and lets every group share one
        tensor (each group its own block ids from the one pool, as the sliding and full groups do): the draft's
        buffer is then a view of the target's bytes, addressed by the draft group's block table only."""
        if self.draft_layer is None:
            return None
        return bundle_view(_tensor(self.draft_layer.kv_cache), self.bundle.kv_layout.dtype)

    def _stepper(self) -> Stepper:
        if self.stepper is None:
            self.stepper = Stepper(self.bundle, kv_caches=self.kv_buffers(), draft_kv_cache=self.draft_buffer(),
                                   group=self.bundle.group)  # the DP ranks' twin group (neffbuild/vllm/ranks.py)
        return self.stepper

    # -- one forward
    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor):
        """Hidden states for vLLM's runner: zeros but a row id at each token it may sample (``take_logits``);
        with EAGLE3 ``(hidden, [aux])``, aux [T, 3H] the target's aux states of every scheduled token.

        DP (a bundle of dp > 1): every forward of every rank, vLLM's dummy batch on an idle rank included, issues
        the same collectives: the prefills in lockstep (when the MoE gathers across DP groups), then exactly one
        Stepper step (its one DP all-reduce and the synced artifact; ``idle()`` without decode rows)."""
        self._pending = None
        T = positions.shape[0]
        hidden = torch.zeros(T, self.hidden_size, dtype=torch.float32)
        aux = torch.zeros(T, 3 * self.hidden_size, dtype=torch.float32) if self.aux_layers else None
        if not _bound(self.layers[0].kv_cache):
            return _out(hidden, aux)  # vLLM's profile run, before its KV exists: nothing to compute, no peer waits
        metadata = get_forward_context().attn_metadata
        if not isinstance(metadata, dict) or self.full_name not in metadata or input_ids is None:
            if self.synced:  # vLLM's dummy batch on an idle DP rank (execute_dummy_batch): its peers' collectives
                self.metrics.forward("idle")
                self._prefills(metadata, input_ids, positions, [], [0], aux)
                self._idle()
            return _out(hidden, aux)
        start = time.perf_counter()
        starts = metadata[self.full_name].query_start_loc.tolist()
        lengths = [b - a for a, b in itertools.pairwise(starts)]
        steps = [r for r, n in enumerate(lengths) if 1 <= n <= 1 + self.k]
        longer = [r for r, n in enumerate(lengths) if n > 1 + self.k]
        self.metrics.forward("decode" if not longer else "mixed" if steps else "prefill")
        logits: list[torch.Tensor | None] = [None] * len(lengths)  # per request: [n or 1, vocab]
        for r, out in zip(longer, self._prefills(metadata, input_ids, positions, longer, starts, aux), strict=True):
            logits[r] = out
        if steps:
            rows = self._step_rows(metadata, input_ids, positions, steps, starts, lengths)
            for r, (row_logits, row_aux) in zip(steps, rows, strict=True):
                logits[r] = row_logits
                if aux is not None:
                    aux[starts[r]:starts[r + 1]] = row_aux
        elif self.synced:
            self._idle()  # a prefill-only forward: the DP step all the same
        live = [r for r in range(len(lengths)) if logits[r] is not None]
        self._pending = torch.cat([logits[r] for r in live]).float() if live else None
        next_id = 0
        for r in live:
            n = logits[r].shape[0]  # ids at the request's last n tokens (every token of a step row)
            hidden[starts[r + 1] - n:starts[r + 1], 0] = torch.arange(next_id, next_id + n, dtype=torch.float32)
            next_id += n
        self.metrics.seconds("forward", time.perf_counter() - start)
        return _out(hidden, aux)

    def _prefills(self, metadata, input_ids, positions, rows: list[int], starts: list[int], aux) -> list:
        """The longer rows' prefills ([1, vocab] each); in lockstep with the other DP ranks when the bundle's MoE
        gathers across DP groups (a rank without an n-th prompt runs an empty one at the same padded length)."""
        if not self.lockstep:
            return [self._prefill(metadata, input_ids, positions, r, starts, aux) for r in rows]
        synced = time.perf_counter()
        pads = self._stepper().lockstep([starts[r + 1] - starts[r] for r in rows])
        self.metrics.seconds("lockstep", time.perf_counter() - synced)
        out = []
        for n, pad in enumerate(pads):
            if n < len(rows):
                out.append(self._prefill(metadata, input_ids, positions, rows[n], starts, aux, pad_to=pad))
            else:
                none = torch.zeros(1, dtype=torch.long)
                self.bundle.prefill([], self.kv_buffers(), {FULL_GROUP: none, SLIDING_GROUP: none}, pad_to=pad,
                                    aux_layers=self.aux_layers)
        return out

    def _idle(self) -> None:
        """This DP rank's step without decode rows: the synced artifact on padding rows (``Stepper.idle``),
        counted under the label it ran, so the ranks' labels compare step for step (metrics.py)."""
        out = self._stepper().idle()
        self.metrics.artifact(out.plan.label, None, out.plan.family)

    def _step_rows(self, metadata, input_ids, positions, rows: list[int], starts: list[int], lengths: list[int]):
        """Requests ``rows`` (1..1+k tokens each) through artifacts: per request (logits [n, V], aux [n, A])."""
        computed = {r: int(positions[starts[r]]) for r in rows}
        mml = self.bundle.grid.max_model_len
        room = [r for r in rows if not self.k or computed[r] + 1 + self.k <= mml]
        tight = [r for r in rows if r not in room]  # no room for k drafts: their tokens one step at a time
        tokens = {r: input_ids[starts[r]:starts[r + 1]].tolist() for r in room}
        spec = [r for r in room if lengths[r] > 1 and not self._placeholders(tokens[r], computed[r])]
        # every other row runs its one token apart, through target_nospec: rows without drafts and rows whose
        # drafts are vLLM's placeholders (a DI decode instance: a transferred request's first step)
        bare = [r for r in room if r not in spec]
        self.arrived = {r: computed[r] for r in bare if lengths[r] > 1}  # vLLM's row -> its first draft position
        out: dict[int, tuple] = {}
        for part in (spec, bare):
            if not part:
                continue
            step = self._run(metadata, part, [tokens[r] if r in spec else tokens[r][:1] for r in part],
                             [computed[r] for r in part])
            for i, r in enumerate(part):
                m = lengths[r] if r in spec else 1
                lg, ax = step.logits[i, :m], step.aux_hidden[i, :m] if step.aux_hidden is not None else None
                if m < lengths[r]:  # placeholder drafts, rejected whatever their logits: the first row's stand in
                    lg = lg.expand(lengths[r], -1)
                    ax = torch.cat([ax, ax.new_zeros(lengths[r] - m, ax.shape[1])]) if ax is not None else None
                out[r] = (lg, ax)
        for t in range(max((lengths[r] for r in tight), default=0)):
            now = [r for r in tight if lengths[r] > t]
            step = self._run(metadata, now, [[int(input_ids[starts[r] + t])] for r in now],
                             [computed[r] + t for r in now])
            for i, r in enumerate(now):
                parts = out.setdefault(r, ([], []))
                parts[0].append(step.logits[i, :1])
                parts[1].append(step.aux_hidden[i, :1] if step.aux_hidden is not None else None)
        for r in tight:
            lg, ax = out[r]
            out[r] = (torch.cat(lg), torch.cat(ax) if ax[0] is not None else None)
        return [out[r] for r in rows]

    def _placeholders(self, tokens: list[int], position: int) -> bool:
        """Whether a row's drafts are vLLM's placeholders, not drafts of this instance's drafter.

        vLLM 0.32's scheduler pads a new request's one-token decode step to 1 + k rows (uniform decode steps) with
        draft ids -1, which its rejection sampler always rejects and its runner clamps to 0 for the forward. On a
        DI decode instance that is every transferred request's first step, which has no aux states to draft from
        (the seeds: it runs target_nospec). Placeholders: drafts all 0 that the last draft call did not propose
        for this position and next token (``handed``, kept by neffbuild/vllm/draft.py); a real draft is never
        taken for one."""
        drafts = tuple(tokens[1:])
        return not any(drafts) and self.handed.get((position, tokens[0]), ())[:len(drafts)] != drafts

    def _run(self, metadata, rows: list[int], tokens: list[list[int]], computed: list[int]):
        """One Stepper step for requests ``rows`` of vLLM's batch: ``tokens`` from position ``computed`` each."""
        index = torch.tensor(rows, dtype=torch.long)
        last = torch.tensor([c + len(t) - 1 for c, t in zip(computed, tokens, strict=True)], dtype=torch.long)
        tables = {FULL_GROUP: trimmed_table(metadata[self.full_name].block_table, index, last, self.block_size)}
        if self.sliding_name is not None:
            tables[SLIDING_GROUP] = trimmed_table(metadata[self.sliding_name].block_table, index, last,
                                                  self.block_size)
        batch = StepBatch(tokens=tokens, num_computed=computed, block_tables=tables)
        stepper = self._stepper()
        planned = time.perf_counter()
        plan = stepper.plan(batch)  # with dp > 1: the DP all-reduce, waiting for the slowest rank included
        ran = time.perf_counter()
        out = stepper.run(plan, batch)
        self.metrics.seconds("plan", ran - planned)
        self.metrics.seconds("run", time.perf_counter() - ran)  # Stepper.run: inputs + the artifact
        self.metrics.artifact(out.plan.label, out.plan.needed_seq, out.plan.family, rows=len(rows))
        self.metrics.decode_rows("artifact", len(rows))
        return out

    def _prefill(self, metadata, input_ids, positions, r: int, starts: list[int], aux, pad_to: int = 0
                 ) -> torch.Tensor:
        """Request ``r``'s prompt tokens (or a chunk of them) through the bundle's eager prefill: [1, vocab]; with
        EAGLE3 their aux states into ``aux``."""
        a, b = starts[r], starts[r + 1]
        first = int(positions[a])
        rows = {FULL_GROUP: metadata[self.full_name].block_table[r].long()}
        if self.sliding_name is not None:
            rows[SLIDING_GROUP] = metadata[self.sliding_name].block_table[r].long()
        ran = time.perf_counter()
        out = self.bundle.prefill(input_ids[a:b], self.kv_buffers(), rows, start=first, logits="last",
                                  aux_layers=self.aux_layers, pad_to=pad_to)
        if aux is not None:
            out, aux[a:b] = out
        self.metrics.seconds("prefill", time.perf_counter() - ran)
        self.metrics.prefill_tokens(b - a)
        return out[-1:]

    def take_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """This forward's logits for the rows vLLM's runner picked (``hidden_states[:, 0]``: the row ids), once."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        return pending.index_select(0, hidden_states[:, 0].long())


def _out(hidden: torch.Tensor, aux: torch.Tensor | None):
    """What vLLM's runner takes: the hidden states, and with EAGLE3 the aux states as its list of one tensor."""
    return hidden if aux is None else (hidden, [aux])


def trimmed_table(table: torch.Tensor, rows: torch.Tensor, last: torch.Tensor, block_size: int) -> torch.Tensor:
    """vLLM's rows cut to the columns this step can touch, columns past each row's live blocks nulled: row i's
    live blocks hold positions up to ``last[i]`` (the last position the step writes or reads for it).

    vLLM's persistent block table keeps ids of earlier requests past a row's own blocks; the artifact reads
    whole head-trimmed rows (masked by position), so the step's view holds the row's own blocks only. A copy:
    vLLM's table is left as it is (the Stepper's checks then range-check every id it holds).
    """
    live = last // block_size + 1  # [R] each row's own blocks (columns [0, live))
    width = int(live.max())
    beyond = torch.arange(width) >= live[:, None]  # [R, width]: the columns past each row's blocks
    return table.index_select(0, rows)[:, :width].long().masked_fill(beyond, 0)  # a new tensor (0: the null block)


def _bound(kv_cache) -> bool:
    t = _tensor(kv_cache) if isinstance(kv_cache, (list, tuple)) and kv_cache else kv_cache
    return isinstance(t, torch.Tensor) and t.numel() > 0


def _tensor(kv_cache) -> torch.Tensor:
    return kv_cache[0] if isinstance(kv_cache, (list, tuple)) else kv_cache
