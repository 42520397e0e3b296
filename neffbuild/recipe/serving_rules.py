"""Rules for ``serving`` and ``neuron_config`` (the bucket lists) and the rules across sections
that need the model's config (pool size, sliding-window widths, GK layer pairing: the last
two are the architecture's registry parts, ``kv_pool_bytes``, ``kv_window``, ``check_gk_layout``).

Bucket math and the blocks-needed formula come from the runtime's pure modules
(``runtime/step/buckets.py``, ``runtime/kv/blocks.py``), so what validates is what the runtime serves.
"""

from __future__ import annotations

from neffbuild import registry
from neffbuild.recipe.checks import LIMITS
from neffbuild.runtime.kv.blocks import group_blocks, kv_groups, min_pool_blocks
from neffbuild.runtime.step.buckets import P_MAX, default_num_seqs_buckets, num_swa_blocks

MAX_KV_BYTES = 2**40  # 1 TiB of KV pool is beyond any host; a typo in num_blocks is caught here
SERVING_KEYS = ("max_model_len", "max_num_seqs", "block_size", "num_blocks")


def serving(v, s: dict) -> dict:
    return {k: v.integer(s, k, f"serving.{k}") for k in SERVING_KEYS}


def int_list(v, value, path: str) -> list[int] | None:
    if not isinstance(value, list) or len(value) > 1024:
        v.err(path, value, "must be a list of at most 1024 integers")
        return None
    if not value:
        v.err(path, value, "must not be empty")
        return None
    out, ok = [], True
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int):
            v.err(f"{path}[{i}]", item, "must be an integer")
            ok = False
        elif not 0 < item <= LIMITS["max_model_len"]:
            v.err(f"{path}[{i}]", item, f"must be > 0 and <= {LIMITS['max_model_len']}")
            ok = False
        else:
            out.append(item)
    if not ok:
        return None
    for i in range(1, len(out)):
        if out[i] <= out[i - 1]:
            v.err(f"{path}[{i}]", out[i], f"must be strictly ascending (previous is {out[i - 1]})")
            ok = False
    return out if ok else None


def buckets(v, nc: dict, serving: dict):
    """(num_seqs_buckets, context buckets without a fallback-equal last value); None where invalid."""
    mns, mml = serving["max_num_seqs"], serving["max_model_len"]
    path = "neuron_config.num_seqs_buckets"
    if "num_seqs_buckets" in nc:
        num_seqs = int_list(v, nc["num_seqs_buckets"], path)
        if num_seqs and mns is not None and num_seqs[-1] != mns:
            v.err(f"{path}[{len(num_seqs) - 1}]", num_seqs[-1],
                  f"the last bucket must equal serving.max_num_seqs ({mns})")
    else:
        num_seqs = default_num_seqs_buckets(mns) if mns else None
    path = "neuron_config.decode_context_length_buckets"
    if "decode_context_length_buckets" not in nc:  # as in vLLM's Neuron plugin: absent = the feature is off
        v.warnings.append(f"{path}: absent, so no context buckets are compiled; every step runs the "
                          "max_model_len fallback (list multiples of 128 to compile smaller context buckets)")
        return num_seqs, []
    ctx = int_list(v, nc["decode_context_length_buckets"], path)
    if ctx is None:
        return num_seqs, None
    ok = True
    for i, c in enumerate(ctx):
        if c % P_MAX:
            v.err(f"{path}[{i}]", c, f"must be divisible by {P_MAX} (the attention tile)")
            ok = False
        elif mml is not None and c > mml:
            v.err(f"{path}[{i}]", c, f"must be <= serving.max_model_len ({mml})")
            ok = False
    if not ok:
        return num_seqs, None
    for c in ctx:
        if c & (c - 1):
            v.warnings.append(f"{path}: {c} is not a power of two; "
                              "non-power-of-two buckets measured up to 1.87x slower (1920 vs 2048)")
    if mml is not None and ctx and ctx[-1] == mml:
        ctx = ctx[:-1]  # folded into the always-compiled fallback
    return num_seqs, ctx


def cross_checks(v, cfg, serving: dict, ctx, gk: bool, spec) -> None:
    """Rules across sections; each runs only when the values it needs are themselves valid."""
    mml, bs = serving["max_model_len"], serving["block_size"]
    nb, mns = serving["num_blocks"], serving["max_num_seqs"]
    if mml and mml > cfg.max_position_embeddings:
        v.err("serving.max_model_len", mml,
              f"must be <= model.config.max_position_embeddings ({cfg.max_position_embeddings})")
    arch = registry.arch_of(cfg)
    if nb and bs and arch.get("kv_pool_bytes")(cfg, nb, bs) > MAX_KV_BYTES:
        v.err("serving.num_blocks", nb, f"the KV pool would exceed {MAX_KV_BYTES >> 30} GiB "
              "(num_blocks x block_size x layers x kv_heads x head_dim)")
    if mml and bs and nb:
        pool_size(v, arch.get("kv_window")(cfg), mml, bs, nb, mns, 1 + (spec.num_speculative_tokens if spec else 0))
    if gk:
        arch.get("check_gk_layout")(v.err, cfg)
    if cfg.has_sliding_layers and bs:
        if bs > P_MAX:
            v.err("serving.block_size", bs, f"must be <= {P_MAX} for models with sliding-window layers")
        elif ctx and mml:
            query_len = 1 + (spec.num_speculative_tokens if spec else 0)
            width = num_swa_blocks(cfg.sliding_window, bs, mml, query_len) * bs
            for i, c in enumerate(ctx):
                if c < width:
                    v.err(f"neuron_config.decode_context_length_buckets[{i}]", c,
                          f"must be >= the sliding-window table width ({width} tokens = num_swa x block_size)")
    if ctx and bs:
        for i, c in enumerate(ctx):
            if c % bs:
                v.err(f"neuron_config.decode_context_length_buckets[{i}]", c,
                      f"must be a multiple of serving.block_size ({bs})")
    if spec is not None and mml and mml <= spec.num_speculative_tokens + 1:
        v.err("speculative.num_speculative_tokens", spec.num_speculative_tokens,
              f"leaves no room in max_model_len ({mml})")


def pool_size(v, window: int | None, mml: int, bs: int, nb: int, mns: int | None, query_len: int) -> None:
    """The block manager's formula (runtime/kv/blocks.py): whatever validates can serve."""
    groups = kv_groups(window)
    one = min_pool_blocks(mml, bs, groups, query_len)
    what = " + ".join(f"{group_blocks(mml, bs, g.window, query_len)} {g.name}" for g in groups) + " + 1 null block"
    if nb < one:
        v.err("serving.num_blocks", nb, f"must be >= {one} to hold one max_model_len ({mml}) sequence "
                                        f"({what}; docs/recipe.md)")
    elif mns and nb < min_pool_blocks(mml, bs, groups, query_len, mns):
        v.warnings.append(
            f"serving.num_blocks: {nb} blocks hold {(nb - 1) // (one - 1)} max_model_len sequences at once, fewer "
            f"than max_num_seqs ({mns}; that needs {min_pool_blocks(mml, bs, groups, query_len, mns)}); "
            f"long requests will queue")

