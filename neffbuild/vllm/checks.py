"""Does a bundle fit vLLM's configuration? Every mismatch, named by the vLLM flag that sets it, both values.

Pure Python over two plain views (no vLLM, no torch import), so the rules are testable anywhere and the plugin
(neffbuild/vllm/model.py) only has to read vLLM's config into ``Engine``. A bundle's compiled shape fixes the
model, the dtype, ``max_model_len``, ``block_size``, the KV pool (``num_blocks`` is a graph input's shape) and the
largest batch; vLLM must be started with exactly those, or nothing serves (fail closed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Config keys both sides must agree on (the graph's shapes and constants); compared when both sides have them.
MODEL_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "num_local_experts", "num_experts_per_tok", "sliding_window",
              "rms_norm_eps", "swiglu_limit", "rope_parameters")
MODEL_FLAG = "the checkpoint (vllm serve MODEL / --hf-overrides)"


@dataclass(frozen=True)
class Engine:
    """What the plugin reads of vLLM's configuration."""

    model_config: dict  # the checkpoint's Hugging Face config as vLLM loaded it
    dtype: str  # "float32", ...
    max_model_len: int
    block_size: int | None
    num_gpu_blocks_override: int | None
    max_num_seqs: int
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    expert_parallel: bool = False  # --enable-expert-parallel (vLLM's EP group: every tp x dp rank)
    kv_heads_per_rank: int | None = None  # the KV heads vLLM gives one TP rank (None: not known yet)
    num_speculative_tokens: int = 0
    speculative_method: str | None = None
    draft_config: dict = field(default_factory=dict)  # the draft model's config as vLLM loaded it (DRAFT_KEYS)
    aux_layers: tuple[int, ...] = ()  # the target states vLLM's drafter reads (id i: the stream entering layer i)
    unpadded_drafts: bool = False  # speculative_config.disable_padded_drafter_batch


@dataclass(frozen=True)
class Compiled:
    """What the bundle was compiled for (from its manifest's graph_inputs)."""

    model_config: dict
    max_model_len: int
    block_size: int
    num_blocks: int
    num_seqs_buckets: tuple[int, ...]
    dtype: str = "float32"  # the model dtype vLLM must run (the bundle facts' engine_dtypes)
    kv_cache_dtype: str = "auto"  # vLLM's --kv-cache-dtype for the bundle's KV buffers
    tp: int = 1
    dp: int = 1
    ep: int = 1
    kv_heads_per_rank: int | None = None  # the KV heads one rank's buffers hold (every TP rank alike)
    num_speculative_tokens: int = 0
    speculative_method: str | None = None
    draft_config: dict = field(default_factory=dict)
    aux_layers: tuple[int, ...] = ()  # id i: the residual stream entering layer i (vLLM's and the bundle's numbering)
    extra: dict = field(default_factory=dict)


def _line(flag: str, what: str, engine, bundle, fix: str) -> str:
    return f"{flag}: vLLM has {what} {engine!r}, the bundle was compiled for {bundle!r} ({fix})"


def problems(bundle: Compiled, engine: Engine, *, unresolved: tuple[str, ...] = ()) -> list[str]:
    """One line per mismatch (empty: the bundle fits), each naming the flag, vLLM's value and the bundle's.

    ``unresolved``: Engine fields vLLM has not settled yet (its early configuration: ``block_size`` before its
    platform picks the default), not compared; the check on the final configuration compares them."""
    out = []
    for key in MODEL_KEYS:
        if key in bundle.model_config and key in engine.model_config:
            b, e = bundle.model_config[key], engine.model_config[key]
            if not _same(b, e):
                out.append(_line(MODEL_FLAG, key, e, b, "serve the checkpoint the bundle was compiled from"))
    if engine.dtype != bundle.dtype:
        out.append(_line("--dtype", "dtype", engine.dtype, bundle.dtype, f"pass --dtype {bundle.dtype}"))
    if engine.kv_cache_dtype != bundle.kv_cache_dtype:
        out.append(_line("--kv-cache-dtype", "kv_cache_dtype", engine.kv_cache_dtype, bundle.kv_cache_dtype,
                         f"pass --kv-cache-dtype {bundle.kv_cache_dtype}"))
    out += _unserved(bundle)
    if engine.max_model_len != bundle.max_model_len:
        out.append(_line("--max-model-len", "max_model_len", engine.max_model_len, bundle.max_model_len,
                         f"pass --max-model-len {bundle.max_model_len}"))
    if "block_size" not in unresolved and engine.block_size != bundle.block_size:
        out.append(_line("--block-size", "block_size", engine.block_size, bundle.block_size,
                         f"pass --block-size {bundle.block_size}"))
    if engine.num_gpu_blocks_override != bundle.num_blocks:
        out.append(_line("--num-gpu-blocks-override", "a KV pool of", engine.num_gpu_blocks_override,
                         bundle.num_blocks, f"the pool is part of the compiled shape: pass "
                         f"--num-gpu-blocks-override {bundle.num_blocks}"))
    largest = bundle.num_seqs_buckets[-1]
    if engine.max_num_seqs > largest:
        out.append(_line("--max-num-seqs", "max_num_seqs", engine.max_num_seqs, largest,
                         f"the largest batch bucket; pass --max-num-seqs {largest} or fewer"))
    out += _speculation(bundle, engine)
    out += _parallel(bundle, engine)
    if engine.pipeline_parallel_size != 1:
        out.append(_line("--pipeline-parallel-size", "pipeline_parallel_size", engine.pipeline_parallel_size, 1,
                         "the bundle's decode graph runs every layer"))
    return out


