"""The eager forward a host engine runs beside the artifacts: the architecture's prefill over the bundle's own
weights, so a prompt (or a chunk of one) writes exactly the KV layout the artifacts read, with the weights the
artifacts bind (one copy in the process, memory-mapped), for every weight form and KV dtype the bundle holds.

``prefill_on`` builds the callable once for a config, a weight dict and a rank (MXFP4 experts run the native C
loop there, ``native.eager_experts``; eager decode stays plain torch); ``Bundle.prefill`` is the same
over an opened bundle (the vLLM plugin's prefill and chunks, neffbuild's own engine's prompts). The
architecture's part comes from the registry (``prefill``), as the config does: the runtime names no model.
``draft_prefill_on`` is the speculative method's prompt catch-up (EAGLE3: the draft's KV over a prompt's
positions from the target's aux states), from the method's registry entry: ``Bundle.draft_prefill``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from neffbuild import registry
from neffbuild.runtime import native
from neffbuild.runtime.kv.blocks import FULL_GROUP, SLIDING_GROUP
from neffbuild.runtime.parallel import ParallelLayout, rank_tensor

# prompt (or chunk) ids, KV buffers, {group: block row [W]}, then keywords: start (positions already cached),
# logits ("all" | "last" | "none"), aux_layers, pad_to -> logits (and aux states with aux_layers)
Prefill = Callable[..., object]


def prefill_on(cfg, weights: dict, packed_k: bool, parallel: ParallelLayout | None = None, rank: int = 0) -> Prefill:
    """The architecture's eager prefill on ``weights`` (a rank's shard when ``parallel`` is sharded)."""
    run = registry.arch_of(cfg).get("prefill")
    shard = {"parallel": parallel, "rank": rank} if parallel is not None and parallel.sharded else {}

    def prefill(prompt: Sequence[int] | torch.Tensor, kv_caches: list, rows: dict, *, start: int = 0,
                pad_to: int = 0, aux_layers: tuple[int, ...] = (), logits: str = "all"):
        with native.eager_experts():  # packed experts through the C loop where it is built (kernels/moe.py)
            return run(cfg, weights, prompt, kv_caches, rows[FULL_GROUP], rows.get(SLIDING_GROUP, rows[FULL_GROUP]),
                       packed_k=packed_k, pad_to=pad_to, aux_layers=aux_layers, logits=logits, start=start, **shard)

    return prefill


def draft_prefill_on(method: str, draft_cfg, weights: dict, num_speculative_tokens: int, packed_k: bool,
                     parallel: ParallelLayout | None = None, rank: int = 0) -> Callable[..., None]:
    """The method's eager draft catch-up over a prompt on the bundle's draft weights:
    ``(tokens [n], aux [n, A], draft KV buffer, full-attention block row)`` -> the draft's KV at positions 0..n-1."""
    entry = registry.speculative(method)
    draft = entry.get("draft")(draft_cfg, weights, num_speculative_tokens=num_speculative_tokens, packed_k=packed_k,
                               parallel=parallel).eval()
    run = entry.get("prefill")
    rank_input = rank_tensor(rank) if parallel is not None and parallel.sharded else None

    def draft_prefill(tokens, aux: torch.Tensor, kv_cache: torch.Tensor, block_row: torch.Tensor) -> None:
        run(draft, torch.as_tensor(tokens, dtype=torch.long), aux, kv_cache, block_row, rank_input)

    return draft_prefill
