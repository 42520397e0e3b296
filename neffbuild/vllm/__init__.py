"""neffbuild's vLLM plugin: vLLM serves a bundle, every plain decode step through the bundle's artifacts.

    vllm serve CHECKPOINT --dtype float32 --enforce-eager --max-model-len 512 --block-size 32 \\
        --num-gpu-blocks-override 128 --max-num-seqs 4 \\
        --additional-config '{"neffbuild": {"bundle": "artifacts/NAME-VERSION"}}'

(``neffbuild inspect BUNDLE --vllm-config`` prints this line for a bundle; docs/vllm.md.) vLLM loads
``register`` in every process through the ``vllm.general_plugins`` entry point. It registers this package's
GPT-OSS class for the ``GptOssForCausalLM`` architecture; without a ``neffbuild`` key in vLLM's
``additional_config`` that class is vLLM's own model, unchanged (neffbuild/vllm/model.py). It also chains the
bundle's start-up check behind vLLM's GPT-OSS config hook, so a bundle that does not fit stops vLLM while it
builds its configuration, before any engine process starts (neffbuild/vllm/startup.py).

Layering: this package may import the runtime and the base modules; nothing in neffbuild imports it.
"""

from __future__ import annotations

ARCHITECTURE = "GptOssForCausalLM"
MODEL_CLASS = "neffbuild.vllm.model:NeffbuildGptOssForCausalLM"
# The EAGLE3 draft folder a bundle carries names this architecture (vLLM's Llama EAGLE3 head): with a bundle the
# plugin's class runs the bundle's draft artifacts, without one it is vLLM's own (neffbuild/vllm/draft.py).
DRAFT_ARCHITECTURE = "LlamaForCausalLMEagle3"
DRAFT_CLASS = "neffbuild.vllm.draft:NeffbuildEagle3ForCausalLM"


def register() -> None:
    """vLLM's general-plugin hook (every process, possibly more than once): the lazy model registration."""
    from vllm import ModelRegistry

    from neffbuild.vllm import startup

    ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
    ModelRegistry.register_model(DRAFT_ARCHITECTURE, DRAFT_CLASS)
    startup.install(ARCHITECTURE)  # the bundle check when vLLM builds its configuration (neffbuild/vllm/startup.py)
    _check_the_section_for_every_model()


def _check_the_section_for_every_model() -> None:
    """Check ``additional_config`` whatever model vLLM serves (idempotent).

    The GPT-OSS hook above runs for GPT-OSS checkpoints only, so a ``neffbuild`` section given with another model,
    or a misspelled key, would leave vLLM serving natively while the operator believes the bundle serves. vLLM
    has no per-configuration plugin hook for every architecture, so the one method every ``VllmConfig`` runs at the
    end of its set-up (``try_verify_and_update_config``, which looks the per-architecture hooks up) checks the
    section first; refusals print as one line under vLLM's CLI (startup.one_line_refusals)."""
    from vllm.config import VllmConfig

    from neffbuild.vllm import startup
    from neffbuild.vllm.config import for_architecture

    original = VllmConfig.try_verify_and_update_config
    if getattr(original, "neffbuild_section_check", False):
        return

    def try_verify_and_update_config(self) -> None:
        model = self.model_config
        if model is not None and not getattr(model, "config_updated", False):
            with startup.one_line_refusals():
                for_architecture(self.additional_config, model.architecture, ARCHITECTURE)
        original(self)

    try_verify_and_update_config.neffbuild_section_check = True
    VllmConfig.try_verify_and_update_config = try_verify_and_update_config
