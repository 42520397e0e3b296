"""Verify is the gate: manifest fields ``generate`` reads that the schema left unchecked.

Run by ``check`` (so by ``neffbuild verify`` and by ``open_bundle`` unless ``verify="none"``),
after the schema passed: the EAGLE3 draft's KV layout (present exactly when the bundle has
drafts, its heads and head_dim those of ``graph_inputs.draft_config`` over the target's, the
same buffer every draft artifact records); a ``parallel`` section exactly on a sharded bundle
(tp or ep above 1), with graph_inputs' tp/dp/ep; the model_config fields the step API reads
(vocab_size, hidden_size), then the whole model config under the recipe's own rules
(``config_rules.model_problems``) and the weights' shapes it implies; the speculative method of a
bundle with drafts. What this passes, every engine serves: neffbuild's own and the vLLM plugin
open a bundle through the same ``reader.check``.
``read_digest_line`` reads a bounded prefix of ``manifest.sha256`` (a 12 GB sparse file is an
error, never a MemoryError). Torch-free: the standard library, the registry and the bundle room's types.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from neffbuild import registry
from neffbuild.errors import InvalidInput
from neffbuild.runtime.bundle import config_rules, facts
from neffbuild.runtime.bundle.schema import Problem, is_int, short
from neffbuild.runtime.parallel import ParallelLayout

MAX_DIGEST_BYTES = 4096  # "<64 hex digits>  manifest.json\n" is 81 bytes


def read_digest_line(path: Path) -> str | None:
    """The first line of the digest file, or None when it is missing, not a regular file, too big or not ASCII."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_DIGEST_BYTES:
            return None
        with open(path, "rb") as f:
            return f.read(MAX_DIGEST_BYTES).decode("ascii")[:200]
    except (OSError, UnicodeDecodeError):
        return None


def problems(m: dict) -> list[Problem]:
    gi = m["graph_inputs"]
    out = _model_config(gi)
    if not out:
        cfg, out = config_rules.model_problems(gi["arch"], gi["model_config"])
        out += _weights_fit(m, gi, cfg) if cfg is not None else []
    if out:
        return out + _parallel_presence(m, gi) + _speculative_method(gi)
    spec = _speculative_method(gi)
    return _parallel_presence(m, gi) + spec + (_draft_layout(m, gi, cfg) if not spec and cfg is not None else [])


def _weights_fit(m: dict, gi: dict, cfg) -> list[Problem]:
    """The model config describes the weights the artifacts bind (rank 0's table: every rank's has its shapes)."""
    arch = registry.arch(gi["arch"])
    table = facts.weight_table(m)
    shapes = arch.get("rank_shapes")(cfg, ParallelLayout.from_json(gi), arch.get("experts_of")(table))
    for name, shape in shapes.items():
        entry = table.get(name)
        have = entry.get("shape") if isinstance(entry, dict) else None
        if not isinstance(have, list) or tuple(have) != tuple(shape):
            return [Problem("graph_inputs.model_config", f"implies weight {name!r} of shape {list(shape)}, the "
                            f"bundle's weights hold {have if have is not None else 'none'}: the manifest and weights "
                            "disagree")]
    return []


def _speculative_method(gi: dict) -> list[Problem]:
    method = gi.get("speculative_method")
    if gi["num_speculative_tokens"] and method not in registry.SPECULATIVE:
        return [Problem("graph_inputs.speculative_method", f"got {short(method)}, must name the method the draft "
                        f"was built for ({', '.join(registry.SPECULATIVE)})")]
    return []


def _model_config(gi: dict) -> list[Problem]:
    mc = gi["model_config"]
    return [Problem(f"graph_inputs.model_config.{k}", f"got {short(mc.get(k))}, must be a positive integer")
            for k in ("vocab_size", "hidden_size", "num_key_value_heads", "head_dim") if not is_int(mc.get(k), 1)]


def parallel_presence(m: dict) -> list[Problem]:
    """A ``parallel`` section exactly on a sharded bundle, with graph_inputs' degrees (before the section itself
    is read: a section on an unsharded bundle is named as that, not as a malformed section)."""
    return _parallel_presence(m, m["graph_inputs"])


