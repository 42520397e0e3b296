"""The GPT-OSS class the plugin registers for vLLM's ``GptOssForCausalLM`` architecture.

Without ``additional_config["neffbuild"]`` it is vLLM's own GptOssForCausalLM, untouched. With a bundle:

1. before anything is built, the bundle is opened by the runtime's one judge (its signature verified when
   trusted keys are given) and checked against vLLM's final configuration (neffbuild/vllm/startup.py; the same
   check already ran when vLLM built its configuration, before any engine process started): any mismatch
   fails vLLM's start-up naming each vLLM flag and both values;
2. none of vLLM's GPT-OSS layers is built: only one vLLM ``Attention`` per decoder layer, so vLLM's KV cache
   manager allocates and groups the KV tensors (sliding and full layers, one tensor per layer pair) and
   hands each forward its block tables. vLLM is started on the bundle folder itself (its ``config.json``) with
   ``--load-format dummy``: there is no checkpoint to read, and no weight but the bundle's memory-mapped
   copy, which the artifacts and the eager prefill share;
3. ``forward`` sends every one-token row through one artifact and every longer row (a prompt, a chunk) through
   the bundle's own eager prefill (neffbuild/vllm/decode.py), both on vLLM's KV tensors in the bundle's layout
   (neffbuild/vllm/kv.py); ``compute_logits`` hands vLLM's sampler their logits.

Why the bundle's eager prefill and not vLLM's eager model on views of the bundle's weights: vLLM's CPU MXFP4
experts need AMX (on other CPUs it cannot serve an MXFP4 checkpoint at all); the bundle's prefill is the one
implementation of its KV layout for every KV dtype (packed FP8 included) that the artifacts read; and a
prompt then gives the tokens ``neffbuild generate`` gives on the same bundle (docs/architecture.md).
Scheduling, batching, preemption, abort, sampling and the block manager stay vLLM's (docs/vllm.md).
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.models.gpt_oss import GptOssForCausalLM
from vllm.v1.attention.backend import AttentionType

from neffbuild.errors import IncompatibleBundle
from neffbuild.vllm import kv, startup
from neffbuild.vllm.config import from_additional_config
from neffbuild.vllm.decode import BundleDecoder, register

logger = init_logger(__name__)


class NeffbuildGptOssForCausalLM(GptOssForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = ""):
        self.neffbuild: BundleDecoder | None = None
        settings = from_additional_config(vllm_config.additional_config)
        if settings is None:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            return
        bundle = startup.check(vllm_config)
        kv.allow_fp8_kv_without_avx512()  # vLLM's own FP8 attention kernel never runs for the bundle's layers
        nn.Module.__init__(self)  # not GptOssForCausalLM's: no layer of vLLM's, no weight but the bundle's
        self.vllm_config, self.config = vllm_config, vllm_config.model_config.hf_config
        self.attention = nn.ModuleList(_attention_layers(bundle.facts, vllm_config, prefix))
        self.neffbuild = BundleDecoder(bundle, list(self.attention), bundle.facts.hidden_size)
        register(settings.bundle, self.neffbuild)  # the EAGLE3 draft model finds it (neffbuild/vllm/draft.py)
        if vllm_config.speculative_config is not None:  # vLLM's drafter looks for the target's embedding to share
            self.model = _NoEmbedding()
        logger.info("neffbuild: serving from %s (%d artifacts; weights %s, experts %s, KV %s)", settings.bundle,
                    len(bundle.labels), bundle.facts.weights_dtype, bundle.facts.experts, bundle.facts.kv_dtype)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        if self.neffbuild is not None:
            return self.neffbuild.forward(input_ids, positions)
        return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states):
        if self.neffbuild is not None:
            return self.neffbuild.take_logits(hidden_states)
        return super().compute_logits(hidden_states)

    # -- EAGLE3 (vLLM's SupportsEagle3): the aux states the forward returns are the bundle's aux layers
    def get_eagle3_default_aux_hidden_state_layers(self) -> tuple[int, ...]:
        if self.neffbuild is not None:
            return startup.vllm_aux_layers(self.neffbuild.bundle.facts)
        return super().get_eagle3_default_aux_hidden_state_layers()

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        if self.neffbuild is None:
            return super().set_aux_hidden_state_layers(layers)
        compiled = startup.vllm_aux_layers(self.neffbuild.bundle.facts)
        if tuple(layers) != compiled:
            raise IncompatibleBundle(
                f"--speculative-config: vLLM's EAGLE3 drafter reads aux layer ids {list(layers)}, the bundle's "
                f"target graphs return {list(compiled)}; serve the bundle's draft/ folder")
        self.neffbuild.aux_layers = self.neffbuild.bundle.facts.aux_layers

    def load_weights(self, weights):
        if self.neffbuild is not None:
            return set()  # the bundle's weights are bound already (vLLM runs with --load-format dummy)
        return super().load_weights(weights)

    def neffbuild_report(self) -> dict:
        """The plugin's counts and KV storage (``report`` below; the tests and the benchmark read it)."""
        dec = self.neffbuild
        if dec is None:
            return {"enabled": False}
        stepper = dec.stepper
        return {"enabled": True, **dec.metrics.snapshot(),
                "vllm_kv_ptrs": [layer.kv_cache.data_ptr() if hasattr(layer.kv_cache, "data_ptr")
                                 else layer.kv_cache[0].data_ptr() for layer in dec.layers],
                "stepper_kv_ptrs": [b.data_ptr() for b in stepper.kv_caches] if stepper is not None else [],
                "kv_shapes": [list(b.shape) for b in stepper.kv_caches] if stepper is not None else []}


