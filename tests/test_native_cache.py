"""The native ops' build cache (neffbuild/runtime/native_build.py) under the compile cache's rules, and the ops'
input checks: each ISA path built by overriding the flags and checked against the torch forms; a refused,
unwritable or corrupt cache gives the torch forms' numbers, one line on stderr and no crash, and a bad entry is
gone for the next run; a planted library never runs; two processes build once; a hanging compiler is stopped.
Compiles no graph (a few builds of native_cpu.c, under a second each)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from neffbuild.fsutil import sha256_file
from neffbuild.kernels.moe import Mxfp4, decode_eager, dequantize
from neffbuild.runtime import native, native_build

ROOT = Path(__file__).resolve().parents[1]
PROGRESS = "building native kernels"  # the line a build slower than PROGRESS_AFTER_S prints while it runs


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {f for ln in text.splitlines() if ln.startswith("flags") for f in ln.split(":", 1)[1].split()}


# (path, flags, CPU flags it executes, the ISA paths the library must report)
ISAS = [
    ("plain", ("-march=x86-64",), set(), {"mxfp4": 0, "bf16": 0}),
    ("avx2", ("-march=x86-64-v3",), {"avx2", "fma"}, {"mxfp4": 1, "bf16": 1}),
    ("avx512", ("-march=x86-64-v4", "-mavx512bf16"), {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"},
     {"mxfp4": 2, "bf16": 2}),
]


@pytest.mark.parametrize(("name", "flags", "needs", "isa"), ISAS, ids=[row[0] for row in ISAS])
def test_each_isa_path_equals_the_torch_forms(name, flags, needs, isa):
    if platform.machine() not in ("x86_64", "AMD64") or not needs <= _cpu_flags():
        pytest.skip(f"this host cannot execute the {name} path ({sorted(needs - _cpu_flags())} missing)")
    lib = native.library(flags)
    assert lib is not None
    assert {"mxfp4": lib.neffbuild_mxfp4_vectorised(), "bf16": lib.neffbuild_bf16_native()} == isa
    g = torch.Generator().manual_seed(7)
    blocks = torch.randint(0, 256, (5, 37, 3, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(118, 136, (5, 37, 3), dtype=torch.uint8, generator=g)
    scales[2, 4, 1] = 255  # NaN in both forms
    idx = torch.tensor([[0, 4], [2, 1], [3, 3]])
    for kx in (1, 2):
        x = torch.randn(3, kx, 96, generator=g)
        got, want = native.mxfp4_native(lib, x, blocks, scales, idx), native.packed_dot(x, (blocks, scales), idx)
        assert torch.equal(got.isnan(), want.isnan()) and bool(got[1, 0, 4].isnan())
        torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), rtol=1e-5,
                                   atol=1e-5 * float(want.nan_to_num().abs().max()))
        xb = x.bfloat16()  # bf16 x: the AVX-512 BF16 loop where built, else widened; the same products either way
        got = native.mxfp4_native(lib, xb, blocks, scales, idx)
        want = native.packed_dot(xb.float(), (blocks, scales), idx)
        assert torch.equal(got.isnan(), want.isnan())
        torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), rtol=1e-5,
                                   atol=1e-5 * float(want.nan_to_num().abs().max()))
    for m, k, n in ((1, 67, 33), (5, 131, 9), (3, 7, 1)):  # tails past every vector loop, odd weight rows
        x, w = torch.randn(m, k, generator=g).bfloat16(), (torch.randn(n, k, generator=g) * 0.1).bfloat16()
        got = native.bf16_native(lib, x, w)
        torch.testing.assert_close(got, x.float() @ w.float().t(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.bfloat16(), x @ w.t(), rtol=1.6e-2, atol=1e-2)


def test_the_flags_come_from_settings(monkeypatch):
    monkeypatch.setenv("NEFFBUILD_NATIVE_CFLAGS", "-march=x86-64  -O2")
    from neffbuild import settings

    assert settings.native_cflags() == ("-march=x86-64", "-O2")
    lib, note = native_build.obtain()
    assert note is None and lib is not None and lib.neffbuild_mxfp4_vectorised() == 0  # the plain path
    monkeypatch.setenv("NEFFBUILD_NATIVE_CFLAGS", "-march='x86-64")
    lib, note = native_build.obtain()  # a bad value: the torch forms, said
    assert lib is None and "NEFFBUILD_NATIVE_CFLAGS" in note


# ----------------------------------------------------------------------------- a cache that is not to be trusted

CHILD = """
import json, torch
from neffbuild.runtime import native
ok = native.prepare()
g = torch.Generator().manual_seed(0)
b = torch.randint(0, 256, (3, 5, 2, 16), dtype=torch.uint8, generator=g)
s = torch.randint(120, 134, (3, 5, 2), dtype=torch.uint8, generator=g)
x, i = torch.randn(2, 2, 64, generator=g), torch.tensor([[0, 2], [1, 1]])
xb, w = torch.randn(3, 40, generator=g).bfloat16(), torch.randn(7, 40, generator=g).bfloat16()
want, lw = native.packed_dot(x, (b, s), i), (xb @ w.t()).float()
mx, lin = torch.ops.neffbuild.mxfp4_dot(x, b, s, i), torch.ops.neffbuild.bf16_linear(xb, w).float()
print(json.dumps({"native": ok, "mx": float((mx - want).abs().max() / want.abs().max()),
                  "lin": float((lin - lw).abs().max() / lw.abs().max())}))
