"""The validator's typed primitives: collect a problem, read a section, an int, a bool, a choice, a path.

Every section rule (``*_rules.py``) reports through ``Checks.err`` so all problems are
collected before anything raises. Types are strict: ``"1024"`` is not an int and ``true`` is
not a number. Unknown keys get a "did you mean" (``errors.did_you_mean``, shared with the
registry and the manifest schema).
"""

from __future__ import annotations

from pathlib import Path

from neffbuild.errors import NO_VALUE, Problem, did_you_mean
from neffbuild.runtime.bundle.config_rules import check_int

# Upper bounds of the serving sizes: what fits in memory and in int64 index math.
LIMITS = {"max_model_len": 2**24, "max_num_seqs": 4096, "block_size": 4096, "num_blocks": 2**24, "tp": 1024,
          "dp": 1024, "ep": 1024, "jobs": 1024, "num_speculative_tokens": 64, "random_seed": 2**63 - 1}

# Allowed keys per section; anything else is an error with a "did you mean".
SCHEMA = {
    "": {"name", "version", "model", "serving", "neuron_config", "parallel", "speculative", "compiler", "build"},
    "model": {"arch", "config", "checkpoint", "random_seed", "weights_dtype", "experts", "expert_kernel",
              "head_kernel", "attn_kernel"},
    "serving": {"max_model_len", "max_num_seqs", "block_size", "num_blocks"},
    "neuron_config": {"num_seqs_buckets", "decode_context_length_buckets", "gk_decode", "fp8_packed_kv", "lnc",
                      "kv_dtype"},
    "parallel": {"tp", "dp", "ep"},
    "speculative": {"method", "num_speculative_tokens", "draft"},
    "speculative.draft": {"checkpoint", "random_seed", "config"},
    "compiler": {"backend", "target", "optlevel", "flags", "target_flags"},
    "build": {"jobs", "cache_dir"},
}


class Checks:
    """Problems and warnings of one recipe, and the primitives that add to them."""

    def __init__(self, base_dir: Path, source: str):
        self.base_dir = base_dir
        self.source = source
        self.problems: list[Problem] = []
        self.warnings: list[str] = []

    def err(self, path: str, value, message: str) -> None:
        self.problems.append(Problem(path, message, value))

    def section(self, raw: dict, key: str, schema_key: str, required: bool = False) -> dict:
        value = raw.get(key, NO_VALUE)
        if value is NO_VALUE or value is None:
            if required:
                self.err(schema_key, NO_VALUE, "is required")
            return {}
        if not isinstance(value, dict):
            self.err(schema_key, value, "must be a mapping")
            return {}
        self.unknown_keys(value, schema_key)
        return value

    def unknown_keys(self, mapping: dict, schema_key: str, allowed=None) -> None:
        """Each key not in ``allowed`` (default: ``SCHEMA[schema_key]``) is a problem with a did-you-mean."""
        allowed = SCHEMA[schema_key] if allowed is None else allowed
        for key in mapping:
            if not schema_key and isinstance(key, str) and key.startswith("x-"):
                continue  # top-level x-* keys hold YAML anchors for merge keys (<<: *x-defaults)
            if key not in allowed:
                path = f"{schema_key}.{key}" if schema_key else str(key)
                hint = did_you_mean(key, allowed)
                self.err(path, NO_VALUE, f"unknown key{hint}" if hint
                         else f"unknown key; allowed: {', '.join(sorted(allowed))}")

    def integer(self, mapping: dict, key: str, path: str, *, default=NO_VALUE, minimum: int | None = 1):
        value = mapping.get(key, NO_VALUE)
        if value is NO_VALUE:
            if default is NO_VALUE:
                self.err(path, NO_VALUE, "is required")
                return None
            return default
        return self.check_int(value, path, minimum, maximum=LIMITS.get(key, 2**31 - 1))

    def check_int(self, value, path: str, minimum: int | None = 1, *, maximum: int = 2**31 - 1):
        return check_int(self, value, path, minimum, maximum=maximum)

    def boolean(self, mapping: dict, key: str, path: str, default: bool):
        value = mapping.get(key, default)
        if not isinstance(value, bool):
            self.err(path, value, "must be true or false")
            return default
        return value

    def choice(self, mapping: dict, key: str, path: str, choices, default):
        value = mapping.get(key, default)
        if value not in choices or isinstance(value, bool):
            self.err(path, value, f"must be one of {', '.join(map(str, choices))}{did_you_mean(value, choices)}")
            return default
        return value

    def path_value(self, value, path: str, *, want_dir: bool) -> Path | None:
        if not isinstance(value, str) or not value or "\x00" in value or len(value) > 4096:
            self.err(path, value, "must be a path string")
            return None
        p = self.expand(value, path)
        if p is None:
            return None
        try:
            exists, is_dir = p.exists(), p.is_dir()
            p = p.resolve()
        except (OSError, RuntimeError) as exc:
            self.err(path, value, f"cannot be resolved ({exc})")
            return None
        if not exists:
            self.err(path, value, f"does not exist (resolved to {p})")
            return None
        if want_dir and not is_dir:
            self.err(path, value, "must be a folder holding a Hugging Face safetensors checkpoint")
            return None
        if want_dir and not any(p.glob("*.safetensors")):
            self.err(path, value, "holds no *.safetensors files (not a Hugging Face safetensors checkpoint)")
            return None
        return p

    def expand(self, value: str, path: str) -> Path | None:
        """``~`` expanded (an unknown ``~user`` is an error) and made absolute against the recipe's folder."""
        try:
            p = Path(value).expanduser()
        except RuntimeError:
            self.err(path, value, "names a home folder of an unknown user")
            return None
        return p if p.is_absolute() else self.base_dir / p
