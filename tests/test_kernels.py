"""Each decode kernel against a direct (loop or dense) reference."""

import importlib
import math

import pytest
import torch

from neffbuild.kernels import (
    apply_rope,
    moe,
    paged_attention,
    rms_norm,
    sdpa_with_sinks,
    swiglu,
    write_kv,
    yarn_inv_freq,
)
from neffbuild.kernels.moe import DENSE_TOKENS
from neffbuild.runtime.kv.access import FP8, fp8_bytes_to_float, gather_blocks, pack_k_fp8_view

moe_module = importlib.import_module("neffbuild.kernels.moe")  # the package's ``moe`` is the function

g = torch.Generator().manual_seed(0)


def rnd(*s):
    return torch.randn(*s, generator=g)


def ref_attention(q, k, v, sinks, scale, q_pos, k_pos, window):
    """Loop reference: one query, one head at a time. q [S, H, d]; k, v [T, h, d]."""
    S, H, d = q.shape
    h = k.shape[1]
    out = torch.zeros(S, H, d)
    for s in range(S):
        for head in range(H):
            kv = head // (H // h)
            ok = [t for t in range(k.shape[0])
                  if k_pos[t] <= q_pos[s] and (window is None or k_pos[t] > q_pos[s] - window)]
            logits = torch.stack([q[s, head] @ k[t, kv] * scale for t in ok] + [sinks[head]])
            p = torch.softmax(logits, 0)[:-1]
            out[s, head] = sum(p[i] * v[t, kv] for i, t in enumerate(ok)) if ok else 0
    return out


