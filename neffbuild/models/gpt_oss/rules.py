"""GPT-OSS's recipe-time rules, registry parts of the architecture (``registry.ARCHITECTURES``):
field limits, building the config from Hugging Face keys (an unknown inline key is an error
with a did-you-mean), the GK layer layout, the bytes of the KV pool and the attention window.

Each rule reports through ``err(path, value, rule)`` (``recipe.checks.Checks.err``), so the
validator collects every problem. Torch-free: the validator imports it through the registry.
"""

from __future__ import annotations

import dataclasses

from neffbuild.errors import NO_VALUE, did_you_mean
from neffbuild.models.gpt_oss.config import FULL, SLIDING, GptOssConfig
from neffbuild.runtime.kv.layout import KVLayout

# Upper bounds: generous for real models (GPT-OSS-120B is far below each), small enough for memory.
INT_LIMITS = {
    "hidden_size": 2**16, "intermediate_size": 2**18, "num_hidden_layers": 1024, "num_attention_heads": 1024,
    "num_key_value_heads": 1024, "head_dim": 1024, "num_local_experts": 4096, "num_experts_per_tok": 4096,
    "vocab_size": 2**22, "max_position_embeddings": 2**24, "sliding_window": 2**24,
}
FLOAT_RULES = {"rms_norm_eps": (0.0, 1.0), "swiglu_alpha": (0.0, 1e6), "swiglu_limit": (0.0, 1e6),
               "rope_theta": (0.0, 1e12)}
# Hugging Face keys the config reads: its fields, plus the names the rope block and layer kinds go by.
READ_KEYS = ({f.name for f in dataclasses.fields(GptOssConfig)} - {"rope"}) | {
    "rope_parameters", "rope_scaling", "rope_theta"}
# Keys of GPT-OSS's own config.json that the decode graph ignores on purpose (bookkeeping, training-only
# switches, token ids the engine owns, the checkpoint's quantisation, which weights.py reads from the files).
IGNORED_KEYS = {
    "architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "hidden_act", "attention_bias",
    "attention_dropout", "initializer_range", "tie_word_embeddings", "use_cache", "router_aux_loss_coef",
    "output_router_logits", "eos_token_id", "pad_token_id", "bos_token_id", "experts_per_token", "num_experts",
    "quantization_config", "_name_or_path",
}


def field_limits() -> tuple[dict, dict]:
    """(int field -> upper bound, float field -> (low, high]) for config blocks of this architecture."""
    return INT_LIMITS, FLOAT_RULES


def unknown_keys(err, hf: dict, path: str) -> bool:
    """Report every key this architecture neither reads nor ignores on purpose; True when there is none."""
    allowed = READ_KEYS | IGNORED_KEYS
    bad = [k for k in hf if k not in allowed]
    for key in bad:
        hint = did_you_mean(key, allowed)
        err(f"{path}.{key}", NO_VALUE, f"unknown key{hint}" if hint else
            "unknown key (not a GPT-OSS config key; the model would silently use the default)")
    return not bad


def build_config(err, hf: dict, path: str) -> GptOssConfig | None:
    """The config from Hugging Face keys whose numbers are already checked; None when it is inconsistent."""
    cfg = GptOssConfig.from_hf_dict(hf)
    if len(cfg.layer_types) != cfg.num_hidden_layers:
        err(f"{path}.layer_types", len(cfg.layer_types), f"must have num_hidden_layers ({cfg.num_hidden_layers}) "
            "entries")
        return None
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        err(f"{path}.num_attention_heads", cfg.num_attention_heads,
            f"must be a multiple of num_key_value_heads ({cfg.num_key_value_heads})")
    if cfg.num_experts_per_tok > cfg.num_local_experts:
        err(f"{path}.num_experts_per_tok", cfg.num_experts_per_tok,
            f"must be <= num_local_experts ({cfg.num_local_experts})")
    return cfg


def check_gk_layout(err, cfg: GptOssConfig) -> None:
    """The GK decode pairs layers 2j, 2j+1 on KV buffer j: an even count, sliding then full."""
    if cfg.num_hidden_layers % 2:
        err("model.config.num_hidden_layers", cfg.num_hidden_layers,
            "must be even for gk_decode (layers pair up on KV buffers)")
    for i, t in enumerate(cfg.layer_types):
        want = SLIDING if i % 2 == 0 else FULL
        if t != want:
            err(f"model.config.layer_types[{i}]", t, f"must be {want!r} for gk_decode (even layers sliding, odd full)")


def kv_pool_bytes(cfg: GptOssConfig, num_blocks: int, block_size: int) -> int:
    """Bytes of the whole KV pool, every buffer's K and V halves, unsharded and float32 (a conservative bound;
    FP8 quarters it): the runtime's one KV formula (runtime/kv/layout.py)."""
    return KVLayout(cfg.num_kv_buffers, num_blocks, cfg.num_key_value_heads, block_size, cfg.head_dim).total_bytes


def kv_window(cfg: GptOssConfig) -> int | None:
    """The attention window of the sliding KV group, or None when no layer slides."""
    return cfg.sliding_window if cfg.has_sliding_layers else None
