"""One vLLM forward whose requests are all in decode -> one bundle artifact, on vLLM's KV tensors and tables.

vLLM's model runner hands the model, per forward, the token ids and positions of the scheduled tokens and (in
its forward context) each layer's attention metadata: ``max_query_len``, ``seq_lens`` and the block table of
the layer's KV cache group (HMA: the sliding group's table for sliding layers, the full group's for full
layers). A forward with ``max_query_len == 1`` has every request in decode: row r's token sits at position
``num_computed[r]`` (= ``positions[r]``), so the runtime's Stepper plans it exactly as the seeds' formula says
(``max(num_computed) + 1 + k`` -> context bucket; the batch bucket from the row count), trims vLLM's tables,
and runs the artifact, which writes the new K/V into vLLM's tensors in place. Its logits go back to vLLM's
sampler through ``compute_logits`` (``take_logits``). Nothing about a request is kept between forwards: each
forward is planned from what vLLM passes in that forward.

Any other forward (a prefill, a chunk of one, a mixed batch) runs vLLM's own eager model, whose attention reads
and writes the same tensors in the bundle's layout (neffbuild/vllm/attention.py).
"""

from __future__ import annotations

import itertools
import time

import torch
from vllm.forward_context import get_forward_context

from neffbuild.errors import IncompatibleBundle
from neffbuild.runtime import FULL_GROUP, SLIDING_GROUP, StepBatch, Stepper
from neffbuild.vllm.attention import bundle_view
from neffbuild.vllm.metrics import PluginMetrics


class BundleDecoder:
    """The plugin's per-forward dispatch; holds the bundle, the Stepper (built on vLLM's tensors) and counters."""

    def __init__(self, bundle, attention_layers, hidden_size: int):
        self.bundle, self.layers, self.hidden_size = bundle, list(attention_layers), hidden_size
        self.block_size = bundle.kv_layout.block_size
        sliding = [a for a in self.layers if a.impl.sliding_window not in (None, -1)]
        full = [a for a in self.layers if a.impl.sliding_window in (None, -1)]
        self.full_name = full[0].layer_name
        self.sliding_name = sliding[0].layer_name if sliding else None
        self.metrics = PluginMetrics(bundle.grid.max_model_len)
        self.stepper: Stepper | None = None
        self._pending: torch.Tensor | None = None  # an all-decode forward's logits [R, vocab]
        self._mixed: tuple | None = None  # a mixed forward's (one-token request rows, their logits, requests)

    # -- vLLM's KV tensors as the bundle's buffers (once: vLLM binds them after the model is built)
    def kv_buffers(self) -> list[torch.Tensor]:
        """Buffer j is the one tensor vLLM gave every layer the bundle maps to j (``facts.layer_buffers``)."""
        of_layer = self.bundle.facts.layer_buffers
        out = []
        for j in range(self.bundle.kv_layout.num_buffers):
            layers = [i for i, b in enumerate(of_layer) if b == j]
            tensors = [_tensor(self.layers[i].kv_cache) for i in layers]
            if len({t.data_ptr() for t in tensors}) != 1:
                raise IncompatibleBundle(
                    f"neffbuild: layers {layers} have KV tensors of their own; the bundle's layers {layers} share "
                    f"KV buffer {j}, as vLLM's hybrid KV cache manager lays them out (do not pass "
                    "--disable-hybrid-kv-cache-manager)")
            out.append(bundle_view(tensors[0]))
        return out

    def _stepper(self) -> Stepper:
        if self.stepper is None:
            self.stepper = Stepper(self.bundle, kv_caches=self.kv_buffers())
        return self.stepper

    # -- one forward
    def try_decode(self, input_ids: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor | None:
        """The artifact's stand-in hidden states for an all-decode forward, else None (vLLM's model runs).

        In a forward that mixes one-token rows with prefill chunks, the one-token rows run their artifact here
        (their logits wait for ``compute_logits``) and the eager attention skips them (``skip_tokens``): vLLM's
        model then runs the chunks. A one-token row is a decode step whatever vLLM calls it (a one-token last
        chunk attends over its cached KV exactly as a decode step does)."""
        self._pending = self._mixed = None
        self.skip_tokens(None)
        metadata = get_forward_context().attn_metadata
        if not isinstance(metadata, dict) or self.full_name not in metadata or input_ids is None:
            return None  # vLLM's profile and warm-up runs
        if self.stepper is None and not _bound(self.layers[0].kv_cache):
            return None  # a dummy run before vLLM bound its KV tensors (profiling): vLLM's model runs it
        full = metadata[self.full_name]
        starts = full.query_start_loc.tolist()
        ones = [r for r, (a, b) in enumerate(itertools.pairwise(starts)) if b - a == 1]
        start = time.perf_counter()
        if full.max_query_len == 1:
            self.metrics.forward("decode")
            R = len(ones)
            logits = self._run(metadata, input_ids, positions, ones, starts)
            self._pending = logits
            hidden = torch.zeros(input_ids.shape[0], self.hidden_size, dtype=logits.dtype)
            hidden[:R, 0] = torch.arange(R, dtype=hidden.dtype)  # row ids: compute_logits maps vLLM's picks back
            self.metrics.seconds("forward", time.perf_counter() - start)
            return hidden
        self.metrics.forward("mixed" if ones else "prefill")
        if ones:
            self._mixed = (ones, self._run(metadata, input_ids, positions, ones, starts), len(starts) - 1)
            skip = torch.zeros(input_ids.shape[0], dtype=torch.bool)
            skip[[starts[r] for r in ones]] = True
            self.skip_tokens(skip)  # the eager forward neither attends for them nor writes their KV
        return None

    def _run(self, metadata, input_ids, positions, rows: list[int], starts: list[int]) -> torch.Tensor:
        """The artifact for requests ``rows`` (one token each, at token index ``starts[r]``): logits [len, vocab]."""
        full = metadata[self.full_name]
        at = torch.tensor([starts[r] for r in rows], dtype=torch.long)
        index = torch.tensor(rows, dtype=torch.long)
        computed = positions.index_select(0, at)
        live = computed.long() // self.block_size + 1  # [R] each row's own blocks (columns [0, live))
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

    def skip_tokens(self, mask: torch.Tensor | None) -> None:
        """Tell every adopted attention layer which tokens of this forward an artifact already ran (None: none)."""
        for layer in self.layers:
            layer.impl.neffbuild_skip = mask

    def take_logits(self, hidden_states: torch.Tensor, eager=None) -> torch.Tensor | None:
        """The artifact's logits for the rows vLLM's runner picked, once; else None (vLLM's own logits).

        All-decode forward: ``hidden_states[:, 0]`` holds the row ids ``try_decode`` planted. Mixed forward:
        ``eager()`` computes vLLM's logits for every request's last token and the artifact's rows replace the
        one-token requests' (one logits row per request, in request order, as vLLM picks them without drafts)."""
        pending, mixed, self._pending, self._mixed = self._pending, self._mixed, None, None
        self.skip_tokens(None)
        if pending is not None:
            return pending.index_select(0, hidden_states[:, 0].long())
        if mixed is None or eager is None:
            return None
        rows, logits, num_reqs = mixed
        out = eager()
        if out.shape[0] != num_reqs:  # not the one-row-per-request pick this assumes: never serve a wrong row
            raise RuntimeError(f"neffbuild: vLLM asked for {out.shape[0]} logits rows of a forward of {num_reqs} "
                               "requests; the plugin maps one row per request")
        out[torch.tensor(rows, dtype=torch.long)] = logits.to(out.dtype)
        return out


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
