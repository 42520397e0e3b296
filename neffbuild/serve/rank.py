"""``open_rank``: the one way to open a bundle for one serving rank.

A serving rank of neffbuild's own engine holds, of a bundle: the model config (the bundle's typed
facts, ``runtime.bundle.facts``: the runtime's one judge, ``reader.check``, already refused a
broken one, exit 1), its weights (the pieces its rank maps, or every piece joined, and re-split
for another TP degree), its KV layout and buffers, the model's prefill on those weights, a block
manager over its pool, and what runs a decode step: the compiled artifacts, the eager graph (the
``--check`` reference) or nothing (a DI prefill rank). The engine (serve/run.py), the DI prefill
worker and ``generate --check`` open a bundle through ``open_rank``; ``serving_rank`` composes the
same parts over artifacts a test builds by hand. Another host engine (the vLLM plugin) opens the
bundle with the runtime's ``open_bundle`` and reads the same facts: nothing here is for it.
The architecture's parts come from ``neffbuild/registry.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from neffbuild import registry
from neffbuild.runtime.bundle import reader
from neffbuild.runtime.bundle.eager import Prefill, prefill_on
from neffbuild.runtime.bundle.facts import BundleFacts
from neffbuild.runtime.bundle.graph_inputs import GraphInputs
from neffbuild.runtime.kv.blocks import BlockManager, kv_groups
from neffbuild.runtime.kv.cache import KVLayout, allocate
from neffbuild.runtime.parallel import ParallelLayout
from neffbuild.runtime.step.dispatch import Grid, StepPlan
from neffbuild.runtime.step.stepper import Stepper
from neffbuild.serve.eager import EagerArtifacts

COMPILED, EAGER, PREFILL_ONLY = "compiled", "eager", "prefill"  # what runs a decode step (open_rank's ``decode``)


@dataclass
class ServingRank:
    """What one serving rank holds of a bundle (``open_rank``), or of hand-built artifacts (``serving_rank``)."""

    config: object  # the architecture's config dataclass
    weights: dict  # this rank's tensors (its shard when ``parallel`` is sharded)
    kv_layout: KVLayout  # this rank's KV buffers (its heads)
    kv_caches: list  # the KV buffers (the stepper's when there is one)
    prefill: Prefill
    stepper: Stepper | None = None  # None: a prefill rank (no decode)
    parallel: ParallelLayout = field(default_factory=ParallelLayout)  # the layout ``weights`` are a shard of
    rank: int = 0  # this rank in ``parallel``'s world
    lockstep_group: object | None = None  # sharded, MoE gathering across DP groups: prefill in lockstep over it
    graph_inputs: GraphInputs | None = None  # the manifest's (None: hand-built artifacts)
    bundle: reader.Bundle | None = None  # the opened bundle (compiled decode only)
    facts: BundleFacts | None = None  # the bundle's typed facts (None: hand-built artifacts)

    def block_manager(self) -> BlockManager:
        """A fresh block manager over this rank's pool, with the model's KV groups."""
        cfg = self.config
        return BlockManager(self.kv_layout.num_blocks, self.kv_layout.block_size,
                            kv_groups(cfg.sliding_window if cfg.has_sliding_layers else None))

    @property
    def kv_heads(self) -> range:
        """The model KV heads this rank holds (its TP slice; all of them unsharded)."""
        if self.bundle is not None:
            return self.bundle.facts.kv_heads  # as the bundle records them for its ranks
        if self.parallel.tp == 1:  # joined weights, re-split for a TP degree of the caller's (a DI prefill rank)
            return range(self.config.num_key_value_heads)
        return registry.arch_of(self.config).get("kv_heads_of")(self.config, self.parallel,
                                                                self.parallel.tp_rank(self.rank))

    def draft_config(self):
        """The bundle's draft config (its speculative method's, through the registry), or None without drafts."""
        return self.graph_inputs.draft(self.config) if self.graph_inputs is not None else None


def eager_artifacts(cfg, weights: dict, grid: Grid, layout: KVLayout, num_swa: int,
                    aux_layers: tuple[int, ...] = ()) -> EagerArtifacts:
    """The eager graph on ``weights`` for every label (with aux outputs when the grid has EAGLE3 families: the
    draft's ``aux_layers``, the architecture's default ids when none are given)."""
    arch = registry.arch_of(cfg)
    aux = (aux_layers or arch.get("aux_layers")(cfg.num_hidden_layers)) if grid.num_speculative_tokens else None
    decode = arch.get("decode")(cfg, weights, packed_k=layout.packed_k, aux_layers=aux).eval()
    return EagerArtifacts(grid, layout, num_swa, decode)


def serving_rank(cfg, weights: dict, artifacts, *, group=None, on_plan: Callable[[StepPlan], None] | None = None,
                 parallel: ParallelLayout | None = None, rank: int = 0) -> ServingRank:
    """A ServingRank over any artifacts (a Bundle, or eager_artifacts) with the model's prefill on ``weights``.

    Sharded (``parallel``): ``weights`` are rank ``rank``'s shard and prefill runs the same
    collectives as the artifacts; ``group`` is the bundle's world (DP sync and lockstep prefill).
    """
    par = parallel or ParallelLayout()
    stepper = Stepper(artifacts, group=group, on_plan=on_plan)
    return ServingRank(cfg, weights, artifacts.kv_layout, stepper.kv_caches,
                       prefill_on(cfg, weights, artifacts.kv_layout.packed_k, par, rank), stepper, par, rank,
                       group if par.ep_gathers else None)


def _joined_weights(root: Path, facts: BundleFacts) -> dict:
    """Every tensor of the model, unsharded: a sharded bundle's pieces joined by the architecture's rule (and the
    EAGLE3 draft's by its method's)."""
    weights, pieces = reader.weight_pieces(root)
    if not pieces:
        return weights
    parts = dict(pieces, shared=weights)
    out = registry.arch(facts.arch).get("unshard")(facts.config, parts, facts.parallel)
    if facts.draft_config is not None:
        out.update(registry.speculative(facts.speculative_method).get("unshard")(facts.draft_config, parts,
                                                                                  facts.parallel))
    return out


def _open_compiled(bundle: reader.Bundle, group, on_plan) -> ServingRank:
    gi, ctx = bundle.graph_inputs, bundle.context
    cfg = bundle.facts.config
    par, rank = (ctx.parallel, ctx.rank) if ctx is not None else (ParallelLayout(), 0)
    out = serving_rank(cfg, bundle.weights, bundle, group=bundle.group if ctx is not None else group,
                       on_plan=on_plan, parallel=par, rank=rank)
    out.graph_inputs, out.bundle, out.facts = gi, bundle, bundle.facts
    return out


def _open_joined(root: Path, decode: str, tp: int, rank: int) -> ServingRank:
    facts = reader.read_facts(root)
    gi, cfg = facts.graph_inputs, facts.config
    weights, par = _joined_weights(root, facts), ParallelLayout(tp=tp)
    if tp > 1:  # re-split for this group's TP degree by the architecture's rule
        weights = registry.arch(gi.arch).get("shard")(cfg, weights, par, rank)
    # Every KV head, then this rank's share; no draft group: no proposer runs on joined weights.
    layout = replace(gi.kv_layout, kv_heads=cfg.num_key_value_heads, draft_kv_heads=0, draft_head_dim=0)
    out = ServingRank(cfg, weights, layout, [], prefill_on(cfg, weights, layout.packed_k, par, rank),
                      parallel=par, rank=rank, graph_inputs=gi, facts=facts)
    out.kv_layout = replace(layout, kv_heads=len(out.kv_heads))
    if decode == EAGER:
        stepper = Stepper(eager_artifacts(cfg, weights, gi.grid, out.kv_layout, gi.num_swa, facts.aux_layers))
        out.stepper, out.kv_caches = stepper, stepper.kv_caches
    else:
        out.kv_caches = allocate(out.kv_layout)
    return out


def open_rank(bundle: str | Path | reader.Bundle, *, decode: str = COMPILED, tp: int = 1, rank: int = 0,
              group=None, on_plan: Callable[[StepPlan], None] | None = None) -> ServingRank:
    """Open ``bundle`` (a path, or an opened ``Bundle`` for compiled decode) for one serving rank.

    ``decode``: ``"compiled"`` (default) runs the bundle's artifacts on the pieces this rank
    maps; a sharded bundle is opened collectively by every rank of its world (``group``, as
    ``open_bundle``), and DP sync of an unsharded one runs over ``group``. ``"eager"`` runs the
    eager graph on every piece joined (the unsharded ``--check`` reference). ``"prefill"`` runs
    no decode: the weights joined and re-split for ``tp`` ranks, rank ``rank``'s shard and KV
    heads (a DI prefill rank). ``on_plan``: the stepper's hook (e.g. the needed_seq histogram).
    """
    if decode == COMPILED:
        if not isinstance(bundle, reader.Bundle):
            bundle = reader.open_bundle(bundle, group=group)
        return _open_compiled(bundle, group, on_plan)
    if decode not in (EAGER, PREFILL_ONLY):
        raise ValueError(f"decode must be {COMPILED!r}, {EAGER!r} or {PREFILL_ONLY!r}, got {decode!r}")
    if decode == EAGER and tp != 1:
        raise ValueError("decode='eager' is the unsharded reference: tp must be 1")
    return _open_joined(Path(bundle.root if isinstance(bundle, reader.Bundle) else bundle), decode, tp, rank)
