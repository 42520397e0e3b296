"""The one place that names each compiler backend and each model architecture.

Entries are ``"module:attribute"`` strings, imported only when a part is asked for, so
this base module imports nothing of the project but ``errors``: the thin runtime reads a
backend's loader from here without importing the compile side, and the recipe validator
takes its choices from here without importing torch.

Adding a backend or an architecture = one new module plus one entry below.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from neffbuild.errors import InvalidInput, did_you_mean


def resolve(ref: str):
    """``"package.module:attr"`` -> the object."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class Entry:
    """Named parts; ``entry.get(part)`` imports one."""

    name: str
    parts: dict[str, str]

    def get(self, part: str):
        return resolve(self.parts[part])


# Backend parts: compile_side (a compiler/backends Backend class, build side only), loader
# (runtime: path, weights, toolchain, device -> step callable), host_problem (runtime:
# toolchain -> why this host cannot run the artifacts, or None), available (-> bool), layout_rule
# (optional, recipe validation: err, tp, compiler section, lnc -> reports what the backend cannot build),
# kv_rule / kv_limit (optional, torch-free: err, one rank's KVLayout -> reports a pool the kernels cannot
# address; KVLayout -> the largest num_blocks they can; neuron's block-KV DMA uses 32-bit offsets).
BACKENDS = {
    "neuron": Entry("neuron", {
        "compile_side": "neffbuild.compiler.backends.neuron:NeuronBackend",
        "loader": "neffbuild.runtime.bundle.loaders:load_neuron",
        "host_problem": "neffbuild.runtime.bundle.loaders:neuron_problem",
        "available": "neffbuild.compiler.backends.neuron:available",
        "layout_rule": "neffbuild.compiler.backends.neuron_rules:neuron_instance_limit",
        "kv_rule": "neffbuild.compiler.backends.neuron_rules:kv_offsets_32bit",
        "kv_limit": "neffbuild.compiler.backends.neuron_rules:kv_offset_limit",
        "flag_problem": "neffbuild.compiler.backends.flag_rules:neuron_problem",
    }),
    "inductor": Entry("inductor", {
        "compile_side": "neffbuild.compiler.backends.inductor:InductorBackend",
        "loader": "neffbuild.runtime.bundle.loaders:load_inductor",
        "host_problem": "neffbuild.runtime.bundle.loaders:inductor_problem",
        "available": "neffbuild.compiler.backends.inductor:available",
        "flag_problem": "neffbuild.compiler.backends.flag_rules:inductor_problem",
        "vllm_plugin": "neffbuild.bundle.handoff:plugin_config",
        "native_cpu_ops": "neffbuild.kernels.moe:native_cpu_ops",
    }),
}
AUTO = "auto"  # the first available backend, in the order above
# flag_problem (torch-free: one compiler flag -> why a recipe may not set it, or None): recipes are data.
# vllm_plugin (optional): the backend's bundles serve in vLLM through neffbuild's plugin (neffbuild/vllm); the
# command line for one bundle. Without it (neuron) vLLM Neuron takes the compiled grid as its neuron_config.
# native_cpu_ops (optional): its CPU graphs call the runtime's native ops, which the int8 kernel forms
# (model.expert_kernel / head_kernel) are; a backend without it is refused those forms.
AUTO_FLAG_RULES = "inductor"  # with backend: auto, flags must pass the embedded backend's allow-list

# Architecture parts: config (dataclass with from_hf_dict), weights (config, checkpoint,
# seed -> stacked weights), placeholder_shapes (config -> {name: shape}), decode (the decode
# graph module), aux_layers (num_layers -> EAGLE3 aux layer ids), prefill (eager prompt
# pass that fills the paged KV; serve/ uses it; ``logits=`` "all", "last" or "none"). Sharding
# (tp/ep): rank_shapes (config, layout -> one rank's shapes), local_config (a rank's heads),
# iter_pieces / shard_layout / kv_heads_of /
# piece_names (the bundle's weight pieces and which a rank maps), shard (a rank's weights), unshard
# (pieces -> the full weights, the --check reference).
# placeholder_shapes, rank_shapes, local_config and rank_weight_bytes (config, layout -> bytes of the
# pieces one rank maps, as stored) are torch-free: plan and the validator size a rank with them.
# Recipe-time rules (torch-free, err(path, value, rule) reporting): field_limits, unknown_keys
# (inline config keys), build_config, check_gk_layout, kv_pool_bytes, kv_window.
ARCHITECTURES = {
    "gpt_oss": Entry("gpt_oss", {
        "config": "neffbuild.models.gpt_oss.config:GptOssConfig",
        "hf_config": "neffbuild.models.gpt_oss.config:hf_config",  # config, dtype -> the bundle's config.json
        "field_limits": "neffbuild.models.gpt_oss.rules:field_limits",
        "unknown_keys": "neffbuild.models.gpt_oss.rules:unknown_keys",
        "build_config": "neffbuild.models.gpt_oss.rules:build_config",
        "check_gk_layout": "neffbuild.models.gpt_oss.rules:check_gk_layout",
        "kv_pool_bytes": "neffbuild.models.gpt_oss.rules:kv_pool_bytes",
        "kv_window": "neffbuild.models.gpt_oss.rules:kv_window",
        "weights": "neffbuild.models.gpt_oss.weights:model_weights",
        "placeholder_shapes": "neffbuild.models.gpt_oss.shapes:stacked_shapes",
        "decode": "neffbuild.models.gpt_oss.decode:GptOssDecode",
        "aux_layers": "neffbuild.models.gpt_oss.decode:default_aux_layers",
        "prefill": "neffbuild.models.gpt_oss.prefill:prefill",
        "rank_shapes": "neffbuild.models.gpt_oss.shapes:rank_shapes",
        "local_config": "neffbuild.models.gpt_oss.shapes:local_config",
        "rank_weight_bytes": "neffbuild.models.gpt_oss.shapes:rank_weight_bytes",
        "check_layout": "neffbuild.models.gpt_oss.sharding:check_layout",  # config, layout -> InvalidInput or None
        "rank_weight_parts": "neffbuild.models.gpt_oss.shapes:rank_weight_parts",  # -> {part: bytes}
        "rank_specs": "neffbuild.models.gpt_oss.shapes:rank_specs",  # -> {name: (shape, dtype)}
        "weight_form": "neffbuild.models.gpt_oss.shapes:WeightForm",  # (weights_dtype, experts) -> stored form
        "experts_of": "neffbuild.models.gpt_oss.shapes:experts_of",  # stored names -> dense | mxfp4
        "iter_pieces": "neffbuild.models.gpt_oss.sharding:iter_pieces",
        "shard_layout": "neffbuild.models.gpt_oss.sharding:shard_layout",
        "piece_names": "neffbuild.models.gpt_oss.sharding:piece_names",  # layout, rank -> the pieces it maps
        "shard": "neffbuild.models.gpt_oss.sharding:shard",  # config, full weights, layout, rank -> its weights
        "kv_heads_of": "neffbuild.models.gpt_oss.sharding:kv_heads_of",
        "unshard": "neffbuild.models.gpt_oss.sharding:unshard",
        "kv_buffer_of_layer": "neffbuild.models.gpt_oss.kv_buffers:kv_buffer_of_layer",  # layer -> its KV buffer
    }),
}


