"""Every recipe validation rule (DESIGN.md section 4), collected, never first-error-only.

Types are strict: ``"1024"`` is not an int and ``true`` is not a number. Unknown keys get
a "did you mean". The only project modules used are ``errors``, the pure bucket math, the
grid (for ``compiler.target_flags`` labels) and the architecture's config dataclass (a
leaf module, found through ``registry``), so config defaults and bucket formulas exist once.
Backend and architecture choices come from ``registry``.
"""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path

from neffbuild import registry
from neffbuild.errors import NO_VALUE, NeffbuildError, Problem
from neffbuild.recipe import config_rules, parallel_rules
from neffbuild.recipe.spec import ModelSpec, Recipe, Speculative
from neffbuild.runtime.blocks import group_blocks, kv_groups, min_pool_blocks
from neffbuild.runtime.buckets import P_MAX, default_num_seqs_buckets, num_swa_blocks
from neffbuild.runtime.cpu_features import targets as cpu_targets

NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,99}")  # fullmatch: no trailing newline, no control characters
SEMVER_RE = re.compile(r"[0-9]{1,9}\.[0-9]{1,9}\.[0-9]{1,9}(?:-[0-9A-Za-z.-]{1,64})?(?:\+[0-9A-Za-z.-]{1,64})?")
# Upper bounds of the serving sizes: what fits in memory and in int64 index math.
LIMITS = {"max_model_len": 2**24, "max_num_seqs": 4096, "block_size": 4096, "num_blocks": 2**24, "tp": 1024,
          "dp": 1024, "ep": 1024, "jobs": 1024, "num_speculative_tokens": 64, "random_seed": 2**63 - 1}
MAX_KV_BYTES = 2**40  # 1 TiB of KV pool is beyond any host; a typo in num_blocks is caught here
BACKENDS = registry.backend_choices()
KNOWN_ARCHS = tuple(registry.ARCHITECTURES)
TARGETS = ("trn1", "trn2", *cpu_targets())  # neuron targets, then inductor -march values
SPEC_METHODS = ("eagle3",)

# Allowed keys per section; anything else is an error with a "did you mean".
SCHEMA = {
    "": {"name", "version", "model", "serving", "neuron_config", "parallel", "speculative", "compiler", "build"},
    "model": {"arch", "config", "checkpoint", "random_seed"},
    "serving": {"max_model_len", "max_num_seqs", "block_size", "num_blocks"},
    "neuron_config": {"num_seqs_buckets", "decode_context_length_buckets", "gk_decode", "fp8_packed_kv", "lnc"},
    "parallel": {"tp", "dp", "ep"},
    "speculative": {"method", "num_speculative_tokens", "draft"},
    "speculative.draft": {"checkpoint", "random_seed", "config"},
    "compiler": {"backend", "target", "optlevel", "flags", "target_flags"},
    "build": {"jobs", "cache_dir"},
}



