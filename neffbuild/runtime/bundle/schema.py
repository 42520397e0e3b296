"""The manifest's schema: every field ``open_bundle`` trusts, checked before any of it reaches torch.

``problems(m)`` lists what is wrong with a parsed manifest (types, ranges, the grid the artifacts
must cover, labels and files that agree, the weights table, and each artifact's recorded input
signature against the one the runtime will call it with). Each problem names the dotted field.
The digest file (``manifest.sha256``, in ``sha256sum`` format) covers the manifest's own bytes.
Standard library, the runtime's pure modules and the shared ``errors.Problem``.
"""

from __future__ import annotations

import itertools
import re

from neffbuild.errors import Problem
from neffbuild.errors import short_repr as short
from neffbuild.runtime.bundle import paths
from neffbuild.runtime.step import inputs as step_inputs
from neffbuild.runtime.step.buckets import table_width
from neffbuild.runtime.step.dispatch import DECODE, DRAFT, FAMILIES, TARGET_SPEC, label

HEX64 = re.compile(r"[0-9a-f]{64}")
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
MAX_DIM = 2**31 - 1
KV_DTYPES = {False: "float32", True: "float8_e4m3fn"}  # fp8_packed_kv -> the buffer dtype (kv_cache.KVLayout)


def is_int(v, lo: int = 0, hi: int = MAX_DIM) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def is_text(v, limit: int = 256) -> bool:
    return isinstance(v, str) and 0 < len(v) <= limit and not CONTROL.search(v)


class _Checker:
    def __init__(self):
        self.out: list[Problem] = []

    def bad(self, path: str, message: str) -> None:
        self.out.append(Problem(path, message))

    def int_field(self, d: dict, key: str, path: str, lo: int = 1, hi: int = MAX_DIM) -> int | None:
        v = d.get(key)
        if not is_int(v, lo, hi):
            self.bad(f"{path}.{key}", f"got {short(v)}, must be an integer in [{lo}, {hi}]")
            return None
        return v

    def int_list(self, d: dict, key: str, path: str, *, empty_ok: bool) -> list[int] | None:
        v = d.get(key)
        if not isinstance(v, list) or (not v and not empty_ok) or len(v) > 4096 or not all(is_int(x, 1) for x in v) \
                or any(b <= a for a, b in itertools.pairwise(v)):
            self.bad(f"{path}.{key}", f"got {short(v)}, must be a strictly ascending list of positive integers")
            return None
        return v


def problems(m: dict) -> list[Problem]:
    """Every schema problem of a parsed manifest (format and version are checked by the reader)."""
    c = _Checker()
    for key in ("name", "version"):
        if not is_text(m.get(key)):
            c.bad(key, f"got {short(m.get(key))}, must be a non-empty string without control characters")
    if not (isinstance(m.get("recipe_sha256"), str) and HEX64.fullmatch(m["recipe_sha256"])):
        c.bad("recipe_sha256", "must be 64 lowercase hex digits")
    tc = m.get("toolchain")
    if not isinstance(tc, dict) or not is_text(tc.get("backend"), 64):
        c.bad("toolchain", "must be an object with a string backend")
    parts = {k: m.get(k) for k in ("graph_inputs", "artifacts", "weights", "files")}
    for k, typ in (("graph_inputs", dict), ("artifacts", list), ("weights", dict), ("files", dict)):
        if not isinstance(parts[k], typ):
            c.bad(k, f"missing or not a JSON {'object' if typ is dict else 'array'}")
    if c.out:
        return c.out
    files = _files(c, parts["files"])
    gi = _graph_inputs(c, parts["graph_inputs"])
    _weights(c, parts["weights"], files)
    if gi is not None:
        _artifacts(c, parts["artifacts"], gi, files)
    if "parallel" in m:
        _parallel(c, m["parallel"])
    return c.out


