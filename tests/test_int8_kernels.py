"""The opt-in integer forms (runtime/native_q8.py): the integer expert product and the int8 LM head equal plain
reference loops on every ISA path this host can build (VNNI, AVX2, plain), the int8 head's greedy exactness holds
on logit rows built to sit at its error bound, the recipe keys are validated and shape the cache key, and the int8
forms' greedy tokens on the tiny model are measured against the exact forms'. Compiles no graph."""

from __future__ import annotations

import math
import platform

import pytest
import torch
import yaml

from neffbuild import recipe as R
from neffbuild.compiler.cache import pre_key
from neffbuild.compiler.graph_spec import target_graph
from neffbuild.errors import NeffbuildError
from neffbuild.grid import targets
from neffbuild.kernels.moe import native_cpu_ops
from neffbuild.models.gpt_oss import weights as W
from neffbuild.models.gpt_oss.decode import GptOssDecode
from neffbuild.models.gpt_oss.shapes import WeightForm
from neffbuild.runtime import native
from neffbuild.runtime import native_q8 as Q
from neffbuild.runtime.kv.cache import KVLayout
from neffbuild.runtime.step.dispatch import Grid
from neffbuild.serve.rank import EagerArtifacts, serving_rank
from tests import engine_runs
from tests.helpers import cli
from tests.test_native_cache import _cpu_flags

# (path, flags, CPU flags it executes, the integer expert path, the int8 head path)
ISAS = [
    ("plain", ("-march=x86-64",), set(), 0, 0),
    ("avx2", ("-march=x86-64-v3",), {"avx2", "fma"}, 1, 1),
    ("vnni", ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"),
     {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}, 2, 2),
]
EVEN_ODD = torch.cat([torch.arange(0, 32, 2), torch.arange(1, 32, 2)])  # the C quantizer's order within a block


def _lib(flags, needs):
    if platform.machine() not in ("x86_64", "AMD64") or not needs <= _cpu_flags():
        pytest.skip(f"this host cannot execute {flags} ({sorted(needs - _cpu_flags())} missing)")
    lib = native.library(flags)
    assert lib is not None
    return lib


def reference_dot(x, blocks, scales, idx):
    """A plain loop: integer block sums (Python ints) of the quantized x and twice-E2M1, scaled in float64."""
    q, d = Q.quantize_q8(x)
    n, k = idx.shape
    out = torch.zeros(n, k, blocks.shape[1], dtype=torch.float64)
    table = Q.TWICE_E2M1.long().tolist()
    for i in range(n):
        for j in range(k):
            xr = 0 if x.shape[1] == 1 else j
            e = int(idx[i, j])
            for o in range(blocks.shape[1]):
                total = 0.0
                for g in range(blocks.shape[2]):
                    qb = q[i, xr, g * 32:(g + 1) * 32].tolist()
                    isum = sum(table[b & 15] * qb[2 * t] + table[b >> 4] * qb[2 * t + 1]
                               for t, b in enumerate(blocks[e, o, g].tolist()))
                    sc = int(scales[e, o, g])
                    total += isum * float(d[i, xr, g]) * (math.nan if sc == 255 else 2.0 ** (sc - 128))
                out[i, j, o] = total
    return out


