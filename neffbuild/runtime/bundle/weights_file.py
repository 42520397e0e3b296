"""Weights of a bundle: the safetensors header checked with limits, then mapped by the safetensors library.

The header is read and checked here before the library sees the file, so a hostile file gets a
``BundleError`` naming the tensor and the rule instead of a native error or a huge allocation:
header length bounded (and inside the file), UTF-8 JSON of bounded depth, known dtypes, shapes of
non-negative ints whose byte count equals the tensor's span, spans that tile the data area (no overlaps,
no gaps: the library's rule), ``__metadata__`` of strings only.
Then ``safetensors.safe_open`` maps the file once (a private, copy-on-write mapping); every tensor is
a view of that one mapping, so N artifacts bound to these tensors share one copy in memory.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING

from neffbuild.errors import BundleError

if TYPE_CHECKING:  # torch is imported where tensors are made: reading a header (validate) needs none
    import torch

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
MAX_JSON_DEPTH = 8  # {name: {"shape": [..]}} is 3 deep; anything much deeper is not a safetensors header
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
            "F8_E4M3": 1, "F8_E5M2": 1}
TORCH_DTYPE = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
               "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
               "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def json_depth_ok(text: str, limit: int) -> bool:
    """Whether brackets nest at most ``limit`` deep (checked before json.loads can recurse)."""
    depth, in_str, escaped = 0, False, False
    for ch in text:
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return False
        elif ch in "]}":
            depth -= 1
    return True


def read_header(path: Path) -> tuple[int, dict]:
    """(data area start, {name: {"dtype", "shape", "data_offsets"}}) after every structural check."""
    where = str(path)
    try:
        size = os.stat(path).st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise BundleError(f"{where}: {size} bytes is too short for a safetensors file (8-byte header length)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or n > size - 8:
                raise BundleError(f"{where}: header length {n} exceeds the file ({size} bytes) or the "
                                  f"{MAX_HEADER_BYTES}-byte limit")
            raw = f.read(n)
    except OSError as exc:
        raise BundleError(f"{where}: cannot read weights ({exc.strerror or exc})") from None
    try:
        text = raw.decode("utf-8")
        if not json_depth_ok(text, MAX_JSON_DEPTH):
            raise ValueError(f"nested deeper than {MAX_JSON_DEPTH}")
        header = json.loads(text)
    except (UnicodeDecodeError, ValueError) as exc:
        raise BundleError(f"{where}: safetensors header is not valid JSON ({str(exc)[:120]})") from None
    if not isinstance(header, dict):
        raise BundleError(f"{where}: safetensors header must be a JSON object")
    base = 8 + n
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise BundleError(f"{where}: __metadata__ must map strings to strings (the safetensors library refuses "
                          "anything else)")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    check_entries(where, tensors, size - base)
    return base, tensors


def _shape_ok(shape) -> bool:
    return isinstance(shape, list) and len(shape) <= 16 and all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**62 for d in shape)


def check_entries(where: str, tensors: dict, data_bytes: int) -> None:
    """Known dtypes, int shapes, byte counts that match, spans in the data area, no overlaps."""
    spans = []
    for name, info in tensors.items():
        if not isinstance(info, dict):
            raise BundleError(f"{where}: tensor {name!r}: entry must be an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in ITEMSIZE:
            raise BundleError(f"{where}: tensor {name!r}: unknown dtype {str(dtype)[:40]!r}; known: {sorted(ITEMSIZE)}")
        if not _shape_ok(shape):
            raise BundleError(f"{where}: tensor {name!r}: shape {str(shape)[:80]} must be a list of non-negative ints")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(
                isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            raise BundleError(f"{where}: tensor {name!r}: data_offsets {str(offsets)[:80]} must be [begin, end]")
        begin, end = offsets
        if not 0 <= begin <= end <= data_bytes:
            raise BundleError(f"{where}: tensor {name!r}: data_offsets [{begin}, {end}] outside the data area "
                              f"(0..{data_bytes})")
        want = math.prod(shape) * ITEMSIZE[dtype]
        if end - begin != want:
            raise BundleError(f"{where}: tensor {name!r}: shape {shape} of {dtype} needs {want} bytes, "
                              f"data_offsets span {end - begin}")
        spans.append((begin, end, name))
    spans.sort()
    for (_, end_a, a), (begin_b, _, b) in itertools.pairwise(spans):
        if begin_b < end_a:
            raise BundleError(f"{where}: tensors {a!r} and {b!r} overlap in the data area")
        if begin_b > end_a:  # the library reads tensors as one packed run: a hole is refused there too
            raise BundleError(f"{where}: a gap of {begin_b - end_a} bytes before tensor {b!r} in the data area")
    if spans and (spans[0][0] != 0 or spans[-1][1] != data_bytes):
        raise BundleError(f"{where}: the tensors cover bytes {spans[0][0]}..{spans[-1][1]} of a {data_bytes}-byte "
                          "data area; the safetensors library needs them to cover it exactly")


def load(path: Path, table: dict | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a checked safetensors file, as views of one private mapping.

    ``table`` ({name: {dtype, shape}}, the manifest's weights table) must match the header exactly.
    """
    from safetensors import SafetensorError, safe_open

    _, header = read_header(path)
    if table is not None:
        check_table(str(path), header, table)
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: f.get_tensor(name) for name in sorted(header)}
    except (SafetensorError, RuntimeError, ValueError) as exc:
        raise BundleError(f"{path}: the safetensors library refused the file ({str(exc)[:200]})") from None


def check_table(where: str, header: dict, table: dict) -> None:
    """The manifest's weights table and the file's header name the same tensors, dtypes and shapes."""
    missing, extra = sorted(set(table) - set(header)), sorted(set(header) - set(table))
    if missing or extra:
        raise BundleError(f"{where}: weights.tensors and the file disagree: missing from the file {missing[:5]}, "
                          f"not in the manifest {extra[:5]}")
    for name, want in table.items():
        got = {"dtype": TORCH_DTYPE[header[name]["dtype"]], "shape": header[name]["shape"]}
        if not isinstance(want, dict) or {"dtype": want.get("dtype"), "shape": want.get("shape")} != got:
            raise BundleError(f"{where}: weights.tensors.{name}: manifest says {str(want)[:120]}, the file holds {got}")


FINITE_CHUNK = 1 << 24  # elements per isfinite pass: a bounded temporary (16 MiB of bools), whatever the tensor


def nonfinite(path: Path) -> list[str]:
    """The floating-point tensors of a weights file holding a NaN or an infinity (``verify``; one pass over the
    float bytes, as fast as the sha256 pass that precedes it, benchmarks in docs/bundle-format.md).
    Integer and packed tensors (MXFP4 blocks, their uint8 scales) have no NaN to look for and are skipped."""
    bad = []
    for name, t in load(path).items():
        if not t.is_floating_point():
            continue
        flat = t.reshape(-1)
        for i in range(0, flat.numel(), FINITE_CHUNK):
            if not _finite(flat[i:i + FINITE_CHUNK]):
                bad.append(name)
                break
    return bad


def _finite(part: torch.Tensor) -> bool:
    """Whether every value is finite: a plain sum first (one vectorised pass, no temporary, ~10x faster than
    isfinite().all() on CPU; NaN and inf propagate into it), the exact elementwise test only when the sum is not
    finite (a NaN or inf, or finite values whose sum overflowed)."""
    if part.element_size() == 1:  # float8: no reduction kernels on every build
        part = part.float()
    if math.isfinite(float(part.sum())):
        return True
    import torch

    return bool(torch.isfinite(part).all())
