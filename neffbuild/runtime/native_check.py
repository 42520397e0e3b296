"""A freshly built ``native_cpu.so``, loaded and run on a known answer before it is published (or loaded by a
serving process): ``python -I -S native_check.py LIB`` prints the library's ISA paths as JSON and exits 0, or says
what is wrong and exits 1. A child process, so a library that crashes on load or on its first call (a flag this CPU
cannot execute, a broken toolchain) kills the child, not the process that asked.

Standard library only (ctypes), and no import of neffbuild: the child starts in a few tens of milliseconds. The
inputs are small integers and powers of two, so every sum is exact in float32 and the answer is compared exactly;
one MXFP4 group has scale byte 255, which is NaN (OCP MX: E8M0 0xFF encodes NaN) in every form of the op.
"""

from __future__ import annotations

import ctypes
import json
import math
import sys

SYMBOLS = ("neffbuild_mxfp4_dot", "neffbuild_mxfp4_dot_bf16", "neffbuild_mxfp4_vectorised", "neffbuild_bf16_linear",
           "neffbuild_bf16_native", "neffbuild_mxfp4_q8_dot", "neffbuild_q8_path", "neffbuild_q8_quantize",
           "neffbuild_q8_rows", "neffbuild_q8_linear", "neffbuild_q8_head_path", "neffbuild_bf16_linear_at",
           "neffbuild_q8_pick", "neffbuild_mxfp4_decode_bf16")
TWICE_E2M1 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _scale(s: int) -> float:
    return math.nan if s == 255 else math.ldexp(0.5, s - 127)


def _mxfp4_case(lib) -> str | None:
    """Two rows, two picks each (x per pick), two experts of three output rows and two 32-value groups."""
    E, out, G, n, k = 2, 3, 2, 2, 2
    n_in = G * 32
    x = [float((i * 5) % 7 - 3) for i in range(n * k * n_in)]
    blocks = [(i * 37 + 11) % 256 for i in range(E * out * G * 16)]
    scales = [126 + (i % 3) for i in range(E * out * G)]
    scales[4] = 255  # expert 0, row 2, group 0: NaN
    idx = [1, 0, 0, 1]
    want = []
    for pick in range(n * k):
        e, xr = idx[pick], x[pick * n_in:(pick + 1) * n_in]
        for o in range(out):
            total = 0.0
            for g in range(G):
                row = blocks[((e * out + o) * G + g) * 16:][:16]
                part = sum(TWICE_E2M1[b & 15] * xr[g * 32 + 2 * i] + TWICE_E2M1[b >> 4] * xr[g * 32 + 2 * i + 1]
                           for i, b in enumerate(row))
                total += part * _scale(scales[(e * out + o) * G + g])
            want.append(total)
    rest = ((ctypes.c_uint8 * len(blocks))(*blocks), (ctypes.c_uint8 * len(scales))(*scales),
            (ctypes.c_int64 * len(idx))(*idx), ctypes.c_int64(n), ctypes.c_int64(k), ctypes.c_int64(out),
            ctypes.c_int64(G))
    y = (ctypes.c_float * len(want))()
    status = lib.neffbuild_mxfp4_dot((ctypes.c_float * len(x))(*x), ctypes.c_int64(k), *rest, y, ctypes.c_int(1))
    why = f"neffbuild_mxfp4_dot returned {status}" if status else _compare("neffbuild_mxfp4_dot", list(y), want)
    yb = (ctypes.c_float * len(want))()  # x in bf16 (small integers: exact), on a build with AVX-512 BF16
    status = lib.neffbuild_mxfp4_dot_bf16((ctypes.c_uint16 * len(x))(*map(_bf16, x)), ctypes.c_int64(k), *rest, yb,
                                          ctypes.c_int(1))
    if status not in (0, 2):
        return why or f"neffbuild_mxfp4_dot_bf16 returned {status}"
    return why or (None if status == 2 else _compare("neffbuild_mxfp4_dot_bf16", list(yb), want))


def _bf16(v: float) -> int:  # small integers: bfloat16 is float32's upper half, exactly
    return int.from_bytes(ctypes.c_float(v), "little") >> 16


def _bf16_case(lib) -> str | None:
    """x [3, 37] times w [5, 37]: widths past every vector loop's tail, an odd count of weight rows."""
    m, n_in, out = 3, 37, 5
    x = [float((i * 3) % 5 - 2) for i in range(m * n_in)]
    w = [float((i * 7) % 9 - 4) for i in range(out * n_in)]

    want = [sum(x[r * n_in + t] * w[o * n_in + t] for t in range(n_in)) for r in range(m) for o in range(out)]
    y = (ctypes.c_float * (m * out))()
    status = lib.neffbuild_bf16_linear((ctypes.c_uint16 * len(x))(*map(_bf16, x)), ctypes.c_int64(m),
                                       (ctypes.c_uint16 * len(w))(*map(_bf16, w)), ctypes.c_int64(out),
                                       ctypes.c_int64(n_in), y, ctypes.c_int(1))
    return f"neffbuild_bf16_linear returned {status}" if status else _compare("neffbuild_bf16_linear", list(y), want)


def _compare(name: str, got: list[float], want: list[float]) -> str | None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if not (a == b or (math.isnan(a) and math.isnan(b))):
            return f"{name} gave {a} at {i}, the known answer is {b}"
    return None


def check(path: str) -> dict:
    """The library's ISA paths ({"mxfp4": 0-2, "bf16": 0-2}); ValueError saying what is wrong."""
    lib = ctypes.CDLL(path)
    for name in SYMBOLS:
        if not hasattr(lib, name):
            raise ValueError(f"exports no {name}")
    lib.neffbuild_mxfp4_dot.restype = ctypes.c_int
    lib.neffbuild_mxfp4_dot_bf16.restype = ctypes.c_int
    lib.neffbuild_bf16_linear.restype = ctypes.c_int
    isa = {"mxfp4": int(lib.neffbuild_mxfp4_vectorised()), "bf16": int(lib.neffbuild_bf16_native())}
    if not set(isa.values()) <= {0, 1, 2}:
        raise ValueError(f"reports unknown ISA paths {isa}")
    why = _mxfp4_case(lib) or _bf16_case(lib)
    if why:
        raise ValueError(why)
    return isa


def main(argv: list[str]) -> int:
    try:
        print(json.dumps(check(argv[1])))
    except (OSError, ValueError, IndexError) as exc:
        print(f"{exc}"[:300], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