class Validator:
    def __init__(self, base_dir: Path, source: str):
        self.base_dir = base_dir
        self.source = source
        self.problems: list[Problem] = []
        self.warnings: list[str] = []

    # -- primitives
    def err(self, path: str, value, message: str) -> None:
        self.problems.append(Problem(path, value, message))

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

    def unknown_keys(self, mapping: dict, schema_key: str) -> None:
        allowed = SCHEMA[schema_key]
        for key in mapping:
            if not schema_key and isinstance(key, str) and key.startswith("x-"):
                continue  # top-level x-* keys hold YAML anchors for merge keys (<<: *x-defaults)
            if key not in allowed:
                path = f"{schema_key}.{key}" if schema_key else str(key)
                hint = difflib.get_close_matches(str(key), sorted(allowed), n=1)
                rule = (f"unknown key; did you mean {hint[0]!r}?" if hint
                        else f"unknown key; allowed: {', '.join(sorted(allowed))}")
                self.err(path, NO_VALUE, rule)

    def integer(self, mapping: dict, key: str, path: str, *, default=NO_VALUE, minimum: int | None = 1):
        value = mapping.get(key, NO_VALUE)
        if value is NO_VALUE:
            if default is NO_VALUE:
                self.err(path, NO_VALUE, "is required")
                return None
            return default
        return self.check_int(value, path, minimum, maximum=LIMITS.get(key, 2**31 - 1))

    def check_int(self, value, path: str, minimum: int | None = 1, *, maximum: int = 2**31 - 1):
        if isinstance(value, bool) or not isinstance(value, int):
            self.err(path, value, "must be an integer" + (" (not a float)" if isinstance(value, float) else ""))
            return None
        if minimum is not None and value < minimum:
            self.err(path, value, f"must be >= {minimum}" if minimum != 1 else "must be a positive integer")
            return None
        if value > maximum:
            self.err(path, value, f"must be <= {maximum}")
            return None
        return value

    def boolean(self, mapping: dict, key: str, path: str, default: bool):
        value = mapping.get(key, default)
        if not isinstance(value, bool):
            self.err(path, value, "must be true or false")
            return default
        return value

    def choice(self, mapping: dict, key: str, path: str, choices, default):
        value = mapping.get(key, default)
        if value not in choices or isinstance(value, bool):
            hint = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            more = f"; did you mean {hint[0]!r}?" if hint else ""
            self.err(path, value, f"must be one of {', '.join(map(str, choices))}{more}")
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

    # -- sections
    def run(self, raw: object) -> Recipe | None:
        if not isinstance(raw, dict):
            self.err("(top level)", raw if raw is None or isinstance(raw, (str, int, list)) else type(raw).__name__,
                     "a recipe must be a YAML mapping")
            return None
        self.unknown_keys(raw, "")
        name, version = self.header(raw)
        serving = self.serving(self.section(raw, "serving", "serving", required=True))
        model, cfg = self.model(self.section(raw, "model", "model", required=True))
        nc = self.section(raw, "neuron_config", "neuron_config", required=True)
        par = self.section(raw, "parallel", "parallel")
        parallel = {k: self.integer(par, k, f"parallel.{k}", default=1) for k in ("tp", "dp", "ep")}
        num_seqs, ctx = self.buckets(nc, serving)
        gk = self.boolean(nc, "gk_decode", "neuron_config.gk_decode", True)
        fp8 = self.boolean(nc, "fp8_packed_kv", "neuron_config.fp8_packed_kv", False)
        lnc = nc.get("lnc", 1)
        if type(lnc) is not int or lnc not in (1, 2):
            self.err("neuron_config.lnc", lnc, "must be 1 or 2 (logical NeuronCore config)")
            lnc = 1
        spec = self.speculative(raw, cfg)
        compiler = self.compiler(self.section(raw, "compiler", "compiler"), num_seqs, ctx, serving, raw)
        build = self.build(self.section(raw, "build", "build"))
        if cfg is not None:
            self.cross_checks(cfg, serving, parallel, ctx, gk, spec)
            parallel_rules.check(self.err, cfg, parallel, compiler, lnc)
        if self.problems:
            return None
        return Recipe(
            name=name, version=version, model=model, **serving,
            num_seqs_buckets=tuple(num_seqs), decode_context_length_buckets=tuple(ctx),
            gk_decode=gk, fp8_packed_kv=fp8, lnc=lnc, speculative=spec, **compiler, **build, **parallel,
            source=self.source, warnings=tuple(self.warnings),
        )

    def header(self, raw: dict) -> tuple:
        name = raw.get("name", NO_VALUE)
        if name is NO_VALUE:
            self.err("name", NO_VALUE, "is required")
        elif not isinstance(name, str) or not NAME_RE.fullmatch(name):
            self.err("name", name, "must match [a-z0-9][a-z0-9._-]* (it names the bundle folder)")
        version = raw.get("version", NO_VALUE)
        if version is NO_VALUE:
            self.err("version", NO_VALUE, "is required")
        elif not isinstance(version, str) or not SEMVER_RE.fullmatch(version):
            self.err("version", version, "must be a semantic version string such as '0.1.0' (quote it in YAML)")
        return name, version

    def compiler(self, comp: dict, num_seqs, ctx, serving: dict, raw: dict) -> dict:
        optlevel = comp.get("optlevel", 2)
        if type(optlevel) is not int or optlevel not in (1, 2, 3):
            self.err("compiler.optlevel", optlevel, "must be 1, 2 or 3")
            optlevel = 2
        flags = comp.get("flags", [])
        if not isinstance(flags, list) or not all(isinstance(f, str) and f.isprintable() for f in flags):
            self.err("compiler.flags", flags, "must be a list of strings without control characters")
            flags = []
        return {
            "backend": self.choice(comp, "backend", "compiler.backend", BACKENDS, "auto"),
            "target": self.choice(comp, "target", "compiler.target", TARGETS, "trn2"),
            "optlevel": optlevel,
            "flags": tuple(flags),
            "target_flags": self.target_flags(comp.get("target_flags", {}), num_seqs, ctx, serving, raw),
        }

    def build(self, bld: dict) -> dict:
        jobs = self.integer(bld, "jobs", "build.jobs", default=None)
        cache_dir = bld.get("cache_dir")
        if cache_dir is not None and (not isinstance(cache_dir, str) or "\x00" in cache_dir):
            self.err("build.cache_dir", cache_dir, "must be a path string")
            cache_dir = None
        if cache_dir:
            cache_dir = self.expand(cache_dir, "build.cache_dir")
        return {"jobs": jobs, "cache_dir": cache_dir or None}

    def target_flags(self, value, num_seqs, ctx, serving: dict, raw: dict):
        """compiler.target_flags: {label: [flags]} for single targets (labels must be in the grid)."""
        path = "compiler.target_flags"
        if not isinstance(value, dict):
            self.err(path, value, "must be a mapping of target label -> list of flags")
            return ()
        labels = None
        if num_seqs and ctx is not None and serving["max_model_len"]:
            from neffbuild.grid import enumerate_targets

            spec = raw.get("speculative") if isinstance(raw.get("speculative"), dict) else {}
            k = spec.get("num_speculative_tokens", 0) if isinstance(spec.get("num_speculative_tokens", 0), int) else 0
            labels = {t.label for t in enumerate_targets(num_seqs, ctx, serving["max_model_len"], k)}
        out = []
        for label, flags in value.items():
            if labels is not None and label not in labels:
                hint = difflib.get_close_matches(str(label), sorted(labels), n=1)
                self.err(f"{path}.{label}", NO_VALUE, "is not a target of this recipe"
                         + (f"; did you mean {hint[0]!r}?" if hint else " (see `neffbuild plan`)"))
            elif not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
                self.err(f"{path}.{label}", flags, "must be a list of strings")
            else:
                out.append((str(label), tuple(flags)))
        return tuple(sorted(out))

    def serving(self, s: dict) -> dict:
        keys = ("max_model_len", "max_num_seqs", "block_size", "num_blocks")
        return {k: self.integer(s, k, f"serving.{k}") for k in keys}

    def model(self, m: dict):
        arch = m.get("arch", NO_VALUE)
        if arch is NO_VALUE:
            self.err("model.arch", NO_VALUE, "is required")
        elif arch not in KNOWN_ARCHS:
            hint = difflib.get_close_matches(str(arch), KNOWN_ARCHS, n=1)
            self.err("model.arch", arch, f"unknown architecture; known: {', '.join(KNOWN_ARCHS)}"
                     + (f"; did you mean {hint[0]!r}?" if hint else ""))
        has_ck, has_seed = "checkpoint" in m, "random_seed" in m
        checkpoint = seed = None
        if has_ck == has_seed:
            self.err("model", NO_VALUE, "set exactly one of model.checkpoint (a folder) or model.random_seed (an int)")
        if has_ck:
            checkpoint = self.path_value(m["checkpoint"], "model.checkpoint", want_dir=True)
        if has_seed:
            seed = self.check_int(m["random_seed"], "model.random_seed", minimum=0)
        hf = self.hf_config(m.get("config"), "model.config", checkpoint)
        if hf is None:
            return None, None
        arch = arch if isinstance(arch, str) else ""
        cfg = self.arch_config(hf, "model.config", arch)
        return ModelSpec(arch=arch, hf_config=hf, checkpoint=checkpoint, random_seed=seed), cfg

    def hf_config(self, value, path: str, checkpoint: Path | None) -> dict | None:
        if value is None:
            if checkpoint is None:
                self.err(path, NO_VALUE, "is required with random_seed (inline keys or a path to config.json)")
                return None
            value_path = checkpoint / "config.json"
            if not value_path.exists():
                self.err(path, NO_VALUE, f"not given and {value_path} does not exist")
                return None
            return self._read_json(value_path, path)
        if isinstance(value, str):
            p = self.path_value(value, path, want_dir=False)
            if p is None:
                return None
            if p.is_dir():
                p = p / "config.json"
            return self._read_json(p, path)
        if isinstance(value, dict):
            return dict(value)
        self.err(path, value, "must be a mapping of Hugging Face config keys or a path to config.json")
        return None

    def _read_json(self, p: Path, path: str) -> dict | None:
        from neffbuild.recipe import (
            read_regular_file,  # the one bounded, regular-file-only reader
        )

        try:
            data = json.loads(read_regular_file(p, "config.json"), parse_constant=_no_constant)
        except NeffbuildError as exc:
            self.err(path, str(p), str(exc).splitlines()[-1].removeprefix("  - (file): "))
            return None
        except (ValueError, RecursionError) as exc:
            self.err(path, str(p), f"is not a readable JSON file: {str(exc)[:160]}")
            return None
        if not isinstance(data, dict):
            self.err(path, str(p), "must hold a JSON object")
            return None
        return data

    def arch_config(self, hf: dict, path: str, arch: str):
        """The architecture's config from Hugging Face keys (None: unknown architecture or bad keys)."""
        if arch not in registry.ARCHITECTURES:
            return None
        config_cls = registry.arch(arch).get("config")
        if not config_rules.check_numbers(self, hf, path, config_cls):
            return None
        cfg = config_cls.from_hf_dict(hf)
        if len(cfg.layer_types) != cfg.num_hidden_layers:
            self.err(f"{path}.layer_types", len(cfg.layer_types),
                     f"must have num_hidden_layers ({cfg.num_hidden_layers}) entries")
            return None
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            self.err(f"{path}.num_attention_heads", cfg.num_attention_heads,
                     f"must be a multiple of num_key_value_heads ({cfg.num_key_value_heads})")
        if cfg.num_experts_per_tok > cfg.num_local_experts:
            self.err(f"{path}.num_experts_per_tok", cfg.num_experts_per_tok,
                     f"must be <= num_local_experts ({cfg.num_local_experts})")
        return cfg

    def int_list(self, value, path: str) -> list[int] | None:
        if not isinstance(value, list) or len(value) > 1024:
            self.err(path, value, "must be a list of at most 1024 integers")
            return None
        if not value:
            self.err(path, value, "must not be empty")
            return None
        out, ok = [], True
        for i, item in enumerate(value):
            if isinstance(item, bool) or not isinstance(item, int):
                self.err(f"{path}[{i}]", item, "must be an integer")
                ok = False
            elif not 0 < item <= LIMITS["max_model_len"]:
                self.err(f"{path}[{i}]", item, f"must be > 0 and <= {LIMITS['max_model_len']}")
                ok = False
            else:
                out.append(item)
        if not ok:
            return None
        for i in range(1, len(out)):
            if out[i] <= out[i - 1]:
                self.err(f"{path}[{i}]", out[i], f"must be strictly ascending (previous is {out[i - 1]})")
                ok = False
        return out if ok else None

    def buckets(self, nc: dict, serving: dict):
        mns, mml = serving["max_num_seqs"], serving["max_model_len"]
        path = "neuron_config.num_seqs_buckets"
        if "num_seqs_buckets" in nc:
            num_seqs = self.int_list(nc["num_seqs_buckets"], path)
            if num_seqs and mns is not None and num_seqs[-1] != mns:
                self.err(f"{path}[{len(num_seqs) - 1}]", num_seqs[-1],
                         f"the last bucket must equal serving.max_num_seqs ({mns})")
        else:
            num_seqs = default_num_seqs_buckets(mns) if mns else None
        path = "neuron_config.decode_context_length_buckets"
        if "decode_context_length_buckets" not in nc:  # as in vLLM's Neuron plugin: absent = the feature is off
            self.warnings.append(f"{path}: absent, so no context buckets are compiled; every step runs the "
                                 "max_model_len fallback (list multiples of 128 to compile smaller context buckets)")
            return num_seqs, []
        ctx = self.int_list(nc["decode_context_length_buckets"], path)
        if ctx is None:
            return num_seqs, None
        ok = True
        for i, c in enumerate(ctx):
            if c % P_MAX:
                self.err(f"{path}[{i}]", c, f"must be divisible by {P_MAX} (the attention tile)")
                ok = False
            elif mml is not None and c > mml:
                self.err(f"{path}[{i}]", c, f"must be <= serving.max_model_len ({mml})")
                ok = False
        if not ok:
            return num_seqs, None
        for c in ctx:
            if c & (c - 1):
                self.warnings.append(
                    f"{path}: {c} is not a power of two; "
                    "non-power-of-two buckets measured up to 1.87x slower (1920 vs 2048)"
                )
        if mml is not None and ctx and ctx[-1] == mml:
            ctx = ctx[:-1]  # folded into the always-compiled fallback
        return num_seqs, ctx

    def speculative(self, raw: dict, cfg) -> Speculative | None:
        if raw.get("speculative") is None:
            return None  # absent, or an empty `speculative:` line
        s = self.section(raw, "speculative", "speculative")
        if not s:
            if isinstance(raw.get("speculative"), dict):
                self.err("speculative", {}, "is empty; set method, num_speculative_tokens and draft, or remove it")
            return None
        method = self.choice(s, "method", "speculative.method", SPEC_METHODS, "eagle3")
        k = self.integer(s, "num_speculative_tokens", "speculative.num_speculative_tokens")
        d = self.section(s, "draft", "speculative.draft")
        ck = seed = None
        if ("checkpoint" in d) == ("random_seed" in d):
            self.err("speculative.draft", NO_VALUE, "set exactly one of draft.checkpoint or draft.random_seed")
        if "checkpoint" in d:
            ck = self.path_value(d["checkpoint"], "speculative.draft.checkpoint", want_dir=True)
        if "random_seed" in d:
            seed = self.check_int(d["random_seed"], "speculative.draft.random_seed", minimum=0)
        draft_cfg = d.get("config")
        if draft_cfg is not None or (ck is not None and (ck / "config.json").exists()):
            draft_cfg = self.hf_config(draft_cfg, "speculative.draft.config", ck)
            if draft_cfg is not None and config_rules.check_numbers(
                    self, draft_cfg, "speculative.draft.config", type(cfg) if cfg is not None else _default_config()):
                draft_cfg = dict(draft_cfg)
            else:
                draft_cfg = None
        elif cfg is not None:
            # Derived from the target: same widths and heads, one layer.
            draft_cfg = dict(cfg.to_hf_dict(), num_hidden_layers=1, layer_types=[cfg.FULL])
        if k is None:
            return None
        return Speculative(method, k, ck, seed, draft_cfg or {})

    def cross_checks(self, cfg, serving: dict, par: dict, ctx, gk: bool, spec) -> None:
        """Rules across sections; each runs only when the values it needs are themselves valid."""
        mml, bs = serving["max_model_len"], serving["block_size"]
        nb, mns = serving["num_blocks"], serving["max_num_seqs"]
        if mml and mml > cfg.max_position_embeddings:
            self.err("serving.max_model_len", mml,
                     f"must be <= model.config.max_position_embeddings ({cfg.max_position_embeddings})")
        if nb and bs and nb * bs * cfg.num_kv_buffers * 2 * cfg.num_key_value_heads * cfg.head_dim * 4 > MAX_KV_BYTES:
            self.err("serving.num_blocks", nb, f"the KV pool would exceed {MAX_KV_BYTES >> 30} GiB "
                     "(num_blocks x block_size x layers x kv_heads x head_dim)")
        if mml and bs and nb:
            self.pool_size(cfg, mml, bs, nb, mns, 1 + (spec.num_speculative_tokens if spec else 0))
        if gk:
            self.gk_layout(cfg)
        if cfg.has_sliding_layers and bs:
            if bs > P_MAX:
                self.err("serving.block_size", bs, f"must be <= {P_MAX} for models with sliding-window layers")
            elif ctx and mml:
                query_len = 1 + (spec.num_speculative_tokens if spec else 0)
                width = num_swa_blocks(cfg.sliding_window, bs, mml, query_len) * bs
                for i, c in enumerate(ctx):
                    if c < width:
                        self.err(f"neuron_config.decode_context_length_buckets[{i}]", c,
                                 f"must be >= the sliding-window table width ({width} tokens = num_swa x block_size)")
        if ctx and bs:
            for i, c in enumerate(ctx):
                if c % bs:
                    self.err(f"neuron_config.decode_context_length_buckets[{i}]", c,
                             f"must be a multiple of serving.block_size ({bs})")
        if spec is not None and mml and mml <= spec.num_speculative_tokens + 1:
            self.err("speculative.num_speculative_tokens", spec.num_speculative_tokens,
                     f"leaves no room in max_model_len ({mml})")

    def pool_size(self, cfg, mml: int, bs: int, nb: int, mns: int | None, query_len: int) -> None:
        """The block manager's formula (runtime/blocks.py): whatever validates can serve."""
        groups = kv_groups(cfg.sliding_window if cfg.has_sliding_layers else None)
        one = min_pool_blocks(mml, bs, groups, query_len)
        what = " + ".join(f"{group_blocks(mml, bs, g.window, query_len)} {g.name}" for g in groups) + " + 1 null block"
        if nb < one:
            self.err("serving.num_blocks", nb, f"must be >= {one} to hold one max_model_len ({mml}) sequence "
                                               f"({what}; docs/recipe.md)")
        elif mns and nb < min_pool_blocks(mml, bs, groups, query_len, mns):
            self.warnings.append(
                f"serving.num_blocks: {nb} blocks hold {(nb - 1) // (one - 1)} max_model_len sequences at once, fewer "
                f"than max_num_seqs ({mns}; that needs {min_pool_blocks(mml, bs, groups, query_len, mns)}); "
                f"long requests will queue")

    def gk_layout(self, cfg) -> None:
        L = cfg.num_hidden_layers
        if L % 2:
            self.err("model.config.num_hidden_layers", L, "must be even for gk_decode (layers pair up on KV buffers)")
        for i, t in enumerate(cfg.layer_types):
            want = cfg.SLIDING if i % 2 == 0 else cfg.FULL
            if t != want:
                self.err(f"model.config.layer_types[{i}]", t,
                         f"must be {want!r} for gk_decode (even layers sliding, odd full)")


def _default_config():
    return registry.arch(next(iter(registry.ARCHITECTURES))).get("config")


def _no_constant(name: str):
    raise ValueError(f"{name} is not standard JSON")
