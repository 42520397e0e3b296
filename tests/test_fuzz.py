"""Fuzzing (hypothesis, bounded, derandomised for CI) over recipes, manifests and weight headers.

Each property is what issue 16 asks of every input: a clean result or a clean error (exit code
in {0, 1, 2}, a NeffbuildError in-process), never a traceback or a signal, and with ``--json``
one standard JSON document. The whole module runs in well under two minutes on 2 cores.
"""

import contextlib
import copy
import hashlib
import json
import math
import struct

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neffbuild import recipe as R
from neffbuild.errors import BundleError, NeffbuildError, RecipeError
from neffbuild.runtime.bundle import schema as manifest_schema
from neffbuild.runtime.bundle import weights_file
from tests.conftest import TINY
from tests.helpers import run_cli, strict_json

BASE = yaml.safe_load(TINY.read_text())
def fuzz(n: int):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.sampled_from([0, 1, -1, 128, 512, 10**30, 2**63]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
    st.sampled_from(["", "\n", "abc", "1.0", "~nosuchuser/x", "/dev/null", "sliding_attention", "yarn", "x" * 500]),
)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)


def paths(node, prefix=()):
    """Every key path of a nested dict/list document."""
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += paths(v, (*prefix, i))
    return out


RECIPE_PATHS = [p for p in paths(BASE) if p] + [("speculative",), ("speculative", "draft", "config", "hidden_size"),
                                                 ("model", "config", "rope_parameters", "x")]


def mutate(doc, path, value, delete):
    doc = copy.deepcopy(doc)
    node = doc
    for key in path[:-1]:
        if isinstance(node, dict):
            node = node.setdefault(key, {})
        elif isinstance(node, list) and isinstance(key, int) and key < len(node):
            node = node[key]
        else:
            return doc
    if not isinstance(node, (dict, list)):
        return doc
    if isinstance(node, list) and not (isinstance(path[-1], int) and path[-1] < len(node)):
        return doc
    if delete and isinstance(node, dict):
        node.pop(path[-1], None)
    else:
        node[path[-1]] = value
    return doc


@fuzz(200)
@given(st.lists(st.tuples(st.sampled_from(RECIPE_PATHS), values, st.booleans()), min_size=1, max_size=3))
def test_fuzz_recipe_values(edits):
    raw = BASE
    for path, value, delete in edits:
        raw = mutate(raw, path, value, delete)
    try:
        r = R.from_dict(raw)
    except RecipeError as exc:
        assert exc.problems
        for p in exc.problems:
            strict_json(json.dumps(p.to_json(), allow_nan=False))
            assert len(str(p)) < 1000
        return
    assert r.max_model_len <= 2**24 and r.num_blocks <= 2**24


@fuzz(40)
@given(st.lists(st.tuples(st.sampled_from(RECIPE_PATHS), values, st.booleans()), min_size=1, max_size=2),
       st.sampled_from(["validate", "plan"]))
def test_fuzz_recipe_cli_json(tmp_path_factory, edits, command):
    raw = BASE
    for path, value, delete in edits:
        raw = mutate(raw, path, value, delete)
    p = tmp_path_factory.mktemp("r") / "r.yaml"
    p.write_text(yaml.safe_dump(raw, allow_unicode=True))
    code, out, err, unhandled = run_cli(command, str(p), "--json", *(["--no-cache"] if command == "plan" else []))
    assert unhandled is None, err
    assert code in (0, 2), err
    doc = strict_json(out)
    assert (code == 0) == (doc.get("ok", True) is not False)


yaml_text = st.one_of(
    st.text(max_size=200),
    st.lists(st.sampled_from(["a:", " b", "- ", "&x", "*x", "<<:", "!!float", "!!binary", "? ", "[", "]", "{", "}",
                              ",", "\n", "  ", "1e400", ".nan", "~", "'", '"', "|", ">", "%YAML 1.1\n", "---\n",
                              "!!python/object:os.system", "\t", "\x00", "name: x\n"]),
             max_size=40).map("".join),
)


@fuzz(100)
@given(yaml_text)
def test_fuzz_recipe_yaml_text(tmp_path_factory, text):
    p = tmp_path_factory.mktemp("y") / "r.yaml"
    p.write_bytes(text.encode("utf-8", errors="surrogatepass"))
    code, out, err, unhandled = run_cli("validate", str(p), "--json")
    assert unhandled is None, err
    assert code in (0, 2)
    strict_json(out)


