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


def register() -> None:
    """vLLM's general-plugin hook (every process, possibly more than once): the lazy model registration."""
    from vllm import ModelRegistry

    from neffbuild.vllm import startup

    ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
    startup.install(ARCHITECTURE)  # the bundle check when vLLM builds its configuration (neffbuild/vllm/startup.py)
