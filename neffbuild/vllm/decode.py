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
        self._pending: torch.Tensor | None = None

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
        """The artifact's stand-in hidden states for an all-decode forward, else None (vLLM's model runs)."""
        metadata = get_forward_context().attn_metadata
        if not isinstance(metadata, dict) or self.full_name not in metadata or input_ids is None:
            return None  # vLLM's profile and warm-up runs
        full = metadata[self.full_name]
        R = int(full.num_actual_tokens)
        if full.max_query_len != 1:
            decode_rows = sum(1 for a, b in itertools.pairwise(full.query_start_loc.tolist()) if b - a == 1)
            self.metrics.forward("mixed" if decode_rows else "prefill")
            self.metrics.decode_rows("eager", decode_rows)
            return None
        if self.stepper is None and not _bound(self.layers[0].kv_cache):
            return None  # a dummy run before vLLM bound its KV tensors (profiling): vLLM's model runs it
        start = time.perf_counter()
        self.metrics.forward("decode")
        computed = positions[:R].tolist()
        live = positions[:R].long() // self.block_size + 1  # [R] each row's own blocks (columns [0, live))
        width = max(computed) // self.block_size + 1
        beyond = torch.arange(width) >= live[:, None]  # [R, width]: the columns past each row's blocks
        tables = {FULL_GROUP: _table(full.block_table, R, width, beyond)}
        if self.sliding_name is not None:
            tables[SLIDING_GROUP] = _table(metadata[self.sliding_name].block_table, R, width, beyond)
        batch = StepBatch(tokens=[[t] for t in input_ids[:R].tolist()], num_computed=computed, block_tables=tables)
        stepper = self._stepper()
        plan = stepper.plan(batch)
        ran = time.perf_counter()
        out = stepper.run(plan, batch)
        ran = time.perf_counter() - ran
        self.metrics.artifact(out.plan.label, out.plan.needed_seq)
        self.metrics.decode_rows("artifact", R)
        self._pending = out.logits[:, 0]  # [R, vocab]
        hidden = torch.zeros(input_ids.shape[0], self.hidden_size, dtype=out.logits.dtype)
        hidden[:R, 0] = torch.arange(R, dtype=hidden.dtype)  # row ids: compute_logits maps vLLM's picks back
        self.metrics.seconds("run", ran)  # Stepper.run: inputs + the artifact
        self.metrics.seconds("forward", time.perf_counter() - start)  # the whole decode forward of the plugin
        return hidden

    def take_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """The artifact's logits for the rows vLLM's runner picked (its logits indices), once; else None."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        return pending.index_select(0, hidden_states[:, 0].long())


def _table(table: torch.Tensor, R: int, width: int, beyond: torch.Tensor) -> torch.Tensor:
    """vLLM's rows cut to the columns this step can touch, columns past each row's live blocks nulled.

    vLLM's persistent block table keeps ids of earlier requests past a row's own blocks; the artifact reads
    whole head-trimmed rows (masked by position), so the step's view holds the row's own blocks only. A copy:
    vLLM's table is left as it is (the Stepper's checks then range-check every id it holds).
    """
    return table[:R, :width].long().masked_fill(beyond, 0)  # a new tensor (0: the null block)


def _bound(kv_cache) -> bool:
    t = _tensor(kv_cache) if isinstance(kv_cache, (list, tuple)) and kv_cache else kv_cache
    return isinstance(t, torch.Tensor) and t.numel() > 0


def _tensor(kv_cache) -> torch.Tensor:
    return kv_cache[0] if isinstance(kv_cache, (list, tuple)) else kv_cache