# -- weight headers

dtypes = st.sampled_from([*weights_file.ITEMSIZE, "F128", "", "f32"])
entries = st.fixed_dictionaries({
    "dtype": st.one_of(dtypes, values),
    "shape": st.one_of(st.lists(st.integers(-2, 2**40), max_size=4), values),
    "data_offsets": st.one_of(st.lists(st.integers(-64, 2**20), min_size=2, max_size=2), values),
})


@fuzz(200)
@given(st.dictionaries(st.text(max_size=6), st.one_of(entries, values), max_size=4), st.integers(0, 256),
       st.one_of(st.none(), st.integers(0, 2**64 - 1)))
def test_fuzz_weight_headers(tmp_path_factory, header, nbytes, length):
    raw = json.dumps(header, allow_nan=True).encode()
    p = tmp_path_factory.mktemp("w") / "w.safetensors"
    p.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + bytes(nbytes))
    try:
        tensors = weights_file.load(p)
    except BundleError:
        return
    for name, t in tensors.items():
        assert t.nbytes == math.prod(header[name]["shape"]) * weights_file.ITEMSIZE[header[name]["dtype"]]


# -- manifests: the schema never raises, whatever the values

def golden():
    from tests.test_manifest_golden import golden_text

    return json.loads(golden_text())


GOLDEN = None


@fuzz(200)
@given(st.data())
def test_fuzz_manifest_schema(data):
    global GOLDEN
    GOLDEN = GOLDEN or golden()
    m = GOLDEN
    candidates = [p for p in paths(m) if p]
    for _ in range(data.draw(st.integers(1, 3))):
        m = mutate(m, data.draw(st.sampled_from(candidates)), data.draw(values), data.draw(st.booleans()))
    found = manifest_schema.problems(m)
    assert isinstance(found, list)


# -- real bundle: tampered manifests (digest rewritten) open, load and run, or are refused cleanly

@pytest.mark.slow
@fuzz(25)
@given(st.data())
def test_fuzz_bundle_manifest(built, tmp_path_factory, data):
    import shutil

    from neffbuild.bundle import manifest
    from neffbuild.serve.requests import from_prompts
    from neffbuild.serve.run import Options, serve_rank

    src = built.bundle
    m = json.loads((src / "manifest.json").read_text())
    candidates = [p for p in paths(m) if p and p[0] in ("graph_inputs", "artifacts", "weights", "files", "toolchain")]
    for _ in range(data.draw(st.integers(1, 2))):
        m = mutate(m, data.draw(st.sampled_from(candidates)), data.draw(values), data.draw(st.booleans()))
    root = tmp_path_factory.mktemp("fz") / "b"
    shutil.copytree(src, root)
    text = manifest.dumps(m) if _json_ok(m) else json.dumps(m, allow_nan=True)
    (root / "manifest.json").write_text(text)
    (root / "manifest.sha256").write_text(f"{hashlib.sha256(text.encode()).hexdigest()}  manifest.json\n")
    with contextlib.suppress(NeffbuildError):
        serve_rank(str(root), from_prompts([[1, 2, 3]], 2), Options())


def _json_ok(m) -> bool:
    try:
        json.dumps(m, allow_nan=False)
        return True
    except ValueError:
        return False


# -- runtime step inputs (issue 25): a StepOutput or a NeffbuildError, never a signal, KV untouched on error

_odd = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=True), st.text(max_size=3),
                 st.sampled_from([-1, 2**63, 10**30, 256, 255, 0]))
_token = st.one_of(st.integers(-3, 300), _odd)
_computed = st.one_of(st.integers(-3, 520), _odd)


@st.composite
def _tables(draw, rows: int):
    import torch

    from tests.conftest import POOL

    kind = draw(st.sampled_from(["ids", "ids", "ids", "list", "float", "1d", "wrong-rows", "meta", "missing"]))
    width = draw(st.integers(1, 34))
    lo, hi = draw(st.sampled_from([(1, POOL), (1, POOL), (-2, POOL + 2), (0, 3)]))
    t = torch.randint(lo, hi, (rows, width))
    if kind == "list":
        return {"full": t.tolist()}
    if kind == "float":
        return {"full": t.float()}
    if kind == "1d":
        return {"full": t.reshape(-1)}
    if kind == "wrong-rows":
        return {"full": torch.randint(1, POOL, (rows + 1, width))}
    if kind == "meta":
        return {"full": t.to("meta")}
    if kind == "missing":
        return {"sliding": t}
    out = {"full": t}
    if draw(st.booleans()):
        out["sliding"] = torch.randint(lo, hi, (rows, draw(st.integers(1, 34))))
    return out


