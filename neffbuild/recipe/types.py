"""The frozen recipe types. Imports nothing of the project but the registry and the bucket math."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from neffbuild import registry
from neffbuild.recipe.dtype_rules import KERNEL_KEYS, checkpoint_defaults
from neffbuild.runtime.parallel import ParallelLayout
from neffbuild.runtime.step.buckets import num_swa_blocks


@dataclass(frozen=True)
class ModelSpec:
    arch: str
    hf_config: dict  # resolved Hugging Face config keys
    checkpoint: Path | None
    random_seed: int | None
    weights_dtype: str = "float32"  # float tensors as stored and computed: float32 | bfloat16
    experts: str = "dense"  # dense | mxfp4 (kept packed, decoded in the graph)
    expert_kernel: str = "exact"  # exact | int8 (MXFP4 times int8-quantized activations: runtime/native_q8.py)
    head_kernel: str = "exact"  # exact | int8 (the LM head read as int8, greedy-exact: runtime/native_q8.py)
    attn_kernel: str = "exact"  # exact | int8 (the qkv and o projections read as int8, lossy: runtime/native_q8.py)

    @property
    def config(self):
        """The architecture's config dataclass (from the registry)."""
        return registry.arch(self.arch).get("config").from_hf_dict(self.hf_config)


@dataclass(frozen=True)
class Speculative:
    method: str
    num_speculative_tokens: int
    draft_checkpoint: Path | None
    draft_random_seed: int | None
    draft_hf_config: dict


@dataclass(frozen=True)
class Recipe:
    name: str
    version: str
    model: ModelSpec
    max_model_len: int
    max_num_seqs: int
    block_size: int
    num_blocks: int
    num_seqs_buckets: tuple[int, ...]
    decode_context_length_buckets: tuple[int, ...]  # fallback (max_model_len) not included
    gk_decode: bool
    fp8_packed_kv: bool
    lnc: int
    tp: int
    dp: int
    ep: int
    speculative: Speculative | None
    backend: str
    target: str
    optlevel: int
    flags: tuple[str, ...]
    target_flags: tuple[tuple[str, tuple[str, ...]], ...]  # per-label extra flags, sorted by label
    jobs: int | None
    cache_dir: Path | None
    source: str = "<recipe>"
    warnings: tuple[str, ...] = field(default=(), compare=False)
    kv_dtype: str = "float32"  # the KV buffers' dtype without fp8_packed_kv: float32 | bfloat16

    @property
    def num_speculative_tokens(self) -> int:
        return self.speculative.num_speculative_tokens if self.speculative else 0

    @property
    def parallel(self) -> ParallelLayout:
        return ParallelLayout(self.tp, self.dp, self.ep)

    @property
    def draft_config(self):
        """The speculative method's draft config dataclass over the target's (None without a speculative section)."""
        s = self.speculative
        return registry.speculative(s.method).get("config").from_hf_dict(s.draft_hf_config, self.model.config) \
            if s else None

    @property
    def draft_own_embed(self) -> bool:
        """Whether the draft checkpoint brings its own token embedding (else the draft reads the target's)."""
        s = self.speculative
        return bool(s and s.draft_checkpoint
                    and registry.speculative(s.method).get("has_own_embed")(s.draft_checkpoint))

    @property
    def num_swa(self) -> int:
        cfg = self.model.config
        if not cfg.has_sliding_layers:
            return 0
        return num_swa_blocks(cfg.sliding_window, self.block_size, self.max_model_len, 1 + self.num_speculative_tokens)

    def to_dict(self) -> dict:
        """Normalised recipe: every default filled in; paths as given (absolute)."""
        spec = None
        if self.speculative:
            s = self.speculative
            draft = {"config": s.draft_hf_config}
            draft.update({"checkpoint": str(s.draft_checkpoint)} if s.draft_checkpoint
                         else {"random_seed": s.draft_random_seed})
            spec = {"method": s.method, "num_speculative_tokens": s.num_speculative_tokens, "draft": draft}
        model = {"arch": self.model.arch, "config": self.model.hf_config}
        if self.model.checkpoint:
            model["checkpoint"] = str(self.model.checkpoint)
        else:
            model["random_seed"] = self.model.random_seed
        # Only where not float32 / dense or not what the checkpoint implies: a recipe that names no serving dtype
        # normalises (and hashes) as before, and the normalised recipe reloads to the same one.
        implied = checkpoint_defaults(self.model.hf_config, self.model.checkpoint is not None)
        for key, value, default, own in (("weights_dtype", self.model.weights_dtype, "float32", implied[0]),
                                         ("experts", self.model.experts, "dense", implied[1])):
            if value != default or value != own:
                model[key] = value
        for key in KERNEL_KEYS:  # only the opt-in forms: exact recipes hash as before
            if getattr(self.model, key) != "exact":
                model[key] = getattr(self.model, key)
        out = {
            "name": self.name,
            "version": self.version,
            "model": model,
            "serving": {
                "max_model_len": self.max_model_len,
                "max_num_seqs": self.max_num_seqs,
                "block_size": self.block_size,
                "num_blocks": self.num_blocks,
            },
            "neuron_config": {
                "num_seqs_buckets": list(self.num_seqs_buckets),
                "decode_context_length_buckets": list(self.decode_context_length_buckets),
                "gk_decode": self.gk_decode,
                "fp8_packed_kv": self.fp8_packed_kv,
                "lnc": self.lnc,
            },
            "parallel": {"tp": self.tp, "dp": self.dp, "ep": self.ep},
            "compiler": {"backend": self.backend, "target": self.target, "optlevel": self.optlevel,
                         "flags": list(self.flags),
                         "target_flags": {label: list(f) for label, f in self.target_flags}},
            "build": {"jobs": self.jobs, "cache_dir": str(self.cache_dir) if self.cache_dir else None},
        }
        if self.kv_dtype != "float32":
            out["neuron_config"]["kv_dtype"] = self.kv_dtype
        if spec:
            out["speculative"] = spec
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=True)

    def sha256(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()

    def flags_for(self, label: str) -> tuple[str, ...]:
        """Compiler flags for one target: the recipe's flags, then that target's own."""
        return self.flags + dict(self.target_flags).get(label, ())

    def replace(self, **changes) -> Recipe:

        return dataclasses.replace(self, **changes)