# Speculative-decoding methods (a recipe's speculative.method): config (dataclass with
# from_hf_dict(hf, target_config), torch-free), weights (config, checkpoint, seed, dtype -> the bundle's
# draft_* tensors, whole), placeholders (config, layout, dtype, own embedding? -> one rank's traceable
# placeholder weights), has_own_embed (checkpoint -> bool, headers only, torch-free), weight_bytes (config,
# own embedding?, layout, dtype -> the bytes one rank maps, torch-free), embed_name (own embedding? -> the bundle
# name of the embedding the draft reads), draft (the draft graph module), prefill (eager draft prefill; serve/
# uses it). Sharding over TP, as the target's: local_config (a rank's heads) and layout_problem (config, tp ->
# why it cannot split, or None), both torch-free; piece (config, draft tensors, layout, piece name -> the
# draft's tensors in that bundle piece), shard_layout, shard (a rank's draft), unshard (pieces -> the draft).
# engine_folder (config, draft tensors, folder -> the draft as a model folder a host engine loads: the bundle's
# draft/, whole).
SPECULATIVE = {
    "eagle3": Entry("eagle3", {
        "config": "neffbuild.models.eagle3.config:Eagle3Config",
        "weights": "neffbuild.models.eagle3.weights:draft_weights",
        "placeholders": "neffbuild.models.eagle3.weights:placeholders",
        "has_own_embed": "neffbuild.models.eagle3.shapes:has_own_embed",
        "weight_bytes": "neffbuild.models.eagle3.shapes:weight_bytes",
        "embed_name": "neffbuild.models.eagle3.weights:embed_name",
        "draft": "neffbuild.models.eagle3.draft:Eagle3Draft",
        "prefill": "neffbuild.models.eagle3.draft:prefill",
        "local_config": "neffbuild.models.eagle3.shapes:local_config",
        "rank_specs": "neffbuild.models.eagle3.shapes:rank_specs",  # config, layout, dtype, own? -> {name: spec}
        "kv_heads_of": "neffbuild.models.eagle3.sharding:kv_heads_of",  # config, layout, tp rank -> its draft KV heads
        "layout_problem": "neffbuild.models.eagle3.shapes:layout_problem",
        "piece": "neffbuild.models.eagle3.sharding:piece",
        "shard_layout": "neffbuild.models.eagle3.sharding:shard_layout",
        "shard": "neffbuild.models.eagle3.sharding:shard",
        "unshard": "neffbuild.models.eagle3.sharding:unshard",
        "engine_folder": "neffbuild.models.eagle3.weights:write_engine_folder",
    }),
}


def _lookup(table: dict[str, Entry], name: str, what: str, path: str) -> Entry:
    if name in table:
        return table[name]
    raise InvalidInput(f"{path}: unknown {what} {name!r}; known: {', '.join(table)}{did_you_mean(name, table)}")


def backend(name: str) -> Entry:
    return _lookup(BACKENDS, name, "backend", "compiler.backend")


def arch(name: str) -> Entry:
    return _lookup(ARCHITECTURES, name, "architecture", "model.arch")


def speculative(name: str) -> Entry:
    return _lookup(SPECULATIVE, name, "speculative method", "speculative.method")


def arch_of(config) -> Entry:
    """The architecture whose config class ``config`` is an instance of."""
    for entry in ARCHITECTURES.values():
        if isinstance(config, entry.get("config")):
            return entry
    raise InvalidInput(f"no registered architecture has the config class {type(config).__name__}")


def speculative_of(config) -> Entry:
    """The speculative method whose draft config class ``config`` is an instance of."""
    for entry in SPECULATIVE.values():
        if isinstance(config, entry.get("config")):
            return entry
    raise InvalidInput(f"no registered speculative method has the config class {type(config).__name__}")


def backend_choices() -> tuple[str, ...]:
    """What a recipe or ``--backend`` may name."""
    return (AUTO, *BACKENDS)
