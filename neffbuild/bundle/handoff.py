"""What a bundle tells a serving engine: vLLM's settings for exactly the compiled grid.

vLLM Neuron reads its bucket grid from ``--additional-config '{"neuron_config": {...}}'``
(keys ``num_seqs_buckets``, ``decode_context_length_buckets``, ``gk_decode``,
``fp8_packed_kv``, ``lnc``) and EAGLE3 from ``--speculative-config``; the serving shape
(``--max-model-len``, ``--max-num-seqs``, ``--block-size``, the KV pool size, parallel
degrees) must equal what the graphs were compiled for. A missing
``decode_context_length_buckets`` means "fallback only" to vLLM, so a bundle without
context buckets leaves the key out. vLLM loads the EAGLE3 draft itself, from
``speculative_config.model``: the key is always present, the draft checkpoint's path when
the recipe names one, else null with a warning saying how to get one (a random draft has
no checkpoint vLLM could load).
"""

from __future__ import annotations

import json
import shlex

from neffbuild import engine_flags


def neuron_config(manifest: dict, recipe: dict) -> dict:
    gi = manifest["graph_inputs"]
    out = {"num_seqs_buckets": list(gi["num_seqs_buckets"])}
    if gi["decode_context_length_buckets"]:
        out["decode_context_length_buckets"] = list(gi["decode_context_length_buckets"])
    out["gk_decode"] = bool(recipe.get("neuron_config", {}).get("gk_decode", True))
    out["fp8_packed_kv"] = bool(gi["fp8_packed_kv"])
    out["lnc"] = gi["lnc"]
    return out


def speculative_config(manifest: dict, recipe: dict) -> dict | None:
    k = manifest["graph_inputs"].get("num_speculative_tokens", 0)
    if not k:
        return None
    spec = recipe.get("speculative") or {}
    draft = (spec.get("draft") or {}).get("checkpoint")
    method = manifest["graph_inputs"]["speculative_method"]  # the bundle gate checked it names a method
    return {"method": method, "model": draft or None, "num_speculative_tokens": k}


def warnings(manifest: dict, recipe: dict) -> list[str]:
    """What the printed settings cannot give vLLM (today: a draft without a checkpoint)."""
    config = speculative_config(manifest, recipe)
    if config is None or config["model"]:
        return []
    seed = ((recipe.get("speculative") or {}).get("draft") or {}).get("random_seed")
    return [f"speculative_config.model: this bundle's {config['method']} draft has random weights "
            f"(speculative.draft.random_seed: {seed}), so there is no draft checkpoint for vLLM to load; set "
            "speculative.draft.checkpoint to the draft's folder and recompile"]


def engine_args(manifest: dict) -> dict:
    gi = manifest["graph_inputs"]
    return {"max_model_len": gi["max_model_len"], "max_num_seqs": gi["num_seqs_buckets"][-1],
            "block_size": gi["block_size"], "num_gpu_blocks_override": gi["num_blocks"],
            "tensor_parallel_size": gi["tp"], "data_parallel_size": gi["dp"]}


def vllm_config(manifest: dict, recipe: dict) -> dict:
    """{additional_config, speculative_config, engine_args, warnings} for the compiled grid."""
    return {"additional_config": {"neuron_config": neuron_config(manifest, recipe)},
            "speculative_config": speculative_config(manifest, recipe), "engine_args": engine_args(manifest),
            "warnings": warnings(manifest, recipe)}


def vllm_flags(config: dict) -> str:
    """The vLLM command-line flags that must accompany ``--additional-config``."""
    flags = [f"--{k.replace('_', '-')} {v}" for k, v in config["engine_args"].items()]
    if config["speculative_config"]:
        flags.append(f"--speculative-config {shlex.quote(json.dumps(config['speculative_config']))}")
    flags.append(f"--additional-config {shlex.quote(json.dumps(config['additional_config']))}")
    return " ".join(flags)


# -- the neffbuild vLLM plugin (neffbuild/vllm, docs/vllm.md): vLLM on CPU serving an inductor bundle

PLUGIN_KEY = "neffbuild"  # the plugin's section of vLLM's --additional-config (neffbuild/vllm/config.py)


