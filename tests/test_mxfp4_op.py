"""``neffbuild::mxfp4_dot``, the native packed-expert product compiled CPU graphs call (neffbuild/runtime/native.py):
the same numbers as the traced torch form, bad inputs refused before the C code reads anything, and the torch form
when no C compiler builds the kernel. Compiles nothing (the compiled MXFP4 bundle's tokens against the eager
reference and transformers: tests/test_serving_dtypes.py)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch

from neffbuild.kernels.moe import Mxfp4, moe, native_cpu_ops
from neffbuild.runtime import native


def _weights(E=6, out=48, groups=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (E, out, groups, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(112, 135, (E, out, groups), dtype=torch.uint8, generator=g)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kx", [1, 3])
def test_op_equals_the_torch_form(kx, dtype):
    blocks, scales = _weights()
    x = torch.randn(4, kx, 5 * 32).to(dtype)
    idx = torch.tensor([[0, 5, 2], [1, 1, 3], [4, 0, 5], [2, 3, 1]])
    got = torch.ops.neffbuild.mxfp4_dot(x, blocks, scales, idx)
    want = native.packed_dot(x, (blocks, scales), idx)
    assert got.dtype == dtype and got.shape == (4, 3, 48)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-5 if dtype == torch.float32 else 1e-2,
                               atol=1e-4 * float(want.float().abs().max()))
    assert native.library() is not None  # the test host has a C compiler: the C kernel ran, not the fallback


def test_every_scale_and_code_decodes_exactly():
    """Scale bytes 0..254 (2^-127 .. 2^127) and every code pair, against a one-hot x: each output is one weight."""
    E, out, groups = 1, 255, 1
    scales = torch.arange(255, dtype=torch.uint8).view(E, out, groups)
    blocks = (torch.arange(out * 16) % 256).to(torch.uint8).view(E, out, groups, 16)
    idx = torch.zeros(1, 1, dtype=torch.int64)
    for pos in (0, 1, 17, 30):
        x = torch.zeros(1, 1, 32)
        x[0, 0, pos] = 1.0
        got = torch.ops.neffbuild.mxfp4_dot(x, blocks, scales, idx)
        assert torch.equal(got, native.packed_dot(x, (blocks, scales), idx)), pos


def test_moe_through_the_op_equals_the_traced_form():
    torch.manual_seed(0)
    H, I, E = 64, 32, 6
    gate_up, down = Mxfp4(*_weights(E, 2 * I, H // 32, 1)), Mxfp4(*_weights(E, H, I // 32, 2))
    args = (torch.randn(E, H) * 0.1, torch.zeros(E), gate_up, torch.zeros(E, 2 * I), down, torch.zeros(E, H), 2,
            1.702, 7.0)
    x = torch.randn(3, H)
    plain = moe(x, *args)
    with native_cpu_ops():
        native = moe(x, *args)
    torch.testing.assert_close(native, plain, rtol=1e-5, atol=1e-5 * float(plain.abs().max()))


def test_a_host_engines_eager_prefill_runs_the_op_row_by_row_and_the_reference_stays_torch(monkeypatch):
    """``native.eager_experts`` (runtime/bundle/eager.py's prefill): from DENSE_TOKENS tokens on, eager packed
    experts run ``mxfp4_dot`` on the picked rows instead of decoding each routed expert whole (``_grouped``); close
    values (the op rounds the gate/up product to bf16, as the compiled step does); outside it, and above
    EAGER_NATIVE_ROWS, ``_grouped`` as before."""
    moe_module = importlib.import_module("neffbuild.kernels.moe")
    torch.manual_seed(1)
    H, I, E, N = 64, 32, 6, moe_module.DENSE_TOKENS + 3
    gate_up, down = Mxfp4(*_weights(E, 2 * I, H // 32, 3)), Mxfp4(*_weights(E, H, I // 32, 4))
    bf16 = torch.bfloat16
    args = ((torch.randn(E, H) * 0.1).to(bf16), torch.zeros(E, dtype=bf16), gate_up,
            (torch.randn(E, 2 * I) * 0.1).to(bf16), down, (torch.randn(E, H) * 0.1).to(bf16), 2, 1.702, 7.0)
    x = torch.randn(N, H).to(bf16)
    assert native.prepare()
    calls = []
    op = torch.ops.neffbuild.mxfp4_dot

    class Counting:  # the op as the module calls it, counted
        def __call__(self, *a):
            calls.append(a[0].shape)
            return op(*a)

    monkeypatch.setattr(moe_module.torch.ops.neffbuild, "mxfp4_dot", Counting(), raising=False)
    grouped = moe(x, *args)  # the eager reference: expert by expert, no op call
    assert calls == []
    with native.eager_experts():
        fast = moe(x, *args)
        assert [c[0] for c in calls] == [N, N]  # gate/up then down, every token's picked rows
        calls.clear()
        monkeypatch.setattr(moe_module, "EAGER_NATIVE_ROWS", N * 2 - 1)
        assert torch.equal(moe(x, *args), grouped) and calls == []  # too many rows: expert by expert again
    # close: float32 sums in another order, and the op's gate/up product rounded to bf16 before the SwiGLU
    torch.testing.assert_close(fast.float(), grouped.float(), rtol=2e-2, atol=1e-2 * float(grouped.float().abs().max()))


@pytest.mark.parametrize(("change", "needle"), [
    ("idx_high", "expert ids must lie in [0, 6)"),
    ("idx_negative", "expert ids must lie in [0, 6)"),
    ("idx_float", "idx must be an integer tensor"),
    ("blocks_int8", "blocks and scales must be uint8"),
    ("x_width", "x must be [N, 1 or k, 160]"),
    ("idx_rows", "idx must be [N, k]"),
    ("scales_shape", "scales [E, out, G] expected"),
])
def test_bad_inputs_are_refused_before_the_c_code(change, needle):
    blocks, scales = _weights()
    x, idx = torch.randn(2, 1, 160), torch.tensor([[0, 1], [2, 3]])
    if change == "idx_high":
        idx = idx + 4
    elif change == "idx_negative":
        idx = idx - 1
    elif change == "idx_float":
        idx = idx.float()
    elif change == "blocks_int8":
        blocks = blocks.to(torch.int8)
    elif change == "x_width":
        x = torch.randn(2, 1, 128)
    elif change == "idx_rows":
        idx = torch.tensor([[0, 1]])
    elif change == "scales_shape":
        scales = scales[:, :, :4]
    with pytest.raises(ValueError, match="mxfp4_dot: ") as err:
        torch.ops.neffbuild.mxfp4_dot(x, blocks, scales, idx)
    assert needle in str(err.value)


def test_without_a_c_compiler_the_torch_form_runs_and_says_so(tmp_path):
    """CC names a compiler that fails: one line on stderr, and the same numbers as the torch form."""
    script = ("import torch\nfrom neffbuild.runtime import native\n"
              "b = torch.randint(0, 256, (2, 8, 1, 16), dtype=torch.uint8)\n"
              "s = torch.full((2, 8, 1), 127, dtype=torch.uint8)\n"
              "x = torch.randn(1, 1, 32); i = torch.tensor([[1]])\n"
              "assert native.library() is None\n"
              "assert torch.equal(torch.ops.neffbuild.mxfp4_dot(x, b, s, i), native.packed_dot(x, (b, s), i))\n"
              "print('same')\n")
    env = dict(os.environ, CC="/bin/false", NEFFBUILD_CACHE_DIR=str(tmp_path / "cache"))
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, env=env,
                         timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "same", res.stderr[-2000:]
    assert "could not build native_cpu.c" in res.stderr and "slower torch form" in res.stderr
    assert not list((tmp_path / "cache").rglob("*.so"))  # nothing half-built left in the cache


def test_the_kernel_is_built_once_into_the_cache_folder():
    from neffbuild import settings

    lib = native.library()
    assert lib is not None and lib.neffbuild_mxfp4_vectorised() in (0, 1, 2)
    assert native.library() is lib  # one build and one load per process
    built = list((settings.cache_dir() / "kernels").rglob("native_cpu.so"))
    ours = f"tmp.*.{os.getpid()}.*/*.so"  # this process's stage (other workers of the suite may be building)
    assert built and not list((settings.cache_dir() / "kernels").glob(ours))  # renamed into place


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kx", [1, 3])
def test_picks_sharing_an_expert_change_no_bit(kx, dtype):
    """At batch > 1 the picks routed to one expert share each decoded group (in chunks of 4): every row's values
    are bit for bit those of the row computed alone."""
    blocks, scales = _weights(E=3, out=40, groups=5, seed=2)
    x = torch.randn(7, kx, 5 * 32).to(dtype)
    idx = torch.tensor([[0, 1, 2], [0, 2, 1], [2, 0, 1], [1, 0, 0], [0, 1, 2], [2, 2, 0], [0, 1, 2]])
    together = torch.ops.neffbuild.mxfp4_dot(x, blocks, scales, idx)
    alone = torch.cat([torch.ops.neffbuild.mxfp4_dot(x[i:i + 1], blocks, scales, idx[i:i + 1]) for i in range(7)])
    assert torch.equal(together, alone)


def test_the_eager_decode_gives_the_torch_decodes_bits():
    """``native.decode_bf16`` (eager prefill decodes each routed expert with it): every byte under every scale byte,
    the NaN scale included, bit for bit the torch table decode's bfloat16 values; refused inputs give None."""
    from neffbuild.kernels.moe import _pair_words

    blocks = torch.arange(256, dtype=torch.uint8).repeat(256, 1).view(256, 16, 16)  # row r: scale byte r
    scales = torch.arange(256, dtype=torch.uint8)[:, None].expand(256, 16).contiguous()
    got = native.decode_bf16(blocks, scales)
    want = (_pair_words()[blocks.int()].view(torch.bfloat16) * native.e8m0(scales).to(torch.bfloat16)[..., None])
    want = want.flatten(-2)
    assert got is not None and got.shape == want.shape == (256, 512) and got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16)[:255], want.view(torch.int16)[:255]) and bool(got[255].isnan().all())
    assert native.decode_bf16(blocks.int(), scales) is None and native.decode_bf16(blocks, scales[:, :3]) is None