def _parallel(c: _Checker, par) -> None:
    """A sharded bundle's layout: every reader (open_bundle, generate's world, the prefill worker) indexes it."""
    if not isinstance(par, dict):
        c.bad("parallel", f"got {short(par)}, must be an object (absent for an unsharded bundle)")
        return
    degrees = [c.int_field(par, k, "parallel", hi=4096) for k in ("tp", "dp", "ep", "world_size")]
    if None not in degrees and degrees[3] != degrees[0] * degrees[1]:
        c.bad("parallel.world_size", f"got {degrees[3]}, must be tp x dp = {degrees[0] * degrees[1]}")
    pieces = par.get("pieces")
    if not isinstance(pieces, dict) or not all(
            isinstance(e, dict) and isinstance(e.get("file"), str) and isinstance(e.get("tensors"), dict)
            for e in pieces.values()):
        c.bad("parallel.pieces", "must be an object of {file, tensors} per weight piece")


def _files(c: _Checker, files: dict) -> dict:
    for rel, info in files.items():
        if not (isinstance(info, dict) and isinstance(info.get("sha256"), str) and HEX64.fullmatch(info["sha256"])
                and is_int(info.get("bytes"), 0, 2**62)):
            c.bad(f"files.{rel}", f"got {short(info)}, must be {{sha256: 64 hex digits, bytes: integer >= 0}}")
        if rel in paths.UNCHECKED_PATHS or rel.split("/")[0] in paths.UNCHECKED_DIRS:
            c.bad(f"files.{rel}", "a per-build record must not be listed")
    return files


def _graph_inputs(c: _Checker, gi: dict) -> dict | None:
    p = "graph_inputs"
    n = len(c.out)
    mml = c.int_field(gi, "max_model_len", p)
    bs = c.int_field(gi, "block_size", p, hi=2**16)
    nb = c.int_field(gi, "num_blocks", p, lo=2)
    for key in ("tp", "dp", "ep", "lnc"):
        c.int_field(gi, key, p, hi=4096)
    k = c.int_field(gi, "num_speculative_tokens", p, lo=0, hi=64)
    num_seqs = c.int_list(gi, "num_seqs_buckets", p, empty_ok=False)
    ctx = c.int_list(gi, "decode_context_length_buckets", p, empty_ok=True)
    fp8 = gi.get("fp8_packed_kv")
    if not isinstance(fp8, bool):
        c.bad(f"{p}.fp8_packed_kv", f"got {short(fp8)}, must be true or false")
    if not isinstance(gi.get("model_config"), dict) or not is_text(gi.get("arch"), 64):
        c.bad(p, "model_config must be an object and arch a string")
    if mml and bs:
        c.int_field(gi, "num_swa", p, lo=0, hi=table_width(mml, bs))
        for i, v in enumerate(ctx or []):
            if v >= mml or v % bs:
                c.bad(f"{p}.decode_context_length_buckets[{i}]", f"got {v}, must be below max_model_len ({mml}) "
                      f"and a multiple of block_size ({bs})")
    if k is not None and mml is not None and k >= mml:
        c.bad(f"{p}.num_speculative_tokens", f"got {k}, must be below max_model_len ({mml})")
    if isinstance(fp8, bool) and nb and bs:
        _kv_layout(c, gi.get("kv_layout"), nb, bs, fp8)
    return gi if len(c.out) == n and num_seqs and ctx is not None else None


def _kv_layout(c: _Checker, kv, nb: int, bs: int, fp8: bool) -> None:
    p = "graph_inputs.kv_layout"
    if not isinstance(kv, dict):
        c.bad(p, "must be an object")
        return
    c.int_field(kv, "num_buffers", p, hi=4096)
    shape = kv.get("buffer_shape")
    if not (isinstance(shape, list) and len(shape) == 5 and all(is_int(x, 1, 2**24) for x in shape)
            and shape[0] == 2 and shape[1] == nb and shape[3] == bs):
        c.bad(f"{p}.buffer_shape", f"got {short(shape)}, must be [2, num_blocks ({nb}), kv_heads, block_size ({bs}), "
              "head_dim]")
    allowed = (KV_DTYPES[True],) if fp8 else (KV_DTYPES[False], "bfloat16")  # neuron_config.kv_dtype
    if kv.get("dtype") not in allowed:
        c.bad(f"{p}.dtype", f"got {short(kv.get('dtype'))}, must be one of {list(allowed)} with fp8_packed_kv {fp8}")
    if kv.get("packed_k") is not fp8 or (fp8 and bs % 2):
        c.bad(f"{p}.packed_k", f"got {short(kv.get('packed_k'))}, must equal fp8_packed_kv ({fp8}) with an even "
              "block_size")


