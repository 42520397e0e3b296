"""Rules for the serving dtypes: ``model.weights_dtype``, ``model.experts`` and ``neuron_config.kv_dtype``.

Defaults keep every recipe that names none of them as it was: float32 weights and KV, dense
experts, except that a checkpoint names its own defaults (its ``config.json`` ``torch_dtype``
/ ``dtype`` bfloat16 gives bfloat16 weights; a ``quantization_config`` with ``quant_method:
mxfp4`` gives MXFP4 experts, kept packed). Combinations no backend can build are refused here,
each naming the key to change.
"""

from __future__ import annotations

WEIGHTS_DTYPES = ("float32", "bfloat16")
EXPERT_FORMS = ("dense", "mxfp4")
KV_DTYPES = ("float32", "bfloat16")
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