def test_threads_split_the_rows_and_change_no_value():
    """The C loop runs on torch's thread count (OpenMP): each output is one row's dot product either way."""
    blocks, scales = _weights(E=4, out=64, groups=3)
    x, idx = torch.randn(3, 2, 96), torch.tensor([[0, 3], [1, 1], [2, 0]])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.neffbuild.mxfp4_dot(x, blocks, scales, idx)
        torch.set_num_threads(2)
        two = torch.ops.neffbuild.mxfp4_dot(x, blocks, scales, idx)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_bf16_linear_equals_a_bf16_matmul():
    """The LM head's op: float32 sums rounded to bfloat16, as the matmul gives them (within one bf16 rounding:
    the two sum in different orders); rows of x in fours and a tail, a width with a tail past the vector loops, an
    odd count of weight rows (the AVX2 path takes them in pairs)."""
    g = torch.Generator().manual_seed(3)
    for m, k, n in ((1, 96, 300), (5, 80, 301), (2, 37, 7), (4, 64, 1)):
        x = torch.randn(m, k, generator=g).bfloat16()
        w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
        got = torch.ops.neffbuild.bf16_linear(x, w)
        want = x.float() @ w.float().t()
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(got, (x @ w.t()), rtol=1.6e-2, atol=1e-2)
    with pytest.raises(ValueError, match="bf16_linear: "):
        torch.ops.neffbuild.bf16_linear(x.float(), w)
    assert native.library().neffbuild_bf16_native() in (0, 1, 2)  # plain, AVX2 + FMA, AVX-512 BF16