class _NoEmbedding(nn.Module):
    """What vLLM's drafter finds as the target's embedding: no weight, so the draft keeps its own."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Module()
        self.embedding.weight = None


def _attention_layers(facts, vllm_config, prefix: str) -> list[Attention]:
    """One vLLM Attention per decoder layer, named as vLLM's GPT-OSS names them, sliding where the bundle's layer
    is: what vLLM's KV cache manager allocates and groups by. Their forward never runs."""
    cfg, tp = facts.config, facts.parallel.tp
    heads, kv_heads = cfg.num_attention_heads // tp, len(facts.kv_heads)
    base = f"{prefix}.model" if prefix else "model"
    return [Attention(heads, cfg.head_dim, cfg.head_dim ** -0.5, num_kv_heads=kv_heads,
                      cache_config=vllm_config.cache_config, quant_config=None,
                      per_layer_sliding_window=cfg.sliding_window if kind == cfg.SLIDING else None,
                      attn_type=AttentionType.DECODER, prefix=f"{base}.layers.{i}.attn.attn",
                      sinks=torch.zeros(heads))
            for i, kind in enumerate(cfg.layer_types)]


def report(model) -> dict | None:
    """The plugin's report from the model in vLLM's worker, None for a model that is not the plugin's."""
    return model.neffbuild_report() if isinstance(model, NeffbuildGptOssForCausalLM) else None


def worker_report(llm) -> dict | None:
    """The plugin's report from a ``vllm.LLM``'s worker (``report`` through ``LLM.apply_model``: vLLM pickles the
    function by reference, so the LLM's process needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``); None when the
    engine's model is not the plugin's."""
    return llm.apply_model(report)[0]


class WorkerReport:
    """A vLLM worker extension with the same report for a running server: ``vllm serve ...
    --worker-extension-cls neffbuild.vllm.model.WorkerReport``, then (vLLM's dev mode, ``VLLM_SERVER_DEV_MODE=1``)
    ``POST /collective_rpc {"method": "neffbuild_report"}`` answers ``{"results": [report]}``, one per worker."""

    def neffbuild_report(self) -> dict | None:
        return report(self.get_model())
