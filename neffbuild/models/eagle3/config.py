"""EAGLE3 draft configuration: one flat dataclass, defaults derived from the target.

The draft reads Hugging Face-style keys (the common EAGLE3 ``config.json``:
``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``,
``intermediate_size``, ``vocab_size``, ``draft_vocab_size``, ``rms_norm_eps``, rope keys,
and the auxiliary layers as ``eagle_config.eagle_aux_hidden_state_layer_ids`` or
``aux_layers``). Any key left out takes the target's value, so an empty dict gives the
derived draft: same hidden size and heads as the target, one layer. Leaf module: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from neffbuild.errors import InvalidInput
from neffbuild.models.gpt_oss.config import GptOssConfig, default_aux_layers


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary (d2t maps into it)
    draft_vocab_size: int
    rms_norm_eps: float
    rope: dict
    # the target states fused (low, middle, high): id i is the residual stream entering target layer i (0: the
    # embeddings), as EAGLE3 checkpoints' eagle_aux_hidden_state_layer_ids and vLLM number them
    aux_layers: tuple[int, ...]

    @classmethod
    def from_hf_dict(cls, hf: dict | None, target: GptOssConfig) -> Eagle3Config:
        """The draft config: ``hf`` keys over values derived from ``target``; checked against it."""
        hf = dict(hf or {})

        def get(key, default):
            value = hf.get(key)
            return default if value is None else value

        rope = hf.get("rope_parameters") or hf.get("rope_scaling")
        if rope is not None:
            rope = dict(rope, rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        elif "rope_theta" in hf:
            rope = {"rope_type": "default", "rope_theta": hf["rope_theta"]}
        vocab = get("vocab_size", target.vocab_size)
        aux = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or hf.get("aux_layers")
        cfg = cls(
            hidden_size=get("hidden_size", target.hidden_size),
            num_attention_heads=get("num_attention_heads", target.num_attention_heads),
            num_key_value_heads=get("num_key_value_heads", target.num_key_value_heads),
            head_dim=get("head_dim", target.head_dim),
            intermediate_size=get("intermediate_size", target.intermediate_size),
            vocab_size=vocab,
            draft_vocab_size=get("draft_vocab_size", vocab),
            rms_norm_eps=get("rms_norm_eps", target.rms_norm_eps),
            rope=rope or dict(target.rope),
            aux_layers=tuple(aux) if aux else default_aux_layers(target.num_hidden_layers),
        )
        cfg.check(target)
        return cfg

    def check(self, target: GptOssConfig) -> None:
        """Raise InvalidInput naming the key when the draft cannot sit on ``target``."""
        where = "speculative.draft.config"
        if self.hidden_size != target.hidden_size:
            raise InvalidInput(f"{where}.hidden_size: got {self.hidden_size}, must equal the target's "
                               f"{target.hidden_size} (the draft reads the target's token embedding)")
        if self.vocab_size != target.vocab_size:
            raise InvalidInput(f"{where}.vocab_size: got {self.vocab_size}, must equal the target's "
                               f"{target.vocab_size}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise InvalidInput(f"{where}.draft_vocab_size: got {self.draft_vocab_size}, must be in "
                               f"[1, {self.vocab_size}]")
        if self.num_attention_heads % self.num_key_value_heads:
            raise InvalidInput(f"{where}.num_attention_heads: {self.num_attention_heads} is not a multiple of "
                               f"num_key_value_heads {self.num_key_value_heads}")
        bad = [i for i in self.aux_layers if not 0 <= i <= target.num_hidden_layers]
        if len(self.aux_layers) != 3 or bad:
            raise InvalidInput(f"{where}.eagle_config.eagle_aux_hidden_state_layer_ids: got {list(self.aux_layers)}, "
                               f"must be 3 ids in [0, {target.num_hidden_layers}] (id i: the stream entering target "
                               f"layer i; {target.num_hidden_layers}: after the last layer)")

    @property
    def attention_scale(self) -> float:
        return self.head_dim ** -0.5

    def to_hf_dict(self) -> dict:
        """The common EAGLE3 ``config.json`` keys (what a checkpoint folder carries)."""
        return {
            "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
            "hidden_size": self.hidden_size, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size, "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": dict(self.rope),
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layers)},
        }
