"""Every recipe validation rule (DESIGN.md section 4), collected, never first-error-only.

``Validator.run`` reads the sections in order and hands each to its rule module:
``model_rules`` (model, speculative), ``serving_rules`` (serving, buckets, cross-section
rules), ``parallel_rules``, ``compiler_rules`` (compiler, build). The primitives they share
are ``checks.Checks``. Backend and architecture choices come from ``registry``.
"""

from __future__ import annotations

import re

from neffbuild import memory
from neffbuild.errors import NO_VALUE
from neffbuild.recipe import compiler_rules, dtype_rules, gate_rules, model_rules, parallel_rules, serving_rules
from neffbuild.recipe.checks import LIMITS, SCHEMA, Checks
from neffbuild.recipe.types import Recipe

__all__ = ["LIMITS", "SCHEMA", "Validator"]

NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,99}")  # fullmatch: no trailing newline, no control characters
SEMVER_RE = re.compile(r"[0-9]{1,9}\.[0-9]{1,9}\.[0-9]{1,9}(?:-[0-9A-Za-z.-]{1,64})?(?:\+[0-9A-Za-z.-]{1,64})?")


class Validator(Checks):
    def run(self, raw: object) -> Recipe | None:
        if not isinstance(raw, dict):
            self.err("(top level)", raw if raw is None or isinstance(raw, (str, int, list)) else type(raw).__name__,
                     "a recipe must be a YAML mapping")
            return None
        self.unknown_keys(raw, "")
        name, version = self.header(raw)
        serving = serving_rules.serving(self, self.section(raw, "serving", "serving", required=True))
        model, cfg = model_rules.model(self, self.section(raw, "model", "model", required=True))
        nc = self.section(raw, "neuron_config", "neuron_config", required=True)
        par = self.section(raw, "parallel", "parallel")
        parallel = {k: self.integer(par, k, f"parallel.{k}", default=1) for k in ("tp", "dp", "ep")}
        num_seqs, ctx = serving_rules.buckets(self, nc, serving)
        gk = self.boolean(nc, "gk_decode", "neuron_config.gk_decode", True)
        fp8 = self.boolean(nc, "fp8_packed_kv", "neuron_config.fp8_packed_kv", False)
        kv_dtype = dtype_rules.kv_dtype(self, nc, fp8)
        lnc = nc.get("lnc", 1)
        if type(lnc) is not int or lnc not in (1, 2):
            self.err("neuron_config.lnc", lnc, "must be 1 or 2 (logical NeuronCore config)")
            lnc = 1
        spec = model_rules.speculative(self, raw, cfg)
        compiler = compiler_rules.compiler(self, self.section(raw, "compiler", "compiler"), num_seqs, ctx, serving,
                                           raw)
        build = compiler_rules.build(self, self.section(raw, "build", "build"))
        if cfg is not None:
            serving_rules.cross_checks(self, cfg, serving, ctx, gk, spec)
            parallel_rules.check(self.err, cfg, parallel, compiler, lnc, spec)
            memory.check_recipe(self.err, cfg, serving, parallel, fp8, spec, compiler, kv_dtype)  # backend KV rule
            if model is not None:
                dtype_rules.check(self.err, cfg, model.experts)
                dtype_rules.check_kernels(self.err, model, compiler["backend"])
        gate_rules.check(self, cfg, serving, fp8, spec, model, num_seqs, ctx)
        if self.problems:
            return None
        return Recipe(
            name=name, version=version, model=model, **serving,
            num_seqs_buckets=tuple(num_seqs), decode_context_length_buckets=tuple(ctx),
            gk_decode=gk, fp8_packed_kv=fp8, lnc=lnc, speculative=spec, **compiler, **build, **parallel,
            source=self.source, warnings=tuple(self.warnings), kv_dtype=kv_dtype,
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

    def arch_config(self, hf: dict, path: str, arch: str):
        """The architecture's config from Hugging Face keys, checked (None: not valid); see model_rules."""
        return model_rules.arch_config(self, hf, path, arch)
