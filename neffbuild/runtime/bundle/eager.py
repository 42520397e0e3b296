"""The eager forward a host engine runs beside the artifacts: the architecture's prefill over the bundle's own
weights, so a prompt (or a chunk of one) writes exactly the KV layout the artifacts read, with the weights the
artifacts bind (one copy in the process, memory-mapped), for every weight form and KV dtype the bundle holds.

``prefill_on`` builds the callable once for a config, a weight dict and a rank; ``Bundle.prefill`` is the same
over an opened bundle (the vLLM plugin's prefill and chunks, neffbuild's own engine's prompts). The
architecture's part comes from the registry (``prefill``), as the config does: the runtime names no model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from neffbuild import registry
from neffbuild.runtime.kv.blocks import FULL_GROUP, SLIDING_GROUP
from neffbuild.runtime.parallel import ParallelLayout

# prompt (or chunk) ids, KV buffers, {group: block row [W]}, then keywords: start (positions already cached),
# logits ("all" | "last" | "none"), aux_layers, pad_to -> logits (and aux states with aux_layers)
Prefill = Callable[..., object]


def prefill_on(cfg, weights: dict, packed_k: bool, parallel: ParallelLayout | None = None, rank: int = 0) -> Prefill:
    """The architecture's eager prefill on ``weights`` (a rank's shard when ``parallel`` is sharded)."""
    run = registry.arch_of(cfg).get("prefill")
    shard = {"parallel": parallel, "rank": rank} if parallel is not None and parallel.sharded else {}

    def prefill(prompt: Sequence[int] | torch.Tensor, kv_caches: list, rows: dict, *, start: int = 0,
                pad_to: int = 0, aux_layers: tuple[int, ...] = (), logits: str = "all"):
        return run(cfg, weights, prompt, kv_caches, rows[FULL_GROUP], rows.get(SLIDING_GROUP, rows[FULL_GROUP]),
                   packed_k=packed_k, pad_to=pad_to, aux_layers=aux_layers, logits=logits, start=start, **shard)

    return prefill
