"""A bundle's pieces for a generation loop: the Stepper, the model's prefill, a block manager.

The architecture's parts (config, decode graph, prefill) come from ``neffbuild/registry.py``:
by the bundle's ``graph_inputs.arch``, or by the class of a config handed in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from neffbuild import registry
from neffbuild.runtime.blocks import FULL_GROUP, SLIDING_GROUP, BlockManager, kv_groups
from neffbuild.runtime.dispatch import Grid, StepPlan
from neffbuild.runtime.kv_cache import KVLayout
from neffbuild.runtime.parallel import ParallelLayout
from neffbuild.runtime.step import Stepper
from neffbuild.serve.eager import EagerArtifacts
from neffbuild.serve.greedy import Prefill


@dataclass
class Session:
    config: object  # the architecture's config dataclass
    stepper: Stepper
    prefill: Prefill
    lockstep_group: object | None = None  # sharded, MoE gathering across DP groups: prefill in lockstep over it

    def block_manager(self) -> BlockManager:
        """A fresh block manager over the stepper's pool, with the model's KV groups."""
        layout, cfg = self.stepper.kv_layout, self.config
        return BlockManager(layout.num_blocks, layout.block_size,
                            kv_groups(cfg.sliding_window if cfg.has_sliding_layers else None))


def eager_artifacts(cfg, weights: dict, grid: Grid, layout: KVLayout, num_swa: int) -> EagerArtifacts:
    """The eager graph on ``weights`` for every label (with aux outputs when the grid has EAGLE3 families)."""
    arch = registry.arch_of(cfg)
    aux = arch.get("aux_layers")(cfg.num_hidden_layers) if grid.num_speculative_tokens else None
    decode = arch.get("decode")(cfg, weights, packed_k=layout.packed_k, aux_layers=aux).eval()
    return EagerArtifacts(grid, layout, num_swa, decode)


def make_session(cfg, weights: dict, artifacts, *, group=None, on_plan: Callable[[StepPlan], None] | None = None,
                 parallel: ParallelLayout | None = None, rank: int = 0) -> Session:
    """A Session over any artifacts (a Bundle, or eager_artifacts) with the model's prefill on ``weights``.

    Sharded (``parallel``): ``weights`` are rank ``rank``'s shard and prefill runs the same
    collectives as the artifacts; ``group`` is the bundle's world (DP sync and lockstep prefill).
    """
    packed = artifacts.kv_layout.packed_k
    prefill = registry.arch_of(cfg).get("prefill")
    shard = {"parallel": parallel, "rank": rank} if parallel is not None else {}

    def run_prefill(prompt, kv_caches, rows, pad_to: int = 0):
        return prefill(cfg, weights, prompt, kv_caches, rows[FULL_GROUP], rows.get(SLIDING_GROUP, rows[FULL_GROUP]),
                       packed_k=packed, pad_to=pad_to, **shard)

    lockstep = group if parallel is not None and parallel.ep_gathers else None
    return Session(cfg, Stepper(artifacts, group=group, on_plan=on_plan), run_prefill, lockstep)


def open_session(bundle, *, reference: bool = False, group=None,
                 on_plan: Callable[[StepPlan], None] | None = None) -> Session:
    """A bundle's compiled artifacts (or, with ``reference``, the eager graph on its weights) for one rank.

    A sharded bundle (opened collectively) runs this rank's shard; DP sync uses its world group.
    """
    gi = bundle.manifest["graph_inputs"]
    cfg = registry.arch(gi["arch"]).get("config").from_hf_dict(gi["model_config"])
    artifacts, ctx = bundle, getattr(bundle, "context", None)
    if reference:
        if ctx is not None:
            raise ValueError("reference=True needs an unsharded bundle; compare a sharded one with "
                             "neffbuild.cli.generate_cmd.run_reference (the joined weights)")
        artifacts = eager_artifacts(cfg, bundle.weights, bundle.grid, bundle.kv_layout, bundle.num_swa)
    if ctx is None:
        return make_session(cfg, bundle.weights, artifacts, group=group, on_plan=on_plan)
    return make_session(cfg, bundle.weights, artifacts, group=bundle.group, on_plan=on_plan, parallel=ctx.layout,
                        rank=ctx.rank)
