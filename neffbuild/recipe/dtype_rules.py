"""Rules for the serving dtypes: ``model.weights_dtype``, ``model.experts`` and ``neuron_config.kv_dtype``, and
the kernels' numeric forms ``model.expert_kernel`` / ``model.head_kernel`` / ``model.attn_kernel``.

Defaults keep every recipe that names none of them as it was: float32 weights and KV, dense
experts, except that a checkpoint names its own defaults (its ``config.json`` ``torch_dtype``
/ ``dtype`` bfloat16 gives bfloat16 weights; a ``quantization_config`` with ``quant_method:
mxfp4`` gives MXFP4 experts, kept packed). Combinations no backend can build are refused here,
each naming the key to change.
"""

from __future__ import annotations

from neffbuild import registry

WEIGHTS_DTYPES = ("float32", "bfloat16")
EXPERT_FORMS = ("dense", "mxfp4")
KV_DTYPES = ("float32", "bfloat16")
KERNEL_FORMS = ("exact", "int8")  # exact: the float forms (default); int8: runtime/native_q8.py (opt-in)
KERNEL_KEYS = ("expert_kernel", "head_kernel", "attn_kernel")  # model.<key>: the native ops that take a form
MXFP4_GROUP = 32  # values sharing one scale: the reduction axis of every expert weight must hold whole groups


def checkpoint_defaults(hf: dict | None, has_checkpoint: bool) -> tuple[str, str]:
    """(weights dtype, experts form) a checkpoint's config implies; float32 and dense for random weights."""
    if not has_checkpoint or not isinstance(hf, dict):
        return "float32", "dense"
    dtype = hf.get("torch_dtype", hf.get("dtype"))
    quant = hf.get("quantization_config")
    mxfp4 = isinstance(quant, dict) and quant.get("quant_method") == "mxfp4"
    return ("bfloat16" if dtype == "bfloat16" else "float32"), ("mxfp4" if mxfp4 else "dense")


def model_form(v, m: dict, hf: dict | None, has_checkpoint: bool) -> tuple[str, str]:
    """(model.weights_dtype, model.experts), defaults from the checkpoint."""
    dtype, experts = checkpoint_defaults(hf, has_checkpoint)
    return (v.choice(m, "weights_dtype", "model.weights_dtype", WEIGHTS_DTYPES, dtype),
            v.choice(m, "experts", "model.experts", EXPERT_FORMS, experts))


def kernel_forms(v, m: dict) -> tuple[str, str, str]:
    """(model.expert_kernel, model.head_kernel, model.attn_kernel): ``exact`` (default) or ``int8``. The int8 forms
    change the numbers (MXFP4 experts times int8-quantized activations; the LM head read as int8, greedy-exact by
    re-scoring the rows near the maximum; the qkv and o projections read as int8, lossy: runtime/native_q8.py), so
    they are opt-in."""
    return tuple(v.choice(m, key, f"model.{key}", KERNEL_FORMS, "exact") for key in KERNEL_KEYS)


def check_kernels(err, model, backend: str) -> None:
    """The int8 forms are native CPU ops of AOTInductor graphs, over the weights they read: MXFP4 experts for the
    expert kernel, bfloat16 weights for the head and attention kernels (they quantize the bf16 rows)."""
    for key, value, needs, ok in (
            ("expert_kernel", model.expert_kernel, "model.experts: mxfp4 (it multiplies the packed experts)",
             model.experts == "mxfp4"),
            ("head_kernel", model.head_kernel, "model.weights_dtype: bfloat16 (it re-scores in the bf16 head)",
             model.weights_dtype == "bfloat16"),
            ("attn_kernel", model.attn_kernel, "model.weights_dtype: bfloat16 (it quantizes the bf16 qkv and o rows)",
             model.weights_dtype == "bfloat16")):
        if value == "exact":
            continue
        if not ok:
            err(f"model.{key}", value, f"int8 needs {needs}; use {key}: exact")
        entry = registry.BACKENDS.get(registry.AUTO_FLAG_RULES if backend == registry.AUTO else backend)
        if entry is not None and "native_cpu_ops" not in entry.parts:
            with_ops = [name for name, e in registry.BACKENDS.items() if "native_cpu_ops" in e.parts]
            err(f"model.{key}", value, f"int8 is a native CPU op, which compiler.backend {backend} does not call; "
                f"use {key}: exact or compiler.backend: {' or '.join(with_ops)}")


def kv_dtype(v, nc: dict, fp8) -> str:
    """neuron_config.kv_dtype: the KV buffers' dtype; with fp8_packed_kv the buffers are FP8 bytes instead."""
    if "kv_dtype" in nc and fp8 is True:
        v.err("neuron_config.kv_dtype", nc["kv_dtype"], "must be left out with neuron_config.fp8_packed_kv: true "
              "(the FP8 switch already sets the KV storage: e4m3 K packed, e4m3 V); drop one of the two")
        return "float32"
    return v.choice(nc, "kv_dtype", "neuron_config.kv_dtype", KV_DTYPES, "float32")


def check(err, cfg, experts: str) -> None:
    """Cross-section rules: MXFP4 experts need whole 32-value groups on each weight's reduction axis."""
    if experts != "mxfp4":
        return
    for field in ("hidden_size", "intermediate_size"):
        size = getattr(cfg, field)
        if size % MXFP4_GROUP:
            err("model.experts", experts, f"mxfp4 needs model.config.{field} ({size}) divisible by {MXFP4_GROUP} "
                "(one scale per 32 weights of a row); use experts: dense")
