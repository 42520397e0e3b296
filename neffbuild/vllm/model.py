"""The GPT-OSS class the plugin registers for vLLM's ``GptOssForCausalLM`` architecture.

Without ``additional_config["neffbuild"]`` it is vLLM's own GptOssForCausalLM, untouched. With a bundle:

1. before any layer is built, the bundle is opened (its signature verified when trusted keys are given) and
   checked against vLLM's configuration (neffbuild/vllm/checks.py): any mismatch fails vLLM's start-up with
   one error naming each vLLM flag and both values;
2. vLLM's model is built as usual, and every attention layer's implementation reads the KV tensors in the
   bundle's layout (neffbuild/vllm/attention.py): prefill, chunks and mixed batches stay vLLM's eager model;
3. ``forward`` runs a forward whose requests are all in decode through one artifact (neffbuild/vllm/decode.py)
   and ``compute_logits`` hands vLLM's sampler the artifact's logits.

Why a model class and not a model-runner or platform plugin: the model is the one place vLLM hands both the
step's inputs (ids, positions) and, in its forward context, every layer's metadata (block tables per KV group,
sequence lengths) and KV tensors, and whose outputs (logits) its sampler consumes. Scheduling, batching,
preemption, abort and the block manager stay vLLM's (docs/vllm.md).
"""

from __future__ import annotations

from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.models.gpt_oss import GptOssForCausalLM

from neffbuild.errors import IncompatibleBundle
from neffbuild.runtime import open_bundle
from neffbuild.vllm import checks
from neffbuild.vllm.attention import adopt
from neffbuild.vllm.config import from_additional_config
from neffbuild.vllm.decode import BundleDecoder

logger = init_logger(__name__)


class NeffbuildGptOssForCausalLM(GptOssForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = ""):
        settings = from_additional_config(vllm_config.additional_config)
        bundle = _open_checked(settings, vllm_config) if settings is not None else None
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.neffbuild: BundleDecoder | None = None
        if bundle is None:
            return
        layers = [m for m in self.modules() if isinstance(m, Attention)]
        adopt(layers)
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
            logits = self.neffbuild.take_logits(hidden_states)
            if logits is not None:
                return logits
        return super().compute_logits(hidden_states)

    def neffbuild_report(self) -> dict:
        """The plugin's counts and KV storage (for ``LLM.apply_model``; tests read it)."""
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
    """``LLM.apply_model(report)``: the plugin's report from the worker (a module-level function: vLLM pickles it
    by reference), None for a model that is not the plugin's."""
    return model.neffbuild_report() if isinstance(model, NeffbuildGptOssForCausalLM) else None


def engine_view(vllm_config) -> checks.Engine:
    mc, cc, sc, pc = (vllm_config.model_config, vllm_config.cache_config, vllm_config.scheduler_config,
                      vllm_config.parallel_config)
    spec = vllm_config.speculative_config
    return checks.Engine(
        model_config=mc.hf_config.to_dict(), dtype=str(mc.dtype).removeprefix("torch."),
        max_model_len=mc.max_model_len, block_size=cc.block_size, num_gpu_blocks_override=cc.num_gpu_blocks_override,
        max_num_seqs=sc.max_num_seqs, kv_cache_dtype=str(cc.cache_dtype),
        tensor_parallel_size=pc.tensor_parallel_size, pipeline_parallel_size=pc.pipeline_parallel_size,
        data_parallel_size=pc.data_parallel_size,
        num_speculative_tokens=(spec.num_speculative_tokens or 0) if spec is not None else 0)


def compiled_view(bundle) -> checks.Compiled:
    gi, kv, grid = bundle.graph_inputs, bundle.kv_layout, bundle.grid
    return checks.Compiled(
        model_config=dict(gi.model_config), max_model_len=grid.max_model_len, block_size=kv.block_size,
        num_blocks=kv.num_blocks, num_seqs_buckets=tuple(grid.num_seqs_buckets), fp8=kv.fp8, tp=bundle.parallel.tp,
        dp=bundle.parallel.dp, num_speculative_tokens=grid.num_speculative_tokens)


def _open_checked(settings, vllm_config):
    bundle = open_bundle(settings.bundle, verify=settings.verify, trusted_keys=settings.trusted_keys)
    if bundle.graph_inputs.arch != "gpt_oss":
        raise IncompatibleBundle(f"neffbuild: bundle {settings.bundle} is of architecture "
                                 f"{bundle.graph_inputs.arch!r}; vLLM is serving GptOssForCausalLM")
    found = checks.problems(compiled_view(bundle), engine_view(vllm_config))
    if found:
        raise IncompatibleBundle(f"neffbuild: bundle {settings.bundle} does not fit this vLLM configuration "
                                 "(nothing will serve):\n  " + "\n  ".join(found))
    return bundle