@pytest.mark.parametrize(("name", "flags", "needs", "path", "head_path"), ISAS, ids=[r[0] for r in ISAS])
def test_integer_expert_product_equals_the_plain_loop(name, flags, needs, path, head_path):
    lib = _lib(flags, needs)
    assert (lib.q8_path, lib.neffbuild_q8_head_path()) == (path, head_path)
    g = torch.Generator().manual_seed(3)
    # odd output rows (a run of one pick reads rows in fours from the expert's quarters: 7 rows as 4 + 3, 10 as
    # 4 + 3 + 3), groups past the wide loop's fours by a pair, by one, by a pair and one; a subnormal scale
    for E, out, G, n, kx, k, same in ((5, 7, 3, 1, 1, 4, False), (5, 7, 3, 3, 2, 2, False), (5, 7, 3, 4, 1, 3, False),
                                      (5, 7, 3, 11, 1, 1, True), (3, 10, 9, 1, 1, 2, False), (3, 10, 6, 2, 3, 3, False),
                                      (3, 10, 11, 1, 3, 3, False), (3, 10, 35, 2, 1, 2, False)):
        blocks = torch.randint(0, 256, (E, out, G, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(122, 132, (E, out, G), dtype=torch.uint8, generator=g)
        if G > 32:
            scales[:, 3, 20] = 1
        x = torch.randn(n, kx, G * 32, generator=g) * 3
        x[0, 0, :32] = 0  # an all-zero block: scale 0
        idx = torch.full((n, k), 2) if same else torch.randint(0, E, (n, k), generator=g)
        got = Q.mxfp4_q8_native(lib, x, blocks, scales, idx).double()
        want = reference_dot(x, blocks, scales, idx)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
        torch.testing.assert_close(Q.q8_packed_dot(x, (blocks, scales), idx).double(), want, rtol=1e-5,
                                   atol=1e-5 * float(want.abs().max()))
    # a run of one pick (four rows in step) gives bit for bit what a run of two picks (one row at a time) gives
    x = torch.randn(1, 1, G * 32, generator=g)
    one = Q.mxfp4_q8_native(lib, x, blocks, scales, torch.tensor([[1]]))
    two = Q.mxfp4_q8_native(lib, x.expand(2, 1, -1).contiguous(), blocks, scales, torch.tensor([[1], [1]]))
    assert torch.equal(one[0], two[0]) and torch.equal(two[0], two[1])


@pytest.mark.parametrize(("name", "flags", "needs", "path", "head_path"), ISAS, ids=[r[0] for r in ISAS])
def test_integer_sums_are_exact_where_every_value_is(name, flags, needs, path, head_path):
    """Each x block's largest |value| 127 (scale 1, q = x) and power-of-two weight scales: every output is a small
    multiple of 1/4, so the C paths must equal the integer reference exactly; NaN blocks stay NaN."""
    lib = _lib(flags, needs)
    g = torch.Generator().manual_seed(5)
    blocks = torch.randint(0, 256, (3, 9, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(125, 130, (3, 9, 2), dtype=torch.uint8, generator=g)
    scales[1, 4, 0] = 255
    x = torch.randint(-127, 128, (5, 1, 64), generator=g).float()
    x[..., 0], x[..., 32] = 127, -127
    x[4, 0, 40] = float("inf")
    idx = torch.tensor([[0, 1], [1, 2], [2, 2], [0, 0], [1, 0]])
    got, want = Q.mxfp4_q8_native(lib, x, blocks, scales, idx), reference_dot(x, blocks, scales, idx).float()
    assert torch.equal(got.isnan(), want.isnan()) and bool(got[0, 1, 4].isnan()) and bool(got[4].isnan().all())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    q, d = Q.quantize_native(lib, x.view(5, 64))
    qr, dr = Q.quantize_q8(x.view(5, 64))
    assert torch.equal(d.nan_to_num(), dr.nan_to_num())
    assert torch.equal(q.view(5, 2, 32), qr.view(5, 2, 32)[..., EVEN_ODD])


@pytest.mark.parametrize(("name", "flags", "needs", "path", "head_path"), ISAS, ids=[r[0] for r in ISAS])
def test_int8_head_pieces_equal_plain_loops(name, flags, needs, path, head_path):
    """Per-row quantization (bit for bit), the int8 logits (a float sum of exact products), and the re-scoring
    loop (bit for bit the exact form's values at the picked places), for widths with tails and odd rows."""
    lib = _lib(flags, needs)
    g = torch.Generator().manual_seed(11)
    for m, k, v in ((1, 67, 33), (5, 131, 9), (3, 7, 1), (4, 96, 6)):
        x, w = torch.randn(m, k, generator=g).bfloat16(), (torch.randn(v, k, generator=g) * 0.1).bfloat16()
        q, s = Q.quantize_rows(lib, w)
        amax = w.float().abs().amax(-1)
        inv = torch.full_like(amax, 127.0) / amax  # a division, as the C loop does (127 / t is 127 * (1 / t))
        assert torch.equal(s, amax / 127) and torch.equal(q, torch.round(w.float() * inv[:, None]).to(torch.int8))
        a = Q.q8_matmul(lib, x, q, s).double()
        torch.testing.assert_close(a, s.double()[None] * (x.double() @ q.double().t()), rtol=1e-6, atol=1e-6)
        if lib.bf16_path:
            full = native.bf16_native(lib, x, w)
            rows, cols = torch.meshgrid(torch.arange(m), torch.arange(v), indexing="ij")
            assert torch.equal(Q.bf16_at(lib, x, w, rows.flatten(), cols.flatten()), full.flatten())


def _at_the_bound(K=256, s_exp=-7):
    """Head rows whose int8 error is the bound's own term, 0.5 s |x|_1 (but for one tiny value): each weight half a
    step off the int8 grid (round-half-even moves it by exactly s / 2), the sign of x matching the error's, and the
    row's max |w| = 127 s (s a power of two, so every value is exact in bfloat16)."""
    s = 2.0 ** s_exp
    g = torch.Generator().manual_seed(1)
    k = torch.randint(-120, 120, (K,), generator=g).double()
    w = s * (k + 0.5)  # exactly between two grid points: q is the even neighbour
    q = torch.round(k + 0.5)
    w[0] = 127 * s  # the row's max: s = max / 127 exactly
    x = torch.sign(w - s * q) * (1 + torch.rand(K, generator=g) * 0.5)  # every term's error adds up
    x[0] = 2.0 ** -20
    return w.bfloat16(), x.bfloat16()


# (case, the rows of the head, the exact form's argmax): every case has the int8 argmax elsewhere.
HEAD_TABLE = [
    ("the bound row is the max, a rival's int8 logit above it", ("bound", "rival"), 0),
    ("the rival first", ("rival", "bound"), 1),
    ("a tie: two copies of the bound row, the first wins", ("rival", "bound", "bound"), 1),
    ("rows far below around them", ("low", "rival", "bound", "low"), 2),
]


def _head_table(kinds, s=2.0 ** -7):
    """Rows over one x: ``bound`` (``_at_the_bound``: exact logit f = a + 0.5 s |x|_1 roughly, a its int8 logit);
    ``rival`` (the bound row's int8 grid values exactly, one of them a step up where x > 0: int8 and exact logit
    a + s x_t, above the bound row's int8 logit, below its exact one); ``low`` (grid values a step down towards
    -x everywhere: a - s |x|_1)."""
    w, x = _at_the_bound(s_exp=int(torch.log2(torch.tensor(s))))
    q = torch.round(w.double() / s)
    rival = s * q
    up = int((x.float() > 0).nonzero()[1])
    rival[up] += s
    low = s * (q - torch.sign(x.double()))
    low[0] = w[0].double()  # the rows' max |w| stays 127 s
    rows = {"bound": w, "rival": rival.bfloat16(), "low": low.bfloat16()}
    return torch.stack([rows[k] for k in kinds]), x[None]


@pytest.mark.parametrize(("case", "kinds", "argmax"), HEAD_TABLE, ids=[r[0] for r in HEAD_TABLE])
def test_int8_head_is_greedy_exact_at_its_error_bound(case, kinds, argmax):
    lib = native.library()
    if lib is None or not lib.bf16_path:
        pytest.skip("the exact head is oneDNN's matmul here: q8_head runs it")
    w, x = _head_table(kinds)
    exact = native.bf16_native(lib, x, w).bfloat16()
    q, s = Q.quantize_rows(lib, w)
    a = Q.q8_matmul(lib, x, q, s)
    e = Q.head_bound(s, x)
    err = (native.bf16_native(lib, x, w).double() - a.double()).abs()
    assert bool((err <= e).all())  # the bound holds ...
    bound_rows = [i for i, kind in enumerate(kinds) if kind == "bound"]
    assert float((err / e)[0, bound_rows].min()) > 0.9  # ... and these rows sit at it
    assert int(exact.argmax(-1)) == argmax and int(a.argmax(-1)) != argmax  # the int8 argmax alone would be wrong
    got = torch.ops.neffbuild.q8_head(x, w)
    assert int(got.argmax(-1)) == argmax and got[0, argmax] == exact[0, argmax]
    assert bool(((got[0] < got[0, argmax]) | (got[0] == exact[0])).all())  # below the max, or the exact value


def test_int8_head_agrees_on_random_heads_and_batches():
    """Random bf16 heads, 1 to 6 rows of x (chunks of 4 and tails): the argmax and its value are the exact form's;
    the C pass picks exactly the rows ``head_bound``'s rule in torch picks (a few of the 3,001, not all)."""
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(3001, 160, generator=g) * 0.05).bfloat16()
    lib = native.library()
    for m in (1, 2, 4, 6):
        x = torch.randn(m, 160, generator=g).bfloat16()
        exact = torch.ops.neffbuild.bf16_linear(x, w)
        got = torch.ops.neffbuild.q8_head(x, w)
        assert torch.equal(got.argmax(-1), exact.argmax(-1)), m
        assert torch.equal(got.max(-1).values, exact.max(-1).values), m
        if lib is not None and lib.bf16_path:
            q, s = Q.quantize_rows(lib, w)
            a = Q.q8_matmul(lib, x, q, s)
            e, a64 = Q.head_bound(s, x), a.double()
            near = (a64 + e).float().bfloat16() >= (a64 - e).max(-1).values.float().bfloat16()[:, None]
            rows, cols = Q.candidates(lib, a, s, x)
            assert torch.equal(torch.stack([rows, cols]), torch.stack(near.nonzero(as_tuple=True))), m
            assert m <= rows.numel() < 3001 * m // 4, m


def _rows_reference(x, w, lib):
    """A plain torch reference of ``q8_linear``: the per-row quantization in torch (as the C loop computes it), then
    s * (q @ x) in float64, and the float32 summation error bound of the C loop's sums (K roundings, exact products;
    widened by one bf16 rounding of the result); with the integer form (``head16``, AVX512-VNNI) x's rounding to
    int16 instead, s * (|q| @ |x - x^|): (reference, bound)."""
    wf = w.float()
    amax = wf.abs().amax(-1)
    s = amax / 127
    q = torch.round(wf * (torch.full_like(amax, 127.0) / amax)[:, None]).double()
    ref = s.double()[None] * (x.double() @ q.t())
    k = x.shape[1]
    sums = s.double()[None] * (x.double().abs() @ q.abs().t())
    if lib.q8_head16:
        xa = x.double().abs().amax(-1, keepdim=True)
        d = xa / lib.neffbuild_q8_head16_qmax(k)
        xh = torch.where(xa > 0, torch.round(x.double() / d) * d, torch.zeros_like(xa))
        rounding = s.double()[None] * ((x.double() - xh).abs() @ q.abs().t())
        return ref, rounding * (1 + 2.0 ** -8) + 2.0 ** -8 * ref.abs() + 2.0 ** -24 * sums
    gamma = k * 2.0 ** -24 / (1 - k * 2.0 ** -24)
    return ref, gamma * sums * (1 + 2.0 ** -8) + 2.0 ** -8 * ref.abs() + 2.0 ** -24 * sums


# (M, K, N): batch 1 and the 4-row tiles with tails, widths with 16-value tails, odd rows and a single one
LINEAR_SHAPES = [(1, 67, 33), (5, 131, 9), (4, 96, 6), (3, 7, 1), (2, 2880, 13)]


@pytest.mark.parametrize(("m", "k", "n"), LINEAR_SHAPES, ids=[f"{m}x{k}x{n}" for m, k, n in LINEAR_SHAPES])
def test_int8_linear_equals_the_scaled_integer_product(m, k, n):
    """``neffbuild::q8_linear`` (the int8 attention projections) against s * (q @ x) within the float32 sums' error
    and the bf16 rounding of the result; and it is lossy: not the exact op's values, but within the quantization's
    half step a weight (|x|_1 * max|w_row| / 254, plus the exact op's own rounding)."""
    lib = native.library()
    if lib is None:
        pytest.skip("no C kernels here: q8_linear runs the exact op")
    g = torch.Generator().manual_seed(m * 1000 + k)
    x, w = torch.randn(m, k, generator=g).bfloat16(), (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    got = torch.ops.neffbuild.q8_linear(x, w)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    ref, bound = _rows_reference(x, w, lib)
    assert bool(((got.double() - ref).abs() <= bound).all())
    exact = torch.ops.neffbuild.bf16_linear(x, w).double()
    half_step = x.double().abs().sum(-1, keepdim=True) * w.double().abs().amax(-1)[None] / 254
    assert bool(((got.double() - exact).abs() <= half_step * 1.01 + 2.0 ** -7 * exact.abs() + 1e-6).all())
    if k > 64:
        assert not torch.equal(got, exact.bfloat16())


def test_int8_linear_falls_back_and_refuses_what_c_cannot_read():
    """A non-finite weight runs the exact op (bit for bit); bad dtypes, shapes and the meta device are a
    ValueError naming the op before any pointer reaches C, the fake kernel included."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(3, 40, generator=g).bfloat16(), torch.randn(6, 40, generator=g).bfloat16()
    w[2, 5] = float("inf")
    torch.testing.assert_close(torch.ops.neffbuild.q8_linear(x, w), torch.ops.neffbuild.bf16_linear(x, w), rtol=0,
                               atol=0, equal_nan=True)
    for xa, wa in ((x.float(), w), (x, w[:, :39]), (x[0], w), (x, w.to("meta"))):
        with pytest.raises(ValueError, match="q8_linear"):
            torch.ops.neffbuild.q8_linear(xa, wa)
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode, narrow = FakeTensorMode(), w[:, :39].contiguous()
    fx, fw = mode.from_tensor(x), mode.from_tensor(narrow)
    with mode, pytest.raises(ValueError, match="q8_linear"):
        torch.ops.neffbuild.q8_linear(fx, fw)


def test_int8_rows_are_quantized_once_and_dropped_with_their_weights():
    """The quantize-once cache: a new view of the same weight (as an artifact passes its constants each step) hits;
    a weight changed in place is quantized again; a freed weight's entry is gone at the next miss."""
    lib = native.library()
    if lib is None:
        pytest.skip("no C kernels here")
    stacked = torch.randn(2, 8, 64).bfloat16()
    first = Q._quantized(lib, stacked[1], "test")
    assert Q._quantized(lib, stacked[1], "test")[0] is first[0]  # a new view: the same quantized rows
    stacked[1].mul_(2)
    again = Q._quantized(lib, stacked[1], "test")
    assert again[0] is not first[0] and torch.equal(again[1], first[1] * 2)
    key = (stacked[1].data_ptr(), (8, 64), (64, 1))
    del stacked, first, again
    Q._quantized(lib, torch.randn(3, 32).bfloat16(), "test")  # a miss: expired entries go
    assert key not in Q._ROWS


@pytest.mark.parametrize(("keys", "needle"), [
    ({"expert_kernel": "int9"}, "did you mean 'int8'"),
    ({"head_kernel": "exakt"}, "did you mean 'exact'"),
    ({"expert_kernel": "int8", "experts": "dense"}, "int8 needs model.experts: mxfp4"),
    ({"head_kernel": "int8", "weights_dtype": "float32"}, "int8 needs model.weights_dtype: bfloat16"),
    ({"attn_kernel": "int4"}, "model.attn_kernel"),
    ({"attn_kernel": "int8", "weights_dtype": "float32"}, "int8 needs model.weights_dtype: bfloat16"),
])
def test_recipe_refuses_bad_kernel_forms(tiny_raw, keys, needle):
    tiny_raw["model"].update({"weights_dtype": "bfloat16", "experts": "mxfp4", **keys})
    with pytest.raises(NeffbuildError) as err:
        R.from_dict(tiny_raw)
    assert needle in str(err.value)


def test_int8_forms_shape_the_cache_key_and_exact_recipes_keep_theirs(tiny_raw):
    tiny_raw["model"].update(weights_dtype="bfloat16", experts="mxfp4")
    exact = R.from_dict(tiny_raw)
    tiny_raw["model"].update(expert_kernel="int8", head_kernel="int8")
    int8 = R.from_dict(tiny_raw)
    assert (int8.model.expert_kernel, int8.model.head_kernel) == ("int8", "int8")
    assert "expert_kernel" not in exact.to_dict()["model"] and int8.to_dict()["model"]["head_kernel"] == "int8"
    assert R.from_dict(int8.to_dict()) == int8  # the normalised recipe reloads to the same one
    target = targets(exact)[0]
    a, b = target_graph(exact, target), target_graph(int8, target)
    assert "expert_kernel" not in a.spec() and a.spec() != b.spec() and b.spec()["head_kernel"] == "int8"
    tiny_raw["model"].update(expert_kernel="exact", head_kernel="exact", attn_kernel="int8")
    attn = R.from_dict(tiny_raw)  # differs from ``exact`` only in model.attn_kernel
    c = target_graph(attn, target)
    assert c.spec()["attn_kernel"] == "int8" and "attn_kernel" not in b.spec()
    assert pre_key(a.spec(), {}, "src") != pre_key(c.spec(), {}, "src")


def test_cli_refuses_an_int8_attention_over_float32_weights(tmp_path, tiny_raw):
    """Exit 2 and one line naming model.attn_kernel and the fix."""
    tiny_raw["model"].update(attn_kernel="int8")  # the tiny recipe's weights are float32
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(tiny_raw))
    res = cli("validate", path)
    lines = [line for line in res.stderr.splitlines() if "model.attn_kernel" in line]
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert len(lines) == 1 and "weights_dtype: bfloat16" in lines[0] and "attn_kernel: exact" in lines[0]


def test_greedy_agreement_of_the_int8_forms_on_the_tiny_model(tiny_recipe, tiny_cfg, capsys):
    """Measured, not required equal: the int8 forms' greedy tokens against the exact forms' (both through the native
    ops, eagerly), token by token over three prompts; the first step's token is the exact head's argmax of nearly
    the same hidden state, so most tokens agree."""
    stacked = W.model_weights(tiny_cfg, None, 0, WeightForm("bfloat16", "mxfp4"))
    layout = KVLayout(tiny_cfg.num_kv_buffers, tiny_recipe.num_blocks, tiny_cfg.num_key_value_heads,
                      tiny_recipe.block_size, tiny_cfg.head_dim, kv_dtype="bfloat16")
    grid = Grid(tiny_recipe.num_seqs_buckets, tiny_recipe.decode_context_length_buckets, tiny_recipe.max_model_len)
    prompts, steps, tokens = [list(range(3, 40)), [7, 1, 9, 200, 13], [(i * 37) % 256 for i in range(50)]], 12, {}
    for forms in ({}, {"expert_kernel": "int8"}, {"expert_kernel": "int8", "head_kernel": "int8"},
                  {"attn_kernel": "int8"}):
        decode = GptOssDecode(tiny_cfg, stacked, **forms).eval()
        session = serving_rank(tiny_cfg, stacked, EagerArtifacts(grid, layout, tiny_recipe.num_swa, decode))
        with native_cpu_ops():
            tokens[tuple(forms)] = engine_runs.greedy(session, prompts, steps).tokens
    exact = tokens[()]
    for forms, got in tokens.items():
        same = sum(a == b for p, q in zip(got, exact, strict=True) for a, b in zip(p, q, strict=True))
        lead = [next((i for i, (a, b) in enumerate(zip(p, q, strict=True)) if a != b), len(p))
                for p, q in zip(got, exact, strict=True)]
        with capsys.disabled():
            print(f"\ngreedy agreement {forms or 'exact'}: {same}/{len(prompts) * steps} tokens, first difference "
                  f"at steps {lead}")
        assert same >= len(prompts)  # the first token of each prompt (prefill runs the exact forms)


# -- the head in integers (native_q8.head16): x rows as int16, exact int32 / int64 sums, rows from four quarters

@pytest.mark.parametrize(("name", "flags", "needs", "path", "head_path"), ISAS, ids=[r[0] for r in ISAS])
def test_integer_head_equals_the_integer_loop(name, flags, needs, path, head_path):
    """Each x row's int16 quantization (bit for bit), ex = sum |x - d qx|, and the logits bit for bit
    fl32((s d) S) with S the exact integer sum, for widths with tails, 1-4 rows a tile and a fifth, vocabularies
    whose last quarter is short (tiles of 1-3 weight rows) or a single row; an all-zero x row gives zeros. On the
    plain path the form is absent (None: the float forms run)."""
    lib = _lib(flags, needs)
    assert lib.q8_head16 == {"vnni": 2, "avx2": 1, "plain": 0}[name]
    g = torch.Generator().manual_seed(17)
    for m, k, v in ((2, 67, 33), (4, 96, 6), (5, 131, 9), (3, 2880, 7), (1, 2880, 13), (1, 45, 1), (1, 64, 5)):
        x, w = torch.randn(m, k, generator=g).bfloat16(), (torch.randn(v, k, generator=g) * 0.05).bfloat16()
        x[m - 1] = 0
        q, s = Q.quantize_rows(lib, w)
        got = Q.head16(lib, x, q, s)
        if name == "plain":
            assert got is None
            continue
        a, ex, qx, d = got
        qmax = lib.neffbuild_q8_head16_qmax(k)
        amax = x.float().abs().amax(-1)
        inv = torch.where(amax > 0, torch.full_like(amax, float(qmax)) / amax, torch.zeros_like(amax))
        assert torch.equal(qx, torch.round(x.float() * inv[:, None]).to(torch.int16))
        assert torch.equal(d, amax / qmax)
        xh = d.double()[:, None] * qx.double()
        torch.testing.assert_close(ex, (x.double() - xh).abs().sum(-1), rtol=1e-12, atol=0)
        exact_sum = (qx.long() @ q.long().t()).double()
        assert torch.equal(a, ((s.double()[None] * d.double()[:, None]) * exact_sum).float()), (m, k)
        assert bool((a[m - 1] == 0).all())


@pytest.mark.parametrize(("name", "flags", "needs", "path", "head_path"), ISAS[1:], ids=[r[0] for r in ISAS[1:]])
def test_integer_head_lanes_cannot_overflow(name, flags, needs, path, head_path):
    """A lane adds 2 products of |q| <= 127 and |qx| <= qmax a step of 32 weights (VNNI ``vpdpwssd``) or 16 (AVX2
    ``vpmaddwd``): qmax keeps it in int32 at any width (32,767 up to K = 8,256 or 4,128, less beyond)."""
    lib = _lib(flags, needs)
    step, widest = {"vnni": (32, 8256), "avx2": (16, 4128)}[name]
    for k in (1, 2880, widest, widest + 1, 300_000):
        qmax = lib.neffbuild_q8_head16_qmax(k)
        assert 0 < qmax <= 32767 and 2 * -(-k // step) * 127 * qmax <= 2 ** 31 - 1, k
        assert (qmax == 32767) == (k <= widest), k


@pytest.mark.parametrize(("case", "kinds", "argmax"), HEAD_TABLE, ids=[r[0] for r in HEAD_TABLE])
def test_integer_head_is_greedy_exact_at_its_error_bound(case, kinds, argmax):
    """The bound table at batch 1 (x) and 2 (x and x scaled by -1, whose argmax is elsewhere): the integer form's
    logits stay within the bound with ex, the bound rows near it, and ``q8_head`` returns the exact form's argmax
    and value in every row."""
    lib = native.library()
    if lib is None or not lib.q8_head16 or not lib.bf16_path:
        pytest.skip("no AVX512-VNNI integer head on this host")
    w, x = _head_table(kinds)
    exact1 = native.bf16_native(lib, x, w)
    got1 = torch.ops.neffbuild.q8_head(x, w)
    assert int(got1.argmax(-1)) == int(exact1.bfloat16().argmax(-1)) == argmax
    assert torch.equal(got1.max(-1).values, exact1.bfloat16().max(-1).values)
    x2 = torch.cat([x, -x])
    exact = native.bf16_native(lib, x2, w)
    q, s = Q.quantize_rows(lib, w)
    a, ex, _, _ = Q.head16(lib, x2, q, s)
    err = (exact.double() - a.double()).abs()
    assert bool((err <= Q.head_bound(s, x2, ex)).all())
    bound_rows = [i for i, kind in enumerate(kinds) if kind == "bound"]
    assert float((err / Q.head_bound(s, x2, ex))[0, bound_rows].min()) > 0.9
    assert int(exact[0].argmax()) == argmax and int(a[0].argmax()) != argmax  # the int8 argmax alone would be wrong
    got = torch.ops.neffbuild.q8_head(x2, w)
    assert torch.equal(got.argmax(-1), exact.bfloat16().argmax(-1))
    assert torch.equal(got.max(-1).values, exact.bfloat16().max(-1).values)