@st.composite
def _steps(draw):
    rows = draw(st.integers(0, 5))
    tokens = [draw(st.lists(_token, min_size=1, max_size=2)) for _ in range(rows)]
    computed = [draw(_computed) for _ in range(draw(st.sampled_from([rows, rows, rows, max(rows - 1, 0)])))]
    return tokens, computed, draw(_tables(rows))


@pytest.fixture(scope="module")
def fuzz_stepper(built):
    from neffbuild.runtime import Stepper
    from neffbuild.runtime.bundle.reader import open_bundle

    return Stepper(open_bundle(built.bundle))


@fuzz(150)
@given(_steps())
def test_fuzz_step_inputs(fuzz_stepper, step):
    import torch

    from neffbuild.runtime import StepBatch

    tokens, computed, tables = step
    before = [c.clone() for c in fuzz_stepper.kv_caches]
    try:
        out = fuzz_stepper.step(StepBatch(tokens, computed, tables))
    except NeffbuildError:
        assert all(torch.equal(a, b) for a, b in zip(before, fuzz_stepper.kv_caches, strict=True))
        return
    assert out.logits.shape == (len(tokens), 1, 256) and torch.isfinite(out.logits).all()


# -- the step check's fast path against its reference (issue 25): never accepts what the reference refuses

_ODD = [True, 5.0, "3", None, 2**62, 2**63, -(2**63)]
_DEFECTS = ["none", "token", "row-length", "computed", "row-count", "id full", "id sliding", "beyond", "width full",
            "width sliding", "dtype full", "dtype sliding", "shape full", "shape sliding", "device", "groups",
            "tuples", "idle", "foreign", "no-vocab"]