"""

FOREIGN = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARK, "w");
    if (f) { fputs("ran", f); fclose(f); }
}
void neffbuild_mxfp4_dot(void) {}
int neffbuild_mxfp4_vectorised(void) { return 2; }
int neffbuild_bf16_linear(void) { return 0; }
int neffbuild_bf16_native(void) { return 2; }
"""


def _env(cache: Path, **more) -> dict:
    return dict(os.environ, NEFFBUILD_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT), **more)


def _lines(stderr: str) -> list[str]:
    """stderr's lines, the progress line of a slow build left out (it says a build runs, not what went wrong)."""
    return [ln for ln in stderr.splitlines() if ln.strip() and PROGRESS not in ln]


def _seeded(tmp_path: Path) -> Path:
    """A cache root holding one published entry, built by a child (this process must not map a library the test
    then truncates: that is a bus error in any process that has it loaded); its entry folder."""
    cache = tmp_path / "cache"
    script = ("from neffbuild.runtime import native_build\n"
              "lib, note = native_build.obtain()\nprint(lib is not None, note)")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=_env(cache), timeout=300)
    assert res.stdout.split() == ["True", "None"], res.stderr[-2000:]
    (entry,) = [p.parent for p in (cache / "kernels").glob(f"*/{native_build.LIBRARY}")]
    return entry


def _plant(entry: Path, tmp_path: Path, *, record: bool) -> Path:
    """Replace the entry's library by a valid foreign one (the four symbols and a constructor); ``record``: its
    sha256 written into meta.json too, as whoever could write the folder could. The file the constructor writes."""
    mark, src = tmp_path / "constructor-ran", tmp_path / "foreign.c"
    src.write_text(FOREIGN)
    subprocess.run(["cc", "-shared", "-fPIC", f'-DMARK="{mark}"', "-o", str(entry / native_build.LIBRARY), str(src)],
                   check=True, timeout=120)
    if record:
        meta = json.loads((entry / native_build.META).read_text())
        (entry / native_build.META).write_text(json.dumps(dict(meta, sha256=sha256_file(entry / native_build.LIBRARY))))
    return mark


def _unwritable(tmp_path: Path) -> Path:
    if os.geteuid() != 0:
        cache = tmp_path / "cache"
        cache.mkdir(mode=0o500)
        return cache
    if not Path("/sys").is_dir():
        pytest.skip("root on a host without /sys: no folder root cannot write")
    return Path("/sys/neffbuild-test-cache")  # sysfs: not even root creates a folder there


CASES = [  # (case, what the one stderr line says, whether the next run finds a good entry)
    ("unwritable", "cannot be written", False),
    ("truncated", "does not match the sha256 recorded beside it: removed and rebuilt", True),
    ("foreign", "does not match the sha256 recorded beside it: removed and rebuilt", True),
    ("group_writable", "is writable by group or others", False),
]


