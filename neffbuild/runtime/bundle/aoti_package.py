"""What an AOTInductor package says about itself, read before any of its native code runs.

A ``.pt2`` is a zip. Its generated wrapper source (``*.wrapper.cpp``) holds one ``check_input_N``
function per graph input (expected dtype and sizes) and a ``constants_info_`` table (name, dtype,
shape of every constant the artifact binds). Reading them with ``zipfile`` and a few regular
expressions lets the runtime compare an artifact with the manifest and the weights before the
loader maps its shared object. The loader itself extracts the package into a temp folder; it is
pointed at a folder this module owns, removed when loading fails, and swept when its process died.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import tempfile
import threading
import zipfile
from pathlib import Path

import torch
import torch.utils._pytree as pytree

from neffbuild.errors import BundleError
from neffbuild.fsutil import pid_alive

MAX_SOURCE_BYTES = 64 * 1024 * 1024
TMP_PREFIX = "neffbuild-aoti-"
_DTYPE_FN = re.compile(r"int32_t (\w+)_expected_dtype = aoti_torch_dtype_(\w+)\(\);")
_CHECK_FN = re.compile(r"static void check_input_(\d+)\(")
_SIZE = re.compile(r"if \((-?\d+) != (\w+)_size\[(\d+)\]\)")
_CONST = re.compile(r"constants_info_\[(\d+)\]\.(name|dtype|shape) = (.*?);")
_TORCH_DTYPE = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16", "int64": "int64",
                "int32": "int32", "uint8": "uint8", "bool": "bool", "float8_e4m3fn": "float8_e4m3fn",
                "float64": "float64", "int8": "int8", "int16": "int16"}
_LOCK = threading.Lock()
_OURS: list[str] = []


def wrapper_source(path: Path) -> str:
    """The generated wrapper C++ of a package (bounded size); BundleError when there is none."""
    try:
        with zipfile.ZipFile(path) as z:
            members = [i for i in z.infolist() if i.filename.endswith(".wrapper.cpp")]
            if len(members) != 1:
                raise BundleError(f"{path}: not an AOTInductor package ({len(members)} wrapper sources)")
            if members[0].file_size > MAX_SOURCE_BYTES:
                raise BundleError(f"{path}: wrapper source of {members[0].file_size} bytes is over the limit")
            return z.read(members[0]).decode("utf-8", errors="replace")
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as exc:
        raise BundleError(f"{path}: not a readable AOTInductor package ({str(exc)[:120]})") from None


def input_signature(source: str) -> list[dict]:
    """[{dtype, shape}] per graph input in call order, from the check_input_N functions."""
    starts = [(int(m.group(1)), m.start()) for m in _CHECK_FN.finditer(source)]
    out = []
    for n, (idx, start) in enumerate(sorted(starts)):
        if idx != n:
            raise ValueError(f"check_input_{idx} out of order")
        end = sorted(starts)[n + 1][1] if n + 1 < len(starts) else len(source)
        body = source[start:end]
        dtype = _DTYPE_FN.search(body)
        dims = {int(d): int(v) for v, _, d in _SIZE.findall(body)}
        if dtype is None or sorted(dims) != list(range(len(dims))):
            raise ValueError(f"check_input_{idx} has no dtype or gaps in its sizes")
        name = dtype.group(2)
        out.append({"dtype": _TORCH_DTYPE.get(name, name), "shape": [dims[i] for i in sorted(dims)]})
    return out


def constants(source: str) -> dict[str, dict]:
    """{name: {dtype, shape}} of every constant the artifact binds."""
    rows: dict[int, dict] = {}
    for idx, key, value in _CONST.findall(source):
        rows.setdefault(int(idx), {})[key] = value
    out = {}
    for row in rows.values():
        name = row.get("name", "").strip('"')
        dtype = row.get("dtype", "").removeprefix("cached_torch_dtype_")
        shape = [int(x) for x in re.findall(r"-?\d+", row.get("shape", ""))]
        out[name] = {"dtype": _TORCH_DTYPE.get(dtype, dtype), "shape": shape}
    return out


def describe(path: Path) -> tuple[list[dict], dict[str, dict]]:
    """(input signature, constants) of a package; BundleError when they cannot be read."""
    source = wrapper_source(path)
    try:
        sig = input_signature(source)
    except ValueError as exc:
        raise BundleError(f"{path}: cannot read the artifact's input checks ({exc})") from None
    if not sig:
        raise BundleError(f"{path}: the artifact declares no graph inputs")
    return sig, constants(source)


def sweep_temp(root: str | None = None) -> None:
    """Remove extraction folders of processes that are gone (a crash never cleans up)."""
    root = Path(root or tempfile.gettempdir())
    with contextlib.suppress(OSError):
        for d in root.glob(f"{TMP_PREFIX}*"):
            pid = d.name[len(TMP_PREFIX):].split("-")[0]
            if pid.isdigit() and not pid_alive(int(pid)):
                shutil.rmtree(d, ignore_errors=True)


def load_package(path: Path):
    """An :class:`AOTIArtifact` extracting into a folder of ours; that folder is removed if loading fails."""
    tmp = tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-")
    _OURS.append(tmp)
    with _LOCK:
        saved = os.environ.get("TMPDIR")
        os.environ["TMPDIR"] = tmp  # the loader extracts under std::filesystem::temp_directory_path()
        try:
            return AOTIArtifact(path)
        except Exception as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise BundleError(f"{path}: AOTInductor could not load the artifact ({str(exc).strip()[:200]})") from None
        finally:
            if saved is None:
                os.environ.pop("TMPDIR", None)
            else:
                os.environ["TMPDIR"] = saved


class AOTIArtifact:
    """An AOTInductor package run through torch's C++ package loader alone.

    ``torch._inductor.aoti_load_package`` returns the same loader wrapped in a class whose
    import pulls in inductor and dynamo (seconds per process, most of a cold start); the
    calling convention is only: flatten the tensors in order, run, unflatten the outputs.
    """

    def __init__(self, path: str | Path):
        self.loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
        self._out_spec = pytree.treespec_loads(self.loader.get_call_spec()[1])

    def __call__(self, *args):
        flat = [x for x in pytree.tree_leaves(args) if isinstance(x, torch.Tensor)]
        return pytree.tree_unflatten(self.loader.boxed_run(flat), self._out_spec)

    def get_constant_fqns(self) -> list[str]:
        return self.loader.get_constant_fqns()

    def load_constants(self, constants: dict[str, torch.Tensor], *, check_full_update: bool,
                       user_managed: bool = False) -> None:
        self.loader.load_constants(constants, False, check_full_update, user_managed, False)


@atexit.register
def _remove_ours() -> None:
    for d in _OURS:
        shutil.rmtree(d, ignore_errors=True)
