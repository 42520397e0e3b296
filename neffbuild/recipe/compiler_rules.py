"""Rules for the ``compiler`` and ``build`` sections: backend (choices from the registry), target,
optimisation level, flags, per-target flags (labels must be targets of this recipe) and jobs.

Target labels come from the runtime's one label format (``runtime/step/dispatch.py``), not from
``grid.py``, so the recipe stays below the grid.
"""

from __future__ import annotations

from neffbuild import registry
from neffbuild.errors import NO_VALUE, did_you_mean
from neffbuild.runtime.bundle.cpu_features import targets as cpu_targets
from neffbuild.runtime.step.buckets import ctx_buckets_with_fallback
from neffbuild.runtime.step.dispatch import families, label

BACKENDS = registry.backend_choices()
TARGETS = ("trn1", "trn2", *cpu_targets())  # neuron targets, then inductor -march values


def compiler(v, comp: dict, num_seqs, ctx, serving: dict, raw: dict) -> dict:
    optlevel = comp.get("optlevel", 2)
    if type(optlevel) is not int or optlevel not in (1, 2, 3):
        v.err("compiler.optlevel", optlevel, "must be 1, 2 or 3")
        optlevel = 2
    flags = comp.get("flags", [])
    if not isinstance(flags, list) or not all(isinstance(f, str) and f.isprintable() for f in flags):
        v.err("compiler.flags", flags, "must be a list of strings without control characters")
        flags = []
    out = {
        "backend": v.choice(comp, "backend", "compiler.backend", BACKENDS, "auto"),
        "target": v.choice(comp, "target", "compiler.target", TARGETS, "trn2"),
        "optlevel": optlevel,
        "flags": tuple(flags),
        "target_flags": target_flags(v, comp.get("target_flags", {}), num_seqs, ctx, serving, raw),
    }
    check_flags(v, out["backend"], out["flags"], out["target_flags"])  # recipes are data: no programs
    return out


def check_flags(v, backend: str, flags, target_flags) -> None:
    """Every flag the backend would refuse (its registry ``flag_problem`` part), each by its dotted path."""
    entry = registry.BACKENDS.get(registry.AUTO_FLAG_RULES if backend == registry.AUTO else backend)
    if entry is None or "flag_problem" not in entry.parts:
        return
    rule = entry.get("flag_problem")
    rows = [(f"compiler.flags[{i}]", f) for i, f in enumerate(flags)]
    rows += [(f"compiler.target_flags.{label}[{i}]", f) for label, fl in target_flags for i, f in enumerate(fl)]
    for path, flag in rows:
        why = rule(flag)
        if why:
            v.err(path, flag, why)


def recipe_labels(num_seqs, ctx, max_model_len: int, raw: dict) -> set[str]:
    """Every target label of the recipe (the grid's enumeration, from the runtime's label format)."""
    spec = raw.get("speculative") if isinstance(raw.get("speculative"), dict) else {}
    k = spec.get("num_speculative_tokens", 0) if isinstance(spec.get("num_speculative_tokens", 0), int) else 0
    return {label(fam, b, c, q) for b in num_seqs for c in ctx_buckets_with_fallback(ctx, max_model_len)
            for fam, q in families(k)}


def target_flags(v, value, num_seqs, ctx, serving: dict, raw: dict):
    """compiler.target_flags: {label: [flags]} for single targets (labels must be in the grid)."""
    path = "compiler.target_flags"
    if not isinstance(value, dict):
        v.err(path, value, "must be a mapping of target label -> list of flags")
        return ()
    labels = None
    if num_seqs and ctx is not None and serving["max_model_len"]:
        labels = recipe_labels(num_seqs, ctx, serving["max_model_len"], raw)
    out = []
    for lab, flags in value.items():
        if labels is not None and lab not in labels:
            v.err(f"{path}.{lab}", NO_VALUE, "is not a target of this recipe"
                  + (did_you_mean(lab, labels) or " (see `neffbuild plan`)"))
        elif not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
            v.err(f"{path}.{lab}", flags, "must be a list of strings")
        else:
            out.append((str(lab), tuple(flags)))
    return tuple(sorted(out))


def build(v, bld: dict) -> dict:
    jobs = v.integer(bld, "jobs", "build.jobs", default=None)
    cache_dir = bld.get("cache_dir")
    if cache_dir is not None and (not isinstance(cache_dir, str) or "\x00" in cache_dir):
        v.err("build.cache_dir", cache_dir, "must be a path string")
        cache_dir = None
    if cache_dir:
        cache_dir = v.expand(cache_dir, "build.cache_dir")
    return {"jobs": jobs, "cache_dir": cache_dir or None}