def kv_pool_bytes(facts) -> int:
    """The bytes of the bundle's KV pool in vLLM's tensors (its target layers; rounded up to a MiB). An EAGLE3
    draft's layer adds none: vLLM's hybrid KV manager gives it a KV cache group of its own, whose blocks come from
    the same pool and tensor (neffbuild/vllm/decode.py ``draft_buffer``)."""
    layout = facts.graph_inputs.kv_layout
    return -(-layout.target_bytes // 2**20) * 2**20


def cpu_binding(ranks: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` vLLM CPU workers on this host: its usable CPUs in ``ranks``
    contiguous parts, one per rank in vLLM's order (DP rank, then TP rank), e.g. ``0|1`` for 2 ranks on 2 CPUs."""
    import os

    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cpus) < ranks:
        cpus = (cpus * ranks)[:ranks]  # fewer CPUs than ranks: ranks share CPUs
    size = len(cpus) // ranks
    parts = [cpus[i * size:(i + 1) * size if i < ranks - 1 else len(cpus)] for i in range(ranks)]
    return "|".join(",".join(map(str, p)) for p in parts)


# vLLM's drafter hands its model the rows each request verified (rejected drafts dropped) only in its unpadded
# mode; the plugin's draft forward runs the bundle's draft graph on exactly those rows (docs/vllm.md).
UNPADDED_DRAFTS = "disable_padded_drafter_batch"


def plugin_speculative_config(root, facts) -> dict | None:
    """vLLM's ``--speculative-config`` for an EAGLE3 bundle (None without drafts): the bundle's method and k, its
    ``draft/`` folder as the draft model (written from the bundle's own draft tensors), the unpadded drafter."""
    from pathlib import Path

    from neffbuild.bundle import paths

    if not facts.num_speculative_tokens:
        return None
    return {"method": facts.speculative_method, "model": str(Path(root).resolve() / paths.DRAFT_DIR),
            "num_speculative_tokens": facts.num_speculative_tokens, UNPADDED_DRAFTS: True}


def plugin_config(root, manifest: dict, recipe: dict) -> dict:
    """{command, env, engine_args, additional_config, model, warnings}: ``vllm serve`` with the plugin, for this
    bundle, started on the bundle folder itself.

    The bundle is all the host needs: vLLM reads the model's config from the bundle's ``config.json``, loads no
    weights (``--load-format dummy``: the plugin computes with the bundle's own memory-mapped weights, one copy)
    and takes its KV memory from the bundle's pool, so the line starts on a host that is not otherwise idle.
    """
    from pathlib import Path

    from neffbuild.runtime.bundle.facts import facts_of

    facts = facts_of(manifest)
    dtype, kv_cache_dtype = facts.engine_dtypes()  # the plugin's start-up check compares the same two
    args = {"dtype": dtype, "enforce_eager": True, "load_format": "dummy", "skip_tokenizer_init": True,
            **engine_args(manifest)}
    if kv_cache_dtype != "auto":
        args["kv_cache_dtype"] = kv_cache_dtype
    if facts.parallel.ep > 1:  # the bundle splits its experts: vLLM's expert parallelism (its EP group: every rank)
        args["enable_expert_parallel"] = True
    spec = plugin_speculative_config(root, facts)
    if spec is not None:
        args["speculative_config"] = spec
    # vLLM CPU sizes its KV memory from a fraction of the host (0.92 by default) and refuses to start on a host
    # where less than that is free; the bundle fixes the pool, so the memory it needs is known: its bytes.
    args["kv_cache_memory_bytes"] = kv_pool_bytes(facts)
    model = str(Path(root).resolve())
    extra = {PLUGIN_KEY: {"bundle": model}}
    warn = ["the bundle carries no tokenizer: prompts must be token ids (--skip-tokenizer-init); for text "
            "prompts replace it with --tokenizer and the model's tokenizer"]
    env = {"PROMETHEUS_MULTIPROC_DIR": "$(mktemp -d)"}  # the engine core's counters on vLLM's /metrics
    if facts.parallel.world_size > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(facts.parallel.world_size)
        warn.append(f"VLLM_CPU_OMP_THREADS_BIND: this host's CPUs split over the {facts.parallel.world_size} ranks "
                    "(vLLM's default binds one NUMA node per rank and refuses to start with fewer nodes than "
                    "ranks); on a host with a NUMA node per rank 'auto' binds by node")
    flags = [shlex.quote(a) for a in engine_flags.argv(args)]
    flags.append(f"--additional-config {shlex.quote(json.dumps(extra))}")
    shown = [f"{k}={v if v.startswith('$(') else shlex.quote(v)}" for k, v in env.items()]  # "0|1" quoted
    line = " ".join([*shown, "vllm", "serve", shlex.quote(model), *flags])
    return {"command": line, "env": env, "engine_args": args, "additional_config": extra, "model": model,
            "warnings": warn}

