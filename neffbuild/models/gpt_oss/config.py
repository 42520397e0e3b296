"""GPT-OSS configuration: one flat dataclass whose defaults are GPT-OSS-120B's values.

Built from Hugging Face ``config.json`` keys (GptOss names). This module imports nothing
from the project, so the recipe validator can use it without pulling in torch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

SLIDING = "sliding_attention"
FULL = "full_attention"


def _default_rope() -> dict:
    return {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
        "rope_theta": 150000.0,
    }


@dataclass(frozen=True)
class GptOssConfig:
    hidden_size: int = 2880
    intermediate_size: int = 2880
    num_hidden_layers: int = 36
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 64
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    vocab_size: int = 201088
    sliding_window: int | None = 128
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    layer_types: tuple[str, ...] = ()
    rope: dict = field(default_factory=_default_rope)

    SLIDING = SLIDING  # layer kinds, reachable from the class the registry names
    FULL = FULL

    INT_FIELDS = (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "num_local_experts", "num_experts_per_tok",
        "vocab_size", "max_position_embeddings",
    )

    @classmethod
    def from_hf_dict(cls, hf: dict) -> GptOssConfig:
        """Map Hugging Face keys onto the dataclass; unknown HF keys are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in hf.items() if k in names and k not in ("rope", "layer_types")}
        rope = hf.get("rope_parameters") or hf.get("rope_scaling")
        if rope is not None:
            merged = dict(rope)
            if "rope_theta" not in merged:
                merged["rope_theta"] = hf.get("rope_theta", 150000.0)
            kwargs["rope"] = merged
        layers = kwargs.get("num_hidden_layers", cls.num_hidden_layers)
        types = hf.get("layer_types")
        kwargs["layer_types"] = tuple(types) if types is not None else default_layer_types(layers)
        return cls(**kwargs)

    def to_hf_dict(self) -> dict:
        """Hugging Face ``config.json`` keys, enough for ``transformers.GptOssConfig(**d)``."""
        out = {f: getattr(self, f) for f in self.INT_FIELDS}
        out.update(
            model_type="gpt_oss",
            sliding_window=self.sliding_window,
            rms_norm_eps=self.rms_norm_eps,
            swiglu_alpha=self.swiglu_alpha,
            swiglu_limit=self.swiglu_limit,
            layer_types=list(self.layer_types),
            rope_parameters=dict(self.rope),
        )
        return out

    @property
    def num_kv_buffers(self) -> int:
        return self.num_hidden_layers // 2

    @property
    def has_sliding_layers(self) -> bool:
        return self.sliding_window is not None and SLIDING in self.layer_types

    @property
    def attention_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)


HF_ARCHITECTURE = "GptOssForCausalLM"  # transformers' and vLLM's class name for the architecture


def hf_config(cfg: GptOssConfig, dtype: str) -> dict:
    """The ``config.json`` a bundle carries for engines that read model folders (vLLM): the config's keys, the
    architecture's class name and the dtype the weights are stored in."""
    return dict(cfg.to_hf_dict(), architectures=[HF_ARCHITECTURE], torch_dtype=dtype)


def default_layer_types(num_layers: int) -> tuple[str, ...]:
    """GPT-OSS alternation: even layers sliding-window, odd layers full attention."""
    return tuple(SLIDING if i % 2 == 0 else FULL for i in range(num_layers))


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """The aux ids an EAGLE3 draft fuses when its config names none: early, middle, late (id i: the residual stream
    entering layer i, id L the stream after the last layer; EAGLE3's and vLLM's defaults from 5 layers). Below 5
    layers vLLM's formula repeats or leaves the range, and vLLM's own drafter collects one state per distinct id, so
    a short target takes three distinct ids over [0, L] (the test models)."""
    if num_layers >= 5:
        return (2, num_layers // 2, num_layers - 3)
    return (0, (num_layers + 1) // 2, num_layers) if num_layers >= 2 else (0, 1, 1)