def _parallel_presence(m: dict, gi: dict) -> list[Problem]:
    sharded = gi["tp"] > 1 or gi["ep"] > 1
    if ("parallel" in m) != sharded:
        return [Problem("parallel", f"{'missing' if sharded else 'present'} on a bundle with graph_inputs tp "
                        f"{gi['tp']}, ep {gi['ep']} (a parallel section belongs exactly to sharded bundles)")]
    par = m.get("parallel")
    if sharded and isinstance(par, dict) and any(par.get(k) != gi[k] for k in ("tp", "dp", "ep")):
        return [Problem("parallel", f"tp/dp/ep {[par.get(k) for k in ('tp', 'dp', 'ep')]} differ from graph_inputs "
                        f"{[gi[k] for k in ('tp', 'dp', 'ep')]}")]
    return []


def _draft_weights_fit(m: dict, method, dcfg, par: ParallelLayout) -> Problem | None:
    """The draft config describes the draft tensors a rank binds (its TP slice; rank 0's table, as the target's)."""
    table = facts.weight_table(m)
    own = "draft_embed" in table
    for name, (shape, _) in method.get("rank_specs")(dcfg, par, "float32", own).items():
        entry = table.get(name)
        have = entry.get("shape") if isinstance(entry, dict) else None
        if not isinstance(have, list) or tuple(have) != tuple(shape):
            return Problem("graph_inputs.draft_config", f"implies draft weight {name!r} of shape {list(shape)} on a "
                           f"rank at tp {par.tp}, the bundle's weights hold {have if have is not None else 'none'}")
    return None


def _draft_layout(m: dict, gi: dict, cfg) -> list[Problem]:
    p = "graph_inputs.kv_layout.draft"
    kv, k = gi["kv_layout"], gi["num_speculative_tokens"]
    draft = kv.get("draft")
    if (draft is not None) != (k > 0):
        return [Problem(p, f"{'missing' if k else 'present'} with num_speculative_tokens {k} (the draft's KV "
                        "group exists exactly when the bundle has EAGLE3 drafts)")]
    if draft is None:
        return []
    dc = gi.get("draft_config") or {}
    if not isinstance(dc, dict):
        return [Problem("graph_inputs.draft_config", "must be an object")]
    method, par = registry.speculative(gi["speculative_method"]), ParallelLayout.from_json(gi)
    try:
        dcfg = method.get("config").from_hf_dict(dc, cfg)
    except (InvalidInput, TypeError, ValueError) as exc:
        return [Problem("graph_inputs.draft_config", f"cannot be read as the draft's config ({short(str(exc), 160)})")]
    why = method.get("layout_problem")(dcfg, par.tp) if par.tp > 1 else None
    if why:
        return [Problem("graph_inputs.draft_config", f"tp {par.tp} {why}")]
    heads = method.get("local_config")(dcfg, par).num_key_value_heads  # the rank's share of the draft's KV heads
    want = [2, kv["buffer_shape"][1], heads, kv["buffer_shape"][3], dcfg.head_dim]
    if not isinstance(draft, dict) or draft.get("num_buffers") != 1 or draft.get("block_table") != "full" \
            or draft.get("buffer_shape") != want:
        return [Problem(p, f"got {short(draft, 160)}, must be {{num_buffers: 1, buffer_shape: {want}, block_table: "
                        "'full'}} (num_blocks and block_size of the target, a rank's share of the heads of "
                        "draft_config over tp, and its head_dim)")]
    problem = _draft_weights_fit(m, method, dcfg, par)
    if problem:
        return [problem]
    for a in m["artifacts"]:
        sig = a.get("input_signature") if a.get("family") == "draft" else None
        rec = [s for s in sig if isinstance(s, dict) and s.get("name") == "kv_cache"] if isinstance(sig, list) else []
        if a.get("family") == "draft" and [s.get("shape") for s in rec] != [want]:
            return [Problem(f"artifacts[{a.get('label')}].input_signature", f"the draft KV buffer it records "
                            f"({short([s.get('shape') for s in rec])}) is not {p}.buffer_shape {want}")]
    return []

