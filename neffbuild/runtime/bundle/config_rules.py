"""Rules for a model config block (the target's and the draft's): strict types, sizes that fit.

Every integer has an upper bound (the architecture's ``field_limits`` registry part), so nothing
downstream allocates from a hostile number (a list of 10**30 layer types, a 10**400 vocabulary);
floats are finite real numbers; ``rope_parameters`` is checked key by key. One rule set for both
sides: the recipe validator (recipe/model_rules.py: ``model.config``, ``speculative.draft.config``)
and the bundle's judge (``model_problems``: a manifest's ``graph_inputs.model_config``, run by
``reader.check``, so every engine that opens a bundle refuses the same configs). Torch-free.
"""

from __future__ import annotations

import math

from neffbuild import registry
from neffbuild.errors import NO_VALUE, Problem, did_you_mean

ROPE_FLOATS = {"factor": (0.0, 1e6), "beta_fast": (0.0, 1e6), "beta_slow": (0.0, 1e6), "rope_theta": (0.0, 1e12),
               "attention_factor": (0.0, 1e6), "mscale": (0.0, 1e6), "mscale_all_dim": (0.0, 1e6)}
ROPE_TYPES = ("yarn", "default")
ROPE_KEYS = {*ROPE_FLOATS, "rope_type", "type", "truncate", "original_max_position_embeddings"}


def is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_float(v, value, path: str, lo: float, hi: float) -> bool:
    """A finite real number in (lo, hi]; ints are fine for floats (YAML writes 1 for 1.0)."""
    if not is_real(value) or (isinstance(value, int) and abs(value) > 2**53):
        v.err(path, value, "must be a finite number")
        return False
    if not lo < value <= hi:
        v.err(path, value, f"must be > {lo} and <= {hi:g}")
        return False
    return True


def check_rope(v, rope, path: str) -> bool:
    if not isinstance(rope, dict):
        v.err(path, rope, "must be a mapping (rope_type, factor, beta_fast, ...)")
        return False
    ok = True
    for key, value in rope.items():
        if key not in ROPE_KEYS:
            v.err(f"{path}.{key}", NO_VALUE, "unknown key" + did_you_mean(key, ROPE_KEYS))
            ok = False
        elif key in ROPE_FLOATS:
            ok &= check_float(v, value, f"{path}.{key}", *ROPE_FLOATS[key])
        elif key == "truncate" and not isinstance(value, bool):
            v.err(f"{path}.{key}", value, "must be true or false")
            ok = False
        elif key in ("rope_type", "type") and value not in ROPE_TYPES:
            v.err(f"{path}.{key}", value, f"must be one of {', '.join(ROPE_TYPES)}")
            ok = False
        elif key == "original_max_position_embeddings" and v.check_int(value, f"{path}.{key}", maximum=2**24) is None:
            ok = False
    if ok and rope.get("rope_type", rope.get("type")) == "yarn":
        for key in ("factor", "original_max_position_embeddings"):
            if key not in rope:
                v.err(f"{path}.{key}", NO_VALUE, "is required with rope_type yarn")
                ok = False
    return ok


def check_numbers(v, hf: dict, path: str, config_cls, limits: tuple[dict, dict]) -> bool:
    """Every int field of the architecture's config in range, floats finite, rope block valid, layer_types bounded.

    ``limits``: the architecture's ``field_limits()`` registry part (int bounds, float ranges).
    """
    int_limits, float_rules = limits
    ok = True
    for key in config_cls.INT_FIELDS:
        if key in hf and v.check_int(hf[key], f"{path}.{key}", maximum=int_limits.get(key, 2**31 - 1)) is None:
            ok = False
    sw = hf.get("sliding_window")
    if sw is not None and v.check_int(sw, f"{path}.sliding_window", maximum=int_limits["sliding_window"]) is None:
        ok = False
    for key, (lo, hi) in float_rules.items():
        if key in hf:
            ok &= check_float(v, hf[key], f"{path}.{key}", lo, hi)
    for key in ("rope_parameters", "rope_scaling"):
        if hf.get(key) is not None:
            ok &= check_rope(v, hf[key], f"{path}.{key}")
    types = hf.get("layer_types")
    sliding, full = config_cls.SLIDING, config_cls.FULL
    most = int_limits["num_hidden_layers"]
    if types is not None and (not isinstance(types, list) or len(types) > most
                              or any(t not in (sliding, full) for t in types)):
        v.err(f"{path}.layer_types", types, f"must be a list of {sliding!r} / {full!r} (at most {most} entries)")
        ok = False
    return ok


def int_rule(value, minimum: int | None = 1, maximum: int = 2**31 - 1) -> str | None:
    """The rule an integer field breaks (None: it is an int in range); the recipe's ``check_int`` words it too."""
    if isinstance(value, bool) or not isinstance(value, int):
        return "must be an integer" + (" (not a float)" if isinstance(value, float) else "")
    if minimum is not None and value < minimum:
        return f"must be >= {minimum}" if minimum != 1 else "must be a positive integer"
    if value > maximum:
        return f"must be <= {maximum}"
    return None


def check_int(v, value, path: str, minimum: int | None = 1, *, maximum: int = 2**31 - 1):
    """``value`` when it is an int in range, else None with the problem reported through ``v.err``."""
    why = int_rule(value, minimum, maximum)
    if why:
        v.err(path, value, why)
        return None
    return value


class Findings:
    """The ``err`` / ``check_int`` pair the rules report through, collecting Problems (the recipe's ``Checks``
    is the other implementation)."""

    def __init__(self):
        self.problems: list[Problem] = []

    def err(self, path: str, value, message: str) -> None:
        self.problems.append(Problem(path, message, value))

    def check_int(self, value, path: str, minimum: int | None = 1, *, maximum: int = 2**31 - 1):
        return check_int(self, value, path, minimum, maximum=maximum)


def arch_config(v, hf: dict, path: str, arch: str):
    """The architecture's config from Hugging Face keys, checked through ``v`` (None: unknown or bad keys)."""
    if arch not in registry.ARCHITECTURES:
        known = ", ".join(registry.ARCHITECTURES)
        v.err(path.rsplit(".", 1)[0] + ".arch", arch, f"unknown architecture (known: {known})")
        return None
    entry = registry.arch(arch)
    if not check_numbers(v, hf, path, entry.get("config"), entry.get("field_limits")()):
        return None
    return entry.get("build_config")(v.err, hf, path)


def model_problems(arch: str, hf: dict, path: str = "graph_inputs.model_config") -> tuple[object, list[Problem]]:
    """(config, problems) of a bundle's model config under the recipe's rules: one judge for every engine."""
    v = Findings()
    cfg = arch_config(v, hf, path, arch)
    return (cfg if not v.problems else None), v.problems