def _weights(c: _Checker, w: dict, files: dict) -> None:
    if not isinstance(w.get("file"), str) or w["file"] not in files:
        c.bad("weights.file", f"got {short(w.get('file'))}, must be a file listed in files")
    tensors = w.get("tensors")
    if not isinstance(tensors, dict) or not tensors:
        c.bad("weights.tensors", "must be a non-empty object {name: {dtype, shape}}")
        return
    for name, t in tensors.items():
        if not (isinstance(t, dict) and is_text(t.get("dtype"), 32) and isinstance(t.get("shape"), list)
                and len(t["shape"]) <= 16 and all(is_int(x, 0, 2**40) for x in t["shape"])):
            c.bad(f"weights.tensors.{name}", f"got {short(t)}, must be {{dtype: string, shape: [non-negative ints]}}")


def _artifacts(c: _Checker, arts: list, gi: dict, files: dict) -> None:
    if not arts:
        c.bad("artifacts", "must list at least one artifact")
        return
    k = gi["num_speculative_tokens"]
    ctxs = [*gi["decode_context_length_buckets"], gi["max_model_len"]]
    seen: dict[str, int] = {}
    cells: dict[str, set] = {}
    for i, a in enumerate(arts):
        p = f"artifacts[{i}]"
        if not isinstance(a, dict):
            c.bad(p, "must be an object")
            continue
        fam, b, ctx, q = a.get("family"), a.get("batch"), a.get("ctx"), a.get("query_len")
        want_q = 1 + k if fam in (TARGET_SPEC, DRAFT) else 1
        if fam not in FAMILIES or (fam == DECODE) != (k == 0):
            c.bad(f"{p}.family", f"got {short(fam)}, must be one of {FAMILIES} matching num_speculative_tokens ({k})")
            continue
        if b not in gi["num_seqs_buckets"] or ctx not in ctxs or q != want_q or not all(map(is_int, (b, ctx, q))):
            c.bad(p, f"(batch, ctx, query_len) = ({short(b)}, {short(ctx)}, {short(q)}) is not a cell of the grid "
                  f"(batch in {gi['num_seqs_buckets']}, ctx in {ctxs}, query_len {want_q})")
            continue
        lab = label(fam, b, ctx, q)
        if a.get("label") != lab:
            c.bad(f"{p}.label", f"got {short(a.get('label'))}, must be {lab!r} for its family and shape")
            continue
        if lab in seen:
            c.bad(f"{p}.label", f"duplicate label {lab!r} (also artifacts[{seen[lab]}])")
            continue
        seen[lab] = i
        cells.setdefault(fam, set()).add((b, ctx))
        _artifact_fields(c, p, a, lab, files)
        if fam != DRAFT:  # the draft graph's inputs differ; its artifact is still checked against it at load
            _signature(c, p, a, gi)
    full = {(b, x) for b in gi["num_seqs_buckets"] for x in ctxs}
    for fam, have in sorted(cells.items()):
        if have != full:
            c.bad("artifacts", f"family {fam} lacks (batch, ctx) cells {sorted(full - have)[:8]}")


