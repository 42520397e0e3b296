"""The GPT-OSS class the plugin registers for vLLM's ``GptOssForCausalLM`` architecture.

Without ``additional_config["neffbuild"]`` it is vLLM's own GptOssForCausalLM, untouched. With a bundle:

1. before any layer is built, the bundle is opened (its signature verified when trusted keys are given) and
   checked against vLLM's final configuration (neffbuild/vllm/startup.py; the same check already ran when vLLM
   built its configuration, before any engine process started): any mismatch fails vLLM's start-up with one
   error naming each vLLM flag and both values;
2. vLLM's model is built as usual, and every attention layer's implementation reads the KV tensors in the
   bundle's layout (neffbuild/vllm/attention.py): prefill, chunks and mixed batches stay vLLM's eager model;
3. ``forward`` runs a forward whose requests are all in decode through one artifact, and the one-token rows
   of a forward that mixes them with prefill chunks through the artifact of their own batch bucket while
   vLLM's eager model runs the chunks (neffbuild/vllm/decode.py); ``compute_logits`` hands vLLM's sampler the
   artifact's logits for those rows.

Why a model class and not a model-runner or platform plugin: the model is the one place vLLM hands both the
step's inputs (ids, positions) and, in its forward context, every layer's metadata (block tables per KV group,
sequence lengths) and KV tensors, and whose outputs (logits) its sampler consumes. Scheduling, batching,
preemption, abort and the block manager stay vLLM's (docs/vllm.md).
"""

from __future__ import annotations

from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.models.gpt_oss import GptOssForCausalLM

from neffbuild.vllm import startup
from neffbuild.vllm.attention import adopt
from neffbuild.vllm.config import from_additional_config
from neffbuild.vllm.decode import BundleDecoder

logger = init_logger(__name__)


class NeffbuildGptOssForCausalLM(GptOssForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = ""):
        settings = from_additional_config(vllm_config.additional_config)
        bundle = startup.check(vllm_config) if settings is not None else None
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.neffbuild: BundleDecoder | None = None
        if bundle is None:
            return
        layers = [m for m in self.modules() if isinstance(m, Attention)]
        adopt(layers, bundle.facts.fp8_packed_kv)
        self.neffbuild = BundleDecoder(bundle, layers, self.config.hidden_size)
        logger.info("neffbuild: serving decode steps from %s (%d artifacts)", settings.bundle, len(bundle.labels))

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        if self.neffbuild is not None and inputs_embeds is None:
            hidden = self.neffbuild.try_decode(input_ids, positions)
            if hidden is not None:
                return hidden
        return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states):
        if self.neffbuild is not None:
            logits = self.neffbuild.take_logits(hidden_states, lambda: super(
                NeffbuildGptOssForCausalLM, self).compute_logits(hidden_states))
            if logits is not None:
                return logits
        return super().compute_logits(hidden_states)

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
