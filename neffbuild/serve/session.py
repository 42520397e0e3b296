"""A bundle's pieces for a generation loop: the Stepper, the model's prefill, a block manager.

The one place in serve/ that names the architecture (GPT-OSS today; the architecture
registry will pick these once it exists).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from neffbuild.models.gpt_oss.config import GptOssConfig
from neffbuild.models.gpt_oss.decode import GptOssDecode, default_aux_layers
from neffbuild.models.gpt_oss.prefill import prefill
from neffbuild.runtime.blocks import FULL_GROUP, SLIDING_GROUP, BlockManager, kv_groups
from neffbuild.runtime.dispatch import GridSpec, StepPlan
from neffbuild.runtime.kv_cache import KVLayout
from neffbuild.runtime.step import Stepper
from neffbuild.serve.eager import EagerArtifacts
from neffbuild.serve.greedy import Prefill


@dataclass
class Session:
    config: GptOssConfig
    stepper: Stepper
    prefill: Prefill

    def block_manager(self) -> BlockManager:
        """A fresh block manager over the stepper's pool, with the model's KV groups."""
        layout, cfg = self.stepper.layout, self.config
        return BlockManager(layout.num_blocks, layout.block_size,
                            kv_groups(cfg.sliding_window if cfg.has_sliding_layers else None))


def eager_artifacts(cfg: GptOssConfig, weights: dict, spec: GridSpec, layout: KVLayout, num_swa: int) -> EagerArtifacts:
    """The eager graph on ``weights`` for every label (with aux outputs when the grid has EAGLE3 families)."""
    aux = default_aux_layers(cfg.num_hidden_layers) if spec.num_speculative_tokens else None
    return EagerArtifacts(spec, layout, num_swa, GptOssDecode(cfg, weights, packed_k=layout.packed_k, aux_layers=aux).eval())


def make_session(cfg: GptOssConfig, weights: dict, artifacts, *, group=None,
                 on_plan: Callable[[StepPlan], None] | None = None) -> Session:
    """A Session over any artifacts (a Bundle, or eager_artifacts) with the model's prefill on ``weights``."""
    packed = artifacts.kv_layout.packed_k

    def run_prefill(prompt, kv_caches, rows):
        return prefill(cfg, weights, prompt, kv_caches, rows[FULL_GROUP], rows.get(SLIDING_GROUP, rows[FULL_GROUP]),
                       packed_k=packed)

    return Session(cfg, Stepper(artifacts, group=group, on_plan=on_plan), run_prefill)


def open_session(bundle, *, reference: bool = False, group=None,
                 on_plan: Callable[[StepPlan], None] | None = None) -> Session:
    """A bundle's compiled artifacts (or, with ``reference``, the eager graph on its weights) for one rank."""
    cfg = GptOssConfig.from_hf_dict(bundle.manifest["graph_inputs"]["model_config"])
    artifacts = bundle
    if reference:
        artifacts = eager_artifacts(cfg, bundle.weights, bundle.spec, bundle.kv_layout, bundle.num_swa)
    return make_session(cfg, bundle.weights, artifacts, group=group, on_plan=on_plan)