def _artifact_fields(c: _Checker, p: str, a: dict, lab: str, files: dict) -> None:
    f = a.get("file")
    prefix = f"{paths.ARTIFACTS_DIR}/{lab}."
    if not (isinstance(f, str) and f.startswith(prefix) and re.fullmatch(r"[a-z0-9]{1,8}", f[len(prefix):])):
        c.bad(f"{p}.file", f"got {short(f)}, must be {prefix}<ext> (each label has its own file)")
    elif f not in files:
        c.bad(f"{p}.file", f"{f} is not listed in files")
    elif files[f] != {"sha256": a.get("sha256"), "bytes": a.get("bytes")}:
        c.bad(f"{p}.sha256", f"sha256/bytes disagree with files.{f}")
    if not is_text(a.get("cache_key"), 128):
        c.bad(f"{p}.cache_key", "must be a string")


def dims(gi: dict, batch: int, ctx: int, query_len: int) -> step_inputs.Dims:
    """The shape inputs of one grid cell from (schema-checked) graph_inputs."""
    hidden = gi.get("model_config", {}).get("hidden_size", 0)
    return step_inputs.Dims(batch, ctx, query_len, gi["block_size"], gi["num_swa"], gi["kv_layout"],
                            hidden_size=int(hidden) if is_int(hidden) else 0,
                            sharded=gi.get("tp", 1) > 1 or gi.get("ep", 1) > 1)


def expected_signature(gi: dict, batch: int, ctx: int, query_len: int) -> list[dict]:
    """The inputs the runtime calls a target artifact with (the table in runtime/step/inputs.py)."""
    return step_inputs.signature(dims(gi, batch, ctx, query_len))


def expected_draft_signature(gi: dict, batch: int, ctx: int, query_len: int) -> list[dict]:
    """The inputs of an EAGLE3 draft artifact (runtime/step/inputs.py; docs/bundle-format.md)."""
    return step_inputs.signature(dims(gi, batch, ctx, query_len), draft=True)


def _signature(c: _Checker, p: str, a: dict, gi: dict) -> None:
    got = a.get("input_signature")
    expect = expected_draft_signature if a.get("family") == "draft" else expected_signature
    want = expect(gi, a["batch"], a["ctx"], a["query_len"])
    if not isinstance(got, list) or len(got) != len(want):
        c.bad(f"{p}.input_signature", f"must list {len(want)} inputs (graph_inputs imply {len(want)}), "
              f"got {len(got) if isinstance(got, list) else short(got)}")
        return
    for j, (g, w) in enumerate(zip(got, want, strict=True)):
        if g != w:
            c.bad(f"{p}.input_signature[{j}]", f"records {short(g, 120)} but graph_inputs imply {w} "
                  "(kv_layout, num_swa, block_size or the artifact's shape was changed)")
            return


def compare_with_artifact(where: str, recorded: list[dict], reported: list[dict]) -> str | None:
    """Why the artifact's own input checks disagree with the manifest's signature, or None."""
    if len(recorded) != len(reported):
        return (f"{where}.input_signature: the artifact takes {len(reported)} inputs, "
                f"the manifest records {len(recorded)}")
    for j, (r, a) in enumerate(zip(recorded, reported, strict=True)):
        if [r.get("dtype"), r.get("shape")] != [a["dtype"], a["shape"]]:
            return (f"{where}.input_signature[{j}] ({r.get('name')}): the artifact takes {a['dtype']} {a['shape']}, "
                    f"the manifest records {r.get('dtype')} {r.get('shape')}")
    return None


def compare_constants(where: str, table: dict, constants: dict) -> str | None:
    """Why the artifact's constants disagree with the weights table, or None."""
    for name, want in sorted(constants.items()):
        have = table.get(name)
        if have is None:
            return f"{where}: the artifact binds constant {name!r}, which weights.tensors lacks"
        if [have.get("dtype"), have.get("shape")] != [want["dtype"], want["shape"]]:
            return (f"{where}: constant {name!r} is {want['dtype']} {want['shape']} in the artifact, "
                    f"weights.tensors.{name} says {have.get('dtype')} {have.get('shape')}")
    return None
