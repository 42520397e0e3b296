"""Rules for the ``model`` and ``speculative`` sections: architecture, checkpoint or seed, the
Hugging Face config (inline keys, a ``config.json`` path, or the checkpoint's own) and the draft.

The architecture's own rules (config building, field limits, layer layout) are registry parts
of the architecture (``models/<arch>/``); this module only reads the recipe's keys.
"""

from __future__ import annotations

import json
from pathlib import Path

from neffbuild import registry
from neffbuild.errors import NO_VALUE, NeffbuildError, did_you_mean
from neffbuild.recipe import dtype_rules
from neffbuild.recipe.loading import read_regular_file
from neffbuild.recipe.types import ModelSpec, Speculative
from neffbuild.runtime.bundle import config_rules

KNOWN_ARCHS = tuple(registry.ARCHITECTURES)
SPEC_METHODS = tuple(registry.SPECULATIVE)


def model(v, m: dict):
    """(ModelSpec, the architecture's config) or (None, None)."""
    arch = m.get("arch", NO_VALUE)
    if arch is NO_VALUE:
        v.err("model.arch", NO_VALUE, "is required")
    elif arch not in KNOWN_ARCHS:
        v.err("model.arch", arch, f"unknown architecture; known: {', '.join(KNOWN_ARCHS)}"
              + did_you_mean(arch, KNOWN_ARCHS))
    has_ck, has_seed = "checkpoint" in m, "random_seed" in m
    checkpoint = seed = None
    if has_ck == has_seed:
        v.err("model", NO_VALUE, "set exactly one of model.checkpoint (a folder) or model.random_seed (an int)")
    if has_ck:
        checkpoint = v.path_value(m["checkpoint"], "model.checkpoint", want_dir=True)
    if has_seed:
        seed = v.check_int(m["random_seed"], "model.random_seed", minimum=0)
    hf = hf_config(v, m.get("config"), "model.config", checkpoint)
    if hf is None:
        return None, None
    arch = arch if isinstance(arch, str) else ""
    inline = isinstance(m.get("config"), dict)  # a typo here would silently compile the default
    if inline and arch in registry.ARCHITECTURES and not registry.arch(arch).get("unknown_keys")(
            v.err, hf, "model.config"):
        return None, None
    cfg = arch_config(v, hf, "model.config", arch)
    dtype, experts = dtype_rules.model_form(v, m, hf, has_ck)
    expert_kernel, head_kernel, attn_kernel = dtype_rules.kernel_forms(v, m)
    return ModelSpec(arch=arch, hf_config=hf, checkpoint=checkpoint, random_seed=seed, weights_dtype=dtype,
                     experts=experts, expert_kernel=expert_kernel, head_kernel=head_kernel,
                     attn_kernel=attn_kernel), cfg


def hf_config(v, value, path: str, checkpoint: Path | None) -> dict | None:
    if value is None:
        if checkpoint is None:
            v.err(path, NO_VALUE, "is required with random_seed (inline keys or a path to config.json)")
            return None
        value_path = checkpoint / "config.json"
        if not value_path.exists():
            v.err(path, NO_VALUE, f"not given and {value_path} does not exist")
            return None
        return read_json(v, value_path, path)
    if isinstance(value, str):
        p = v.path_value(value, path, want_dir=False)
        if p is None:
            return None
        if p.is_dir():
            p = p / "config.json"
        return read_json(v, p, path)
    if isinstance(value, dict):
        return dict(value)
    v.err(path, value, "must be a mapping of Hugging Face config keys or a path to config.json")
    return None


def read_json(v, p: Path, path: str) -> dict | None:
    try:
        data = json.loads(read_regular_file(p, "config.json"), parse_constant=_no_constant)
    except NeffbuildError as exc:
        v.err(path, str(p), str(exc).splitlines()[-1].removeprefix("  - (file): "))
        return None
    except (ValueError, RecursionError) as exc:
        v.err(path, str(p), f"is not a readable JSON file: {str(exc)[:160]}")
        return None
    if not isinstance(data, dict):
        v.err(path, str(p), "must hold a JSON object")
        return None
    return data


def arch_config(v, hf: dict, path: str, arch: str):
    """The architecture's config from Hugging Face keys (None: unknown architecture or bad keys)."""
    if arch not in registry.ARCHITECTURES:
        return None  # the recipe reports an unknown architecture where it reads model.arch
    return config_rules.arch_config(v, hf, path, arch)


def speculative(v, raw: dict, cfg) -> Speculative | None:
    if raw.get("speculative") is None:
        return None  # absent, or an empty `speculative:` line
    s = v.section(raw, "speculative", "speculative")
    if not s:
        if isinstance(raw.get("speculative"), dict):
            v.err("speculative", {}, "is empty; set method, num_speculative_tokens and draft, or remove it")
        return None
    method = v.choice(s, "method", "speculative.method", SPEC_METHODS, SPEC_METHODS[0])
    k = v.integer(s, "num_speculative_tokens", "speculative.num_speculative_tokens")
    d = v.section(s, "draft", "speculative.draft")
    ck = seed = None
    if ("checkpoint" in d) == ("random_seed" in d):
        v.err("speculative.draft", NO_VALUE, "set exactly one of draft.checkpoint or draft.random_seed")
    if "checkpoint" in d:
        ck = v.path_value(d["checkpoint"], "speculative.draft.checkpoint", want_dir=True)
    if "random_seed" in d:
        seed = v.check_int(d["random_seed"], "speculative.draft.random_seed", minimum=0)
    draft_cfg = d.get("config")
    if draft_cfg is not None or (ck is not None and (ck / "config.json").exists()):
        draft_cfg = hf_config(v, draft_cfg, "speculative.draft.config", ck)
        entry = registry.arch_of(cfg) if cfg is not None else registry.arch(KNOWN_ARCHS[0])
        if draft_cfg is not None and config_rules.check_numbers(
                v, draft_cfg, "speculative.draft.config", entry.get("config"), entry.get("field_limits")()):
            draft_cfg = dict(draft_cfg)
        else:
            draft_cfg = None
    elif cfg is not None:
        # Derived from the target: same widths and heads, one layer.
        draft_cfg = dict(cfg.to_hf_dict(), num_hidden_layers=1, layer_types=[cfg.FULL])
    if k is None:
        return None
    return Speculative(method, k, ck, seed, draft_cfg or {})


def _no_constant(name: str):
    raise ValueError(f"{name} is not standard JSON")