def test_paged_attention_matches_loop_reference():
    nb, h, bs, d, H = 10, 2, 4, 8, 4
    kc, vc = rnd(nb, h, bs, d), rnd(nb, h, bs, d)
    table = torch.tensor([[3, 7, 1], [5, 2, 9]])
    q_pos = torch.tensor([[9], [6]])
    q, sinks = rnd(2, 1, H, d), rnd(H)
    for window, offset in ((None, torch.tensor([0, 0])), (5, torch.tensor([4, 0]))):
        got = paged_attention(q, torch.stack([kc, vc]), table, q_pos, offset, sinks, 0.3, window).view(2, 1, H, d)
        for b in range(2):
            k = kc[table[b]].permute(0, 2, 1, 3).reshape(-1, h, d)
            v = vc[table[b]].permute(0, 2, 1, 3).reshape(-1, h, d)
            k_pos = offset[b] + torch.arange(k.shape[0])
            want = ref_attention(q[b], k, v, sinks, 0.3, q_pos[b], k_pos, window)
            torch.testing.assert_close(got[b], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fast_bf16", [False, True], ids=["slow-bf16-matmul", "fast-bf16-matmul"])
def test_decode_attention_matmuls_run_in_the_hosts_matmul_dtype(monkeypatch, fast_bf16):
    """GQA 8 (the gathered-copy form): a bf16 decode's two batched matmuls run in ``matmul_dtype`` (float32 where
    oneDNN has no fast bf16 kernel: there they took 12 ms a layer against 0.7, docs/benchmarks.md "Real width"),
    eagerly and in a graph traced for AOTInductor's CPU code (``native_cpu_ops``), read in the traced graph as the
    graph compiles it; a graph traced for another backend (Neuron) keeps bf16 whatever the build host. The result is
    bf16 either way and near the loop reference."""
    from torch.fx.experimental.proxy_tensor import make_fx

    monkeypatch.setattr(moe_module, "matmul_dtype",
                        (lambda dt: dt) if fast_bf16 else (lambda dt: torch.float32 if dt == torch.bfloat16 else dt))
    nb, h, bs, d, H = 6, 1, 4, 8, 8
    kc, vc = rnd(nb, h, bs, d).bfloat16(), rnd(nb, h, bs, d).bfloat16()
    table, q_pos, offset = torch.tensor([[3, 1, 5]]), torch.tensor([[10]]), torch.tensor([0])
    q, sinks = rnd(1, 1, H, d).bfloat16(), rnd(H)

    def step(q, cache, table, q_pos, offset, sinks):
        return paged_attention(q, cache, table, q_pos, offset, sinks, 0.3, None)

    def matmul_dtypes(gm):
        bmm = [n for n in gm.graph.nodes if n.target in (torch.ops.aten.bmm.default, torch.ops.aten.mm.default)]
        assert len(bmm) >= 2
        return {a.meta["val"].dtype for n in bmm for a in n.args[:2]}

    args = (q, torch.stack([kc, vc]), table, q_pos, offset, sinks)
    want_dtype = torch.bfloat16 if fast_bf16 else torch.float32
    assert matmul_dtypes(make_fx(step)(*args)) == {want_dtype}  # eager (real tensors)
    with moe_module.native_cpu_ops():
        assert matmul_dtypes(make_fx(step, tracing_mode="fake")(*args)) == {want_dtype}
    assert matmul_dtypes(make_fx(step, tracing_mode="fake")(*args)) == {torch.bfloat16}
    got = step(*args)
    assert got.dtype == torch.bfloat16
    k = kc[table[0]].permute(0, 2, 1, 3).reshape(-1, h, d).float()
    v = vc[table[0]].permute(0, 2, 1, 3).reshape(-1, h, d).float()
    want = ref_attention(q[0].float(), k, v, sinks, 0.3, q_pos[0], torch.arange(k.shape[0]), None)
    torch.testing.assert_close(got.view(1, H, d).float(), want, atol=3e-2, rtol=3e-2)


def test_compute_dtype_is_the_hosts_only_for_eager_and_inductor_cpu_graphs(monkeypatch):
    """Where bf16 matmuls are slow, eager code and AOTInductor CPU graphs widen them to float32; a graph another
    backend traces (the Neuron compiler runs ``torch.jit.trace`` on real tensors) keeps bf16, and the host query
    is never recorded into it."""
    monkeypatch.setattr(moe_module, "matmul_dtype", lambda dt: torch.float32 if dt == torch.bfloat16 else dt)
    x = rnd(2, 3).bfloat16()
    assert moe_module.compute_dtype(x) == torch.float32 and moe_module.compute_dtype(x.float()) == torch.float32
    assert moe_module.compute_dtype(torch.empty(2, 3, dtype=torch.bfloat16, device="meta")) == torch.bfloat16
    graph = torch.jit.trace(lambda x: x.to(moe_module.compute_dtype(x)) * 2, x)
    assert graph(x).dtype == torch.bfloat16


def test_paged_attention_packed_fp8_and_several_queries_match_loop_reference():
    """Packed FP8 K (and FP8 V) read through the table, 3 query rows per request (a spec step), GQA 2."""
    nb, h, bs, d, H, S = 10, 2, 4, 8, 4, 3
    cache = torch.stack([rnd(nb, h, bs, d), rnd(nb, h, bs, d)]).to(FP8)
    packed = torch.zeros(2, nb, h, bs, d, dtype=FP8)
    slots = torch.arange(nb * bs)
    write_kv(packed, 0, slots, cache[0].float().permute(0, 2, 1, 3).reshape(-1, h, d), True)
    write_kv(packed, 1, slots, cache[1].float().permute(0, 2, 1, 3).reshape(-1, h, d), False)
    table = torch.tensor([[3, 7, 1], [5, 2, 9]])
    q_pos = torch.tensor([[7, 8, 9], [4, 5, 6]])
    q, sinks = rnd(2, S, H, d), rnd(H)
    for window, offset in ((None, torch.tensor([0, 0])), (5, torch.tensor([4, 0]))):
        got = paged_attention(q, packed.view(torch.uint8), table, q_pos, offset, sinks, 0.3, window, True)
        for b in range(2):
            k = cache[0, table[b]].float().permute(0, 2, 1, 3).reshape(-1, h, d)
            v = cache[1, table[b]].float().permute(0, 2, 1, 3).reshape(-1, h, d)
            want = ref_attention(q[b], k, v, sinks, 0.3, q_pos[b], offset[b] + torch.arange(k.shape[0]), window)
            torch.testing.assert_close(got[b].view(S, H, d), want, atol=1e-5, rtol=1e-5)


def test_fp8_bytes_decode_bit_exact_for_every_byte():
    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want, got = raw.view(FP8).float(), fp8_bytes_to_float(raw)
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().sum() == 2
    finite = ~want.isnan()
    assert torch.equal(got[finite].view(torch.int32), want[finite].view(torch.int32))  # signed zeros, subnormals


def test_dense_sdpa_matches_loop_reference():
    S, H, h, d = 7, 4, 2, 8
    q, k, v, sinks = rnd(1, S, H, d), rnd(1, S, h, d), rnd(1, S, h, d), rnd(H)
    for window in (None, 3):
        got = sdpa_with_sinks(q, k, v, sinks, 0.5, window).view(S, H, d)
        want = ref_attention(q[0], k[0], v[0], sinks, 0.5, torch.arange(S), torch.arange(S), window)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_kv_write_skips_pad_and_packed_layout():
    nb, h, bs, d = 4, 2, 4, 3
    for packed in (False, True):
        cache = torch.zeros(2, nb, h, bs, d, dtype=torch.float8_e4m3fn if packed else torch.float32)
        vals = torch.arange(3 * h * d, dtype=torch.float32).view(3, h, d) / 8
        write_kv(cache, 0, torch.tensor([5, -1, 14]), vals, packed)
        logical = gather_blocks(cache, 0, torch.arange(nb)[None], packed, torch.float32)[0]  # [h, nb*bs, d]
        assert torch.equal(logical[:, 5], vals[0].to(cache.dtype).float())
        assert torch.equal(logical[:, 14], vals[2].to(cache.dtype).float())
        assert logical.abs().sum() == vals[[0, 2]].to(cache.dtype).float().abs().sum()  # pad wrote nothing
        assert cache[1].float().abs().sum() == 0  # the V half is untouched by a K write
        if packed:  # logical K[b, h, t, d] at packed[b, h, t // 2, d, t % 2]
            p = pack_k_fp8_view(cache[0])
            assert torch.equal(p[1, :, 0, :, 1].float(), vals[0].to(cache.dtype).float())  # slot 5: b1 t1
            assert torch.equal(p[3, :, 1, :, 0].float(), vals[2].to(cache.dtype).float())  # slot 14: b3 t2
        write_kv(cache, 1, torch.tensor([6]), vals[:1], False)
        got = gather_blocks(cache, 1, torch.tensor([[1]]), False, torch.float32)[0, :, 2]  # slot 6 = block 1, t 2
        assert torch.equal(got, vals[0].to(cache.dtype).float())


# the indexed product-and-sum (5 tokens); from DENSE_TOKENS on, eager: expert by expert over its tokens, traced:
# every expert on every token (a graph's shapes cannot follow the routing)
@pytest.mark.parametrize("N,traced", [(5, False), (DENSE_TOKENS, False), (DENSE_TOKENS, True)])
def test_moe_matches_per_token_loop(N, traced, monkeypatch):
    H, I, E, k = 6, 4, 4, 2
    x, rw, rb = rnd(N, H), rnd(E, H), rnd(E)
    gw, gb, dw, db = rnd(E, 2 * I, H), rnd(E, 2 * I), rnd(E, H, I), rnd(E, H)  # experts [out, in]
    monkeypatch.setattr(moe_module, "traced", lambda x: traced)
    got = moe(x, rw, rb, gw, gb, dw, db, k, 1.702, 7.0)
    for n in range(N):
        logits = x[n] @ rw.t() + rb
        top = torch.topk(logits, k)
        w = torch.softmax(top.values, 0)
        want = sum(w[j] * (dw[e] @ swiglu(gw[e] @ x[n] + gb[e], 1.702, 7.0) + db[e]) for j, e in enumerate(top.indices))
        torch.testing.assert_close(got[n], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("N,traced", [(5, False), (DENSE_TOKENS, False), (DENSE_TOKENS, True)])
def test_moe_expert_slices_sum_to_the_whole(N, traced, monkeypatch):
    """Two EP ranks' slices (``first_expert``) add up to the unsharded MoE, in every form."""
    monkeypatch.setattr(moe_module, "traced", lambda x: traced)
    H, I, E, k = 6, 4, 4, 2
    x, rw, rb = rnd(N, H), rnd(E, H), rnd(E)
    gw, gb, dw, db = rnd(E, 2 * I, H), rnd(E, 2 * I), rnd(E, H, I), rnd(E, H)  # experts [out, in]
    whole = moe(x, rw, rb, gw, gb, dw, db, k, 1.702, 7.0)
    parts = [moe(x, rw, rb, gw[s], gb[s], dw[s], db[s], k, 1.702, 7.0, first_expert=torch.tensor([s.start]))
             for s in (slice(0, 2), slice(2, 4))]
    assert not torch.allclose(parts[0], whole, atol=1e-3)
    torch.testing.assert_close(parts[0] + parts[1], whole, atol=1e-5, rtol=1e-5)


def test_swiglu_clamp():
    gu = torch.tensor([[10.0, -10.0, 1.0, 2.0]])
    out = swiglu(gu, 1.702, 7.0)
    assert torch.allclose(out[0, 0], torch.tensor((-7 + 1) * 7 * torch.sigmoid(torch.tensor(7 * 1.702)).item()))


def test_rope_rotates_pairs_and_yarn_scale():
    inv, scale = yarn_inv_freq(8, {"rope_type": "default", "rope_theta": 10000.0})
    assert scale == 1.0 and torch.allclose(inv, 1 / 10000 ** (torch.arange(0, 8, 2) / 8))
    x = rnd(1, 1, 8)
    ang = 3 * inv
    out = apply_rope(x, ang.cos()[None], ang.sin()[None])
    x1, x2 = x[..., :4], x[..., 4:]
    torch.testing.assert_close(out[..., :4], x1 * ang.cos() - x2 * ang.sin())
    _, yscale = yarn_inv_freq(64, {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096})
    assert math.isclose(yscale, 0.1 * math.log(32) + 1)


def test_rms_norm():
    x, w = rnd(3, 8), rnd(8)
    torch.testing.assert_close(rms_norm(x, w, 1e-5), w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5))