@pytest.mark.parametrize(("case", "needle", "recovers"), CASES, ids=[c[0] for c in CASES])
def test_a_bad_cache_gives_the_torch_forms_numbers_and_one_line(case, needle, recovers, tmp_path, monkeypatch):
    mark, scratch = tmp_path / "constructor-ran", tmp_path / "tmpdir"  # this test's own TMPDIR: other tests'
    scratch.mkdir()  # private builds (the suite runs in parallel) never land in the folder it checks
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    if case == "unwritable":
        cache = _unwritable(tmp_path)
    else:
        entry = _seeded(tmp_path)
        cache = entry.parents[1]
        if case == "truncated":
            data = (entry / native_build.LIBRARY).read_bytes()
            (entry / native_build.LIBRARY).write_bytes(data[:len(data) // 2])
        elif case == "foreign":
            mark = _plant(entry, tmp_path, record=False)
        else:  # a planted library with a matching record, in a folder the group may write
            mark = _plant(entry, tmp_path, record=True)
            os.chmod(entry.parent, 0o770)
    res = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                         env=_env(cache, TMPDIR=str(scratch)), cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    assert out["native"] and out["mx"] < 1e-5 and out["lin"] < 1e-2, out  # a private build or the rebuilt entry
    lines = _lines(res.stderr)
    assert len(lines) == 1 and needle in lines[0], res.stderr
    assert not mark.exists()  # the planted library's constructor never ran
    monkeypatch.setenv("NEFFBUILD_CACHE_DIR", str(cache))
    lib, note = native_build.obtain()  # the next run
    assert lib is not None and (note is None) == recovers, note
    assert not list(scratch.glob("neffbuild-kernels-*"))  # private builds leave nothing


def test_a_library_without_a_symbol_this_code_calls_falls_back_with_one_line(tmp_path, monkeypatch, capsys):
    """A loadable library that lacks a function the binding names (seen when the C file and its Python binding were
    edited apart: a build of the old source under the new binding) is not used: one line, the torch forms run,
    never an AttributeError out of a decode step."""
    import ctypes

    src, lib = tmp_path / "part.c", tmp_path / "part.so"
    src.write_text("int neffbuild_mxfp4_dot(void) { return 0; }\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, timeout=120)
    monkeypatch.setattr(native_build, "obtain", lambda flags: (ctypes.CDLL(str(lib)), None))
    assert native._obtain(("-march=x86-64",)) is None
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "undefined symbol" in lines[0] and native.FALLBACK in lines[0], lines


def test_a_hanging_compiler_is_stopped_and_said(tmp_path, monkeypatch, capsys):
    cc, pidfile = tmp_path / "cc", tmp_path / "pid"
    cc.write_text(f'#!/bin/sh\ncase "$*" in *" -o "*) echo $$ > {pidfile}; exec sleep 60;; esac\nexec cc "$@"\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("NEFFBUILD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native_build, "BUILD_TIMEOUT_S", 1.5)
    monkeypatch.setattr(native_build, "PROGRESS_AFTER_S", 0.5)
    start = time.monotonic()
    lib, note = native_build.obtain()
    assert lib is None and "ran past 2 s (stopped)" in note and time.monotonic() - start < 30
    assert PROGRESS in capsys.readouterr().err
    with pytest.raises(ProcessLookupError):
        os.kill(int(pidfile.read_text()), 0)  # the compiler was killed, not left running
    assert not list((tmp_path / "cache" / "kernels").glob("tmp.*"))  # nothing half-built left


OPENER = """
import os, sys, time
from neffbuild.runtime import native
open(sys.argv[1] + ".ready", "w").close()
while not os.path.exists(sys.argv[2]):
    time.sleep(0.01)
print(native.prepare())
"""


def test_two_processes_preparing_at_once_compile_once(tmp_path):
    count, cc = tmp_path / "compiles", tmp_path / "cc"
    cc.write_text(f'#!/bin/sh\ncase "$*" in *" -o "*) echo x >> {count}; sleep 1;; esac\nexec cc "$@"\n')
    cc.chmod(0o755)
    go, env = tmp_path / "go", _env(tmp_path / "cache", CC=str(cc))
    procs = [subprocess.Popen([sys.executable, "-c", OPENER, str(tmp_path / f"p{i}"), str(go)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"p{i}.ready").exists() for i in range(2)) and time.monotonic() < deadline:
        time.sleep(0.05)
    go.touch()  # both imported: they ask at once
    outs = [p.communicate(timeout=300) for p in procs]
    assert [o[0].strip() for o in outs] == ["True", "True"], outs
    assert all(not _lines(o[1]) for o in outs), outs
    assert count.read_text().count("x") == 1


def test_open_bundle_prepares_the_kernels_for_bundles_that_call_them(tmp_path):
    """loaders.prepare_native (open_bundle's call): CPU inductor bundles with MXFP4 or bf16 weights build the
    kernels when opened; float32, neuron and non-CPU bundles build nothing. In a child: a fresh process."""
    script = """
import sys
from pathlib import Path
from neffbuild.runtime.bundle import loaders
kernels = Path(sys.argv[1]) / "kernels"
def man(backend, dtype, device="cpu", piece=None):
    m = {"toolchain": {"backend": backend, "device": device}, "weights": {"tensors": {"a": {"dtype": "float32"}}}}
    if piece:
        m["parallel"] = {"pieces": {"p0": {"tensors": {"b": {"dtype": piece}}}}}
    m["weights"]["tensors"]["c"] = {"dtype": dtype}
    return m
for m, dev in ((man("inductor", "float32"), "cpu"), (man("neuron", "uint8"), "cpu"),
               (man("inductor", "bfloat16", device="cuda"), "cuda")):
    loaders.prepare_native(m, dev)
    assert not kernels.exists(), m
loaders.prepare_native(man("inductor", "float32", piece="uint8"), "cpu")
print(len(list(kernels.glob("*/native_cpu.so"))))
"""
    res = subprocess.run([sys.executable, "-c", script, str(tmp_path / "cache")], capture_output=True, text=True,
                         env=_env(tmp_path / "cache"), timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "1", res.stderr[-2000:]


# ----------------------------------------------------------------------------- what reaches the C code


def _mx():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(2, 1, 64, generator=g), torch.randint(0, 256, (3, 5, 2, 16), dtype=torch.uint8, generator=g),
            torch.randint(120, 134, (3, 5, 2), dtype=torch.uint8, generator=g), torch.tensor([[0, 2], [1, 1]]))


BAD = [  # (op, argument changed, what it becomes, the message)
    ("mxfp4_dot", 1, "meta", "blocks is on meta and x on cpu"),
    ("mxfp4_dot", 2, "meta", "scales is on meta and x on cpu"),
    ("mxfp4_dot", 3, "meta", "idx is on meta and x on cpu"),
    ("mxfp4_dot", 0, "int", "x must be a float tensor"),
    ("bf16_linear", 1, "meta", "w is on meta and x on cpu"),
    ("bf16_linear", 0, "meta", "w is on cpu and x on meta"),
]


@pytest.mark.parametrize(("op", "arg", "change", "needle"), BAD)
def test_every_tensor_is_checked_before_the_c_code(op, arg, change, needle):
    args = list(_mx()) if op == "mxfp4_dot" else [torch.ones(2, 8).bfloat16(), torch.ones(5, 8).bfloat16()]
    args[arg] = args[arg].to("meta") if change == "meta" else args[arg].to(torch.int32)
    with pytest.raises(ValueError, match=f"{op}: ") as err:
        getattr(torch.ops.neffbuild, op)(*args)
    assert needle in str(err.value)


def test_the_fake_kernels_check_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, blocks, idx = torch.empty(2, 1, 64), torch.empty(3, 5, 2, 16, dtype=torch.uint8), torch.zeros(2, 2).long()
        assert torch.ops.neffbuild.mxfp4_dot(x, blocks, torch.empty(3, 5, 2, dtype=torch.uint8), idx).shape == (2, 2, 5)
        with pytest.raises(ValueError, match="scales \\[E, out, G\\] expected"):
            torch.ops.neffbuild.mxfp4_dot(x, blocks, torch.empty(3, 5, 3, dtype=torch.uint8), idx)
        with pytest.raises(ValueError, match="bf16_linear: x \\[M, K\\] and w \\[N, K\\]"):
            torch.ops.neffbuild.bf16_linear(torch.empty(2, 8).bfloat16(), torch.empty(5, 9).bfloat16())


def test_scale_byte_255_is_nan_in_every_form():
    """OCP MX: E8M0 0xFF encodes NaN. The C kernel, packed_dot, dequantize and decode_eager agree."""
    x, blocks, scales, idx = _mx()
    scales[2, 3, 1] = 255
    assert bool(native.e8m0(torch.tensor([255], dtype=torch.uint8)).isnan().all())
    assert float(native.e8m0(torch.tensor([254], dtype=torch.uint8))) == 2.0 ** 127
    got, want = torch.ops.neffbuild.mxfp4_dot(x, blocks, scales, idx), native.packed_dot(x, (blocks, scales), idx)
    assert native.library() is not None
    assert torch.equal(got.isnan(), want.isnan()) and int(want.isnan().sum()) == 1 and bool(want[0, 1, 3].isnan())
    w = Mxfp4(blocks, scales)
    dense = dequantize(w, torch.float32)
    assert torch.equal(dense.isnan(), decode_eager(w, torch.float32).isnan())
    assert dense[2, 3, 32:].isnan().all() and not dense[2, 3, :32].isnan().any()