def _parallel(bundle: Compiled, engine: Engine) -> list[str]:
    """vLLM's ranks must be the bundle's: its TP and DP sizes, expert parallelism on exactly when the bundle splits
    its experts (vLLM's EP group is every rank, so the bundle's ep must be tp x dp), and a rank's KV heads."""
    out = [_line(flag, name, e, b, f"pass {flag} {b}")
           for flag, name, e, b in (("--tensor-parallel-size", "tensor_parallel_size", engine.tensor_parallel_size,
                                     bundle.tp),
                                    ("--data-parallel-size", "data_parallel_size", engine.data_parallel_size,
                                     bundle.dp))
           if e != b]
    flag = "--enable-expert-parallel"
    if bundle.ep > 1 and not engine.expert_parallel:
        out.append(_line(flag, "expert parallel", "off", f"ep {bundle.ep}", f"pass {flag}"))
    elif bundle.ep == 1 and engine.expert_parallel:
        out.append(_line(flag, "expert parallel", "on", "ep 1 (experts on every rank)", f"remove {flag}"))
    elif bundle.ep > 1 and not out and bundle.ep != bundle.tp * bundle.dp:
        out.append(_line(flag, "an expert-parallel group of", bundle.tp * bundle.dp, bundle.ep,
                         "vLLM's EP group holds every rank: serve a bundle compiled with ep = tp x dp"))
    if bundle.dp > 1 and engine.num_speculative_tokens:
        out.append(_line(SPEC_FLAG, "num_speculative_tokens", engine.num_speculative_tokens, 0,
                         "the plugin serves a dp > 1 bundle without speculation: remove --speculative-config"))
    if not out and None not in (engine.kv_heads_per_rank, bundle.kv_heads_per_rank) \
            and engine.kv_heads_per_rank != bundle.kv_heads_per_rank:
        out.append(_line("--tensor-parallel-size", "KV heads per rank", engine.kv_heads_per_rank,
                         bundle.kv_heads_per_rank, "serve the checkpoint the bundle was compiled from, at its tp"))
    return out


# The draft's dimensions the bundle's draft graph was compiled for, compared with the draft model vLLM loads.
DRAFT_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
              "vocab_size", "draft_vocab_size")
SPEC_FLAG = "--speculative-config"


def _speculation(bundle: Compiled, engine: Engine) -> list[str]:
    """EAGLE3: vLLM's speculation must be the bundle's (k, method, draft dims, aux layers, the unpadded drafter)."""
    k, ek = bundle.num_speculative_tokens, engine.num_speculative_tokens
    fix = "pass the --speculative-config `neffbuild inspect BUNDLE --vllm-config` prints"
    if ek and ek != k:  # none: an EAGLE3 bundle serves without speculation too (its target_nospec graphs)
        return [_line(SPEC_FLAG, "num_speculative_tokens", ek, k, fix if k else
                      "the bundle has no draft graphs: remove --speculative-config")]
    if not ek:
        return []
    if engine.speculative_method != bundle.speculative_method:
        return [_line(SPEC_FLAG, "method", engine.speculative_method, bundle.speculative_method, fix)]
    out = [_line(SPEC_FLAG, f"a draft model with {key}", engine.draft_config[key], bundle.draft_config[key],
                 f"{fix}: its model is the bundle's draft/ folder")
           for key in DRAFT_KEYS if key in engine.draft_config and key in bundle.draft_config
           and engine.draft_config[key] != bundle.draft_config[key]]
    if engine.aux_layers and tuple(engine.aux_layers) != tuple(bundle.aux_layers):
        out.append(_line(SPEC_FLAG, "draft aux layer ids (eagle_aux_hidden_state_layer_ids)",
                         list(engine.aux_layers), list(bundle.aux_layers), f"{fix}: its model is the bundle's "
                         "draft/ folder"))
    if not engine.unpadded_drafts:
        out.append(_line(SPEC_FLAG, "disable_padded_drafter_batch", False, True,
                         "the plugin's draft graph runs the rows each request verified: pass "
                         '"disable_padded_drafter_batch": true'))
    return out


# What the plugin's eager attention and decode path serve today (docs/vllm.md); a bundle outside these fails
# start-up naming the flag, so it never serves silently wrong. One place: widen it when the plugin does.
SERVED_DTYPES = ("float32", "bfloat16")
SERVED_KV_CACHE_DTYPES = ("auto", "fp8")


def _unserved(bundle: Compiled) -> list[str]:
    out = []
    if bundle.dtype not in SERVED_DTYPES:
        out.append(f"--dtype: the bundle computes in {bundle.dtype}; the plugin serves {', '.join(SERVED_DTYPES)} "
                   "bundles only (docs/vllm.md)")
    if bundle.kv_cache_dtype not in SERVED_KV_CACHE_DTYPES:
        out.append(f"--kv-cache-dtype: the bundle's KV is {bundle.kv_cache_dtype}; the plugin serves KV in the "
                   "model dtype or packed FP8 only (docs/vllm.md)")
    return out


def _same(a, b) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return all(_same(a[k], b[k]) for k in a.keys() & b.keys())
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return abs(float(a) - float(b)) <= 1e-9 * max(1.0, abs(float(a)))
    return a == b