@st.composite
def _edge_steps(draw, defect: str):
    """A well-formed step (live columns non-null, padded with the null block elsewhere as engines do) with at
    most one defect at an edge of the rules. Returns (args, exact): ``exact`` when the fast path must agree with
    the reference both ways (plain containers, a vocab, at least one request)."""
    import numpy as np
    import torch

    bs, mml = draw(st.sampled_from([1, 4, 16])), draw(st.sampled_from([16, 40, 64]))
    nb = draw(st.sampled_from([2, 9, 40]))
    k, vocab, R, cols = draw(st.integers(0, 3)), draw(st.sampled_from([256, 3])), draw(st.integers(1, 4)), -(-mml // bs)
    tokens = [[draw(st.integers(0, vocab - 1)) for _ in range(draw(st.sampled_from([1, 1 + k])))] for _ in range(R)]
    computed = [draw(st.integers(0, mml + bs)) for _ in range(R)]
    lasts = [min(n + len(t), mml) - 1 for n, t in zip(computed, tokens, strict=True)]
    his = [p // bs + 1 if p >= n else 0 for n, p in zip(computed, lasts, strict=True)]
    seed = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    tables = {}
    defect, _, group = defect.partition(" ")
    for g in ("full", "sliding") if group == "sliding" else draw(st.sampled_from([("full",), ("full", "sliding")])):
        width = cols + 2 if defect == "beyond" else max(draw(st.integers(max(his), cols + 2)), 1)
        t = torch.randint(1, nb, (R, width), generator=seed)
        if draw(st.booleans()):  # the null block wherever no live position is
            for r, (n, h) in enumerate(zip(computed, his, strict=True)):
                t[r, h:] = 0
                if g == "sliding":
                    t[r, : min(n // bs, h)] = 0
        tables[g] = t
    exact = True
    r, group = draw(st.integers(0, R - 1)), group or "full"
    if defect == "token":
        tokens[r][draw(st.integers(0, len(tokens[r]) - 1))] = draw(st.sampled_from([-1, vocab, vocab + 1, *_ODD]))
    elif defect == "row-length":
        tokens[r] = [0] * draw(st.sampled_from([0, k + 2, 2, 1 + k]))
    elif defect == "computed":
        computed[r] = draw(st.sampled_from([-1, mml - 1, mml, 10**9, *_ODD]))
    elif defect == "row-count":
        computed = computed[1:] if draw(st.booleans()) else [*computed, 0]
    elif defect == "id":  # anywhere: live, padding, beyond the columns the graph reads
        t = tables[group].clone()
        t[r, draw(st.integers(0, t.shape[1] - 1))] = draw(st.sampled_from([0, -1, nb, nb + 1, 1]))
        tables[group] = t
    elif defect == "beyond":  # columns the graph never reads may hold anything
        tables["full"][r, cols + draw(st.integers(0, 1))] = draw(st.sampled_from([-1, nb, 10**6]))
    elif defect == "width":
        tables[group] = tables[group][:, : draw(st.integers(0, tables[group].shape[1]))]
    elif defect == "dtype":
        tables[group] = tables[group].to(draw(st.sampled_from([torch.int32, torch.int16, torch.float32, torch.bool])))
    elif defect == "shape":
        t = tables[group]
        tables[group] = draw(st.sampled_from([t.reshape(-1), torch.cat([t, t[:1]]), t.tolist(), t[None],
                                              torch.cat([t, t], 1)[:, ::2], t[:, :0]]))
    elif defect == "device":
        g = draw(st.sampled_from(sorted(tables)))
        tables[g] = tables[g].to("meta")
    elif defect == "groups":
        tables = draw(st.sampled_from([{"sliding": tables["full"]}, {**tables, "draft": tables["full"]},
                                       {**tables, "sliding": None}, {}]))
    elif defect == "tuples":
        tokens, computed = tuple(map(tuple, tokens)), tuple(computed)
    elif defect == "idle":
        tokens, computed, tables, exact = [], [], {g: t[:0] for g, t in tables.items()}, False
    elif defect == "foreign":  # integral, not int: the reference takes these, the fast path leaves them to it
        tokens[r][0], exact = draw(st.sampled_from([np.int64(1), torch.tensor(1)])), False
        computed[r] = draw(st.sampled_from([computed[r], np.int32(computed[r])]))
    elif defect == "no-vocab":
        vocab, exact = None, False
        tokens[r][0] = draw(st.sampled_from([0, 2**62, 2**63]))
    return (tokens, computed, tables, k, vocab, bs, nb, mml), exact


def _as_buffer_view(tables, data, cols: int):
    """The same tables as a TableBuffer view (runtime/kv/tables.py: rows checked when written), cut to one
    width for every group, mostly no wider than the ``cols`` the graph reads; sometimes with a row written since,
    first wider than the view with odd ids, then at another width (a write nulls what a longer one left: the row
    reads as its ids, then nulls, and the view stays exact). Tables a buffer cannot hold (not 2-D int CPU tensors
    of one row count, unknown groups) stay as they are. Returns (tables, True when a row was rewritten)."""
    import torch

    from neffbuild.runtime.kv.tables import TableBuffer

    ts = list(tables.values()) if isinstance(tables, dict) else []
    if not ts or not set(tables) <= {"full", "sliding"} or not all(
            isinstance(t, torch.Tensor) and t.dim() == 2 and t.device.type == "cpu" and t.dtype == torch.long
            and t.shape[0] == ts[0].shape[0] > 0 and t.shape[1] > 0 for t in ts):
        return tables, False
    R, W = ts[0].shape[0], min(t.shape[1] for t in ts)
    W = W if data.draw(st.integers(0, 3)) == 0 else min(W, cols)  # wider than cols: left to the reference
    buf = TableBuffer(list(tables), R, W + 1)
    for gi, t in enumerate(ts):
        for r, row in enumerate(t[:, :W].tolist()):
            buf.write(gi, r, row)
    view = buf.view(R, W)
    if data.draw(st.integers(0, 3)) == 0:  # a row written at other widths after the view was made
        g, r = data.draw(st.integers(0, len(ts) - 1)), data.draw(st.integers(0, R - 1))
        buf.write(g, r, [data.draw(st.sampled_from([0, 1, -1, 10**6])) for _ in range(W + 1)])  # ids past W
        w = data.draw(st.sampled_from([w for w in range(1, W + 2) if w != W]))
        buf.write(g, r, [1] * w)
        assert view[list(tables)[g]][r].tolist() == ([1] * w + [0] * W)[:W]  # its ids, then nulls
        return view, True
    return view, False


def _one_run(tables) -> bool:
    """Every sliding row's blocks (non-null ids) sit in one run of columns, as a block manager writes them."""
    import torch

    t = tables.get("sliding") if isinstance(tables, dict) else None
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.device.type != "cpu":
        return True  # no sliding table the checked rows could hold
    return all("".join("x" if b else "." for b in row).strip(".").count(".") == 0 for row in t.tolist())


@pytest.mark.parametrize("scan", ["python", "aminmax", "buffer"])  # ids as lists, one aminmax, checked rows
@pytest.mark.parametrize("defect", _DEFECTS)
@fuzz(30)
@given(data=st.data())
def test_fuzz_step_check_fast_path_agrees_with_reference(monkeypatch, scan, defect, data):
    from types import SimpleNamespace

    from neffbuild.runtime.step import checks as step_checks

    monkeypatch.setattr(step_checks, "_PY_IDS", step_checks.LIST_LIMIT if scan == "python" else 0)
    (tokens, computed, tables, k, vocab, bs, nb, mml), exact = data.draw(_edge_steps(defect))
    if scan == "buffer":
        tables, _ = _as_buffer_view(tables, data, -(-mml // bs))
        # Left to the reference, so the fast path may only refuse it: a view wider than the columns the graph reads
        # (ids beyond them may be anything; the checked rows' range covers all columns). A row rewritten at another
        # width is exact: it reads as its ids, then nulls.
        exact = exact and getattr(tables, "num_cols", 0) <= -(-mml // bs)
        # Also left to the reference: a sliding row with the null block between two runs of blocks (no block
        # manager writes one; the checked rows know one run of blocks per row).
        exact = exact and _one_run(tables)
    fast = step_checks.step_ok(tokens, computed, tables, k, vocab, bs, nb, mml)
    ref = step_checks._step_reference(tokens, computed, tables, k=k, vocab=vocab, max_model_len=mml,
                                      layout=SimpleNamespace(block_size=bs, num_blocks=nb))
    if fast:
        assert ref is None  # soundness: the fast path never lets a malformed step through
    if exact:
        assert fast == (ref is None), ref  # and on plain input it takes every step the reference takes


@st.composite
def _decode_rows(draw):
    """A plain decode step as an engine keeps it: one token per row, positions below max_model_len, every row
    holding blocks for its live columns and often some columns past them (its block not yet full, blocks held
    ahead), then nulls; sometimes a sliding group whose run starts at or before the row's block. The view is as
    wide as some context bucket covering the live columns: rows may hold blocks past it (written wider)."""

    from neffbuild.runtime.kv.tables import TableBuffer

    bs, mml, nb = draw(st.sampled_from([1, 4, 16])), draw(st.sampled_from([16, 40, 64])), draw(st.sampled_from([9, 40]))
    k, vocab, R, cols = draw(st.integers(0, 3)), draw(st.sampled_from([256, 3])), draw(st.integers(1, 4)), -(-mml // bs)
    computed = [draw(st.integers(0, mml - 1)) for _ in range(R)]
    held = [draw(st.integers(n // bs + 1, cols)) for n in computed]  # columns holding blocks: past the live ones
    W = draw(st.integers(max(n // bs + 1 for n in computed), cols))  # the view: a row may hold blocks past it
    groups = ["full", "sliding"] if draw(st.booleans()) else ["full"]
    buf = TableBuffer(groups, R, cols)
    for r, (n, h) in enumerate(zip(computed, held, strict=True)):
        pad = draw(st.integers(0, cols - h))  # nulls written after its blocks (or none: the row ends there)
        buf.write(0, r, [draw(st.integers(1, nb - 1)) for _ in range(h)] + [0] * pad)
        if len(groups) == 2:  # its own run: from at or before the row's block to at least the live columns
            a, e = draw(st.integers(0, n // bs)), draw(st.integers(n // bs + 1, cols))
            buf.write(1, r, [0] * a + [draw(st.integers(1, nb - 1)) for _ in range(e - a)]
                      + [0] * draw(st.integers(0, cols - e)))
    tokens = [[draw(st.integers(0, vocab - 1))] for _ in range(R)]
    return tokens, computed, buf.view(R, W), k, vocab, bs, nb, mml


