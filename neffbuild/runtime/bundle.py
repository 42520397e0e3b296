"""Open and verify a bundle, memory-map its weights once, load artifacts lazily.

Thin: standard library, torch, the bundle layout constants and the base file helpers only. Reads JSON and
safetensors; never unpickles anything from a bundle. The format is docs/bundle-format.md.
"""

from __future__ import annotations

import json
import struct
import threading
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import torch
import torch.utils._pytree as pytree

from neffbuild.errors import BundleError, IncompatibleBundle, ShapeNotCovered
from neffbuild.fsutil import sha256_file
from neffbuild.runtime import layout
from neffbuild.runtime.dispatch import GridSpec
from neffbuild.runtime.kv_cache import KVLayout

_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
           "I32": torch.int32, "U8": torch.uint8, "F8_E4M3": torch.float8_e4m3fn}


@dataclass(frozen=True)
class Problem:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


def safe_path(root: Path, rel: object) -> Path:
    """Resolve a manifest path inside the bundle, refusing escapes and symlinks."""
    if not isinstance(rel, str) or not rel or "\\" in rel or "\x00" in rel:
        raise BundleError(f"{root}: manifest path {rel!r} is not a relative POSIX path")
    pure = PurePosixPath(rel)
    if pure.is_absolute() or ".." in pure.parts:
        raise BundleError(f"{root}: manifest path {rel!r} points outside the bundle")
    p = root
    for part in pure.parts:
        p = p / part
        if p.is_symlink():
            raise BundleError(f"{root}: manifest path {rel!r} goes through a symbolic link ({p.name})")
    return p


def read_manifest(root: Path) -> dict:
    mpath = root / layout.MANIFEST_PATH
    if not mpath.is_file():
        raise BundleError(f"{root}: no {layout.MANIFEST_PATH}; not a neffbuild bundle")
    try:
        m = json.loads(mpath.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BundleError(f"{mpath}: unreadable manifest ({exc})") from None
    if not isinstance(m, dict) or m.get("format") != layout.BUNDLE_FORMAT:
        raise IncompatibleBundle(f"{mpath}: format is {m.get('format') if isinstance(m, dict) else None!r}, "
                                 f"expected {layout.BUNDLE_FORMAT!r}")
    v = m.get("format_version")
    if not isinstance(v, int) or isinstance(v, bool) or v not in layout.SUPPORTED_FORMAT_VERSIONS:
        raise IncompatibleBundle(f"{mpath}: format_version {v!r} is not supported by this reader "
                                 f"(supported: {list(layout.SUPPORTED_FORMAT_VERSIONS)}); upgrade neffbuild")
    return m


SCHEMA = {"name": str, "version": str, "recipe_sha256": str, "toolchain": dict, "graph_inputs": dict,
          "artifacts": list, "weights": dict, "files": dict}
ARTIFACT_KEYS = ("label", "family", "batch", "ctx", "query_len", "file", "sha256", "bytes", "compile_seconds",
                 "cache_key", "input_signature", "compile_label")


def check(root: str | Path, *, full: bool = True) -> list[Problem]:
    """Every problem with a bundle: schema, paths, missing files, sizes, and (full) sha256."""
    root = Path(root)
    try:
        m = read_manifest(root)
    except BundleError as exc:
        return [Problem(layout.MANIFEST_PATH, str(exc))]
    problems = [Problem(layout.MANIFEST_PATH, f"field {k!r} missing or not a {t.__name__}")
                for k, t in SCHEMA.items() if not isinstance(m.get(k), t)]
    if problems:
        return problems
    for i, a in enumerate(m["artifacts"]):
        missing = [k for k in ARTIFACT_KEYS if not isinstance(a, dict) or k not in a]
        if missing:
            problems.append(Problem(layout.MANIFEST_PATH, f"artifacts[{i}] lacks {missing}"))
        elif a["file"] not in m["files"]:
            problems.append(Problem(str(a["file"]), "artifact not listed in files"))
    if m["weights"].get("file") not in m["files"]:
        problems.append(Problem(str(m["weights"].get("file")), "weights file not listed in files"))
    for rel, info in m["files"].items():
        try:
            p = safe_path(root, rel)
        except BundleError as exc:
            problems.append(Problem(str(rel), str(exc)))
            continue
        if not p.is_file():
            problems.append(Problem(rel, "missing"))
        elif not isinstance(info, dict) or p.stat().st_size != info.get("bytes"):
            problems.append(Problem(rel, f"size {p.stat().st_size} != manifest {info.get('bytes') if isinstance(info, dict) else info}"))
        elif full and sha256_file(p) != info.get("sha256"):
            problems.append(Problem(rel, "sha256 mismatch (corrupt or modified)"))
    return problems


def mmap_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file as views of ONE private memory map (no copy, no pickle)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size)
    raw = torch.empty(0, dtype=torch.uint8)
    raw.set_(storage)
    base, out = 8 + n, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        dtype = _DTYPES[info["dtype"]]
        out[name] = raw[base + begin: base + end].view(dtype).view(info["shape"])
    return out


def toolchain_problem(toolchain: dict) -> str | None:
    """Why the running toolchain cannot run these artifacts, or None."""
    backend = toolchain.get("backend")
    if backend == "inductor":
        built = str(toolchain.get("torch", "")).split("+")[0]
        here = torch.__version__.split("+")[0]
        if built != here:
            return (f"artifacts were compiled by torch {toolchain.get('torch')} and this process runs torch "
                    f"{torch.__version__}; AOTInductor artifacts only load in the torch that built them. "
                    f"Install torch=={built} or rebuild the bundle")
        return None
    if backend == "neuron":
        import importlib.util

        if importlib.util.find_spec("torch_neuronx") is None:
            return "artifacts are NEFFs; this host has no torch-neuronx (the Neuron SDK)"
        return None
    return f"unknown backend {backend!r} in the manifest"


class Bundle:
    """An opened bundle: manifest, grid, shared weights, and lazily loaded artifacts."""

    def __init__(self, root: Path, manifest: dict, device: str):
        self.root, self.manifest, self.device = root, manifest, device
        gi = manifest["graph_inputs"]
        self.spec = GridSpec(tuple(gi["num_seqs_buckets"]), tuple(gi["decode_context_length_buckets"]),
                             gi["max_model_len"], gi.get("num_speculative_tokens", 0))
        kv = gi["kv_layout"]
        _, nb, h, bs, d = kv["buffer_shape"]
        self.kv_layout = KVLayout(kv["num_buffers"], nb, h, bs, d, fp8=kv["dtype"].startswith("float8"),
                                  packed_k=kv["packed_k"])
        self.num_swa = gi["num_swa"]
        self.entries = {a["label"]: a for a in manifest["artifacts"]}
        self.weights = mmap_safetensors(safe_path(root, manifest["weights"]["file"]))
        self._loaded: dict[str, object] = {}
        self._lock = threading.Lock()

    @property
    def labels(self) -> list[str]:
        return sorted(self.entries)

    def artifact(self, label: str):
        """The callable for one label, loaded and bound to the shared weights on first use."""
        with self._lock:
            if label not in self._loaded:
                entry = self.entries.get(label)
                if entry is None:
                    raise ShapeNotCovered(f"{self.root.name}: no artifact {label!r}; the bundle has {self.labels}")
                self._loaded[label] = self._load(entry)
            return self._loaded[label]

    def _load(self, entry: dict):
        path = safe_path(self.root, entry["file"])
        backend = self.manifest["toolchain"]["backend"]
        if backend == "inductor":
            return load_aoti(path, self.weights)
        import torch_neuronx  # noqa: F401  - Neuron hosts only

        return torch.jit.load(str(path))

    def runner(self):
        """A Decoder runner: StepPlan -> the artifact callable for its label."""
        return lambda plan: self.artifact(plan.label)


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


def load_aoti(path: Path, constants: dict[str, torch.Tensor]):
    """Load an AOTInductor package and bind user-managed constants (shared, never copied)."""
    runner = AOTIArtifact(path)
    wanted = runner.get_constant_fqns()
    missing = [n for n in wanted if n not in constants]
    if missing:
        raise BundleError(f"{path}: the bundle's weights lack constants {missing[:5]}")
    runner.load_constants({n: constants[n] for n in wanted}, check_full_update=True, user_managed=True)
    return runner


def open_bundle(path: str | Path, *, verify: str = "sizes", device: str = "cpu", preload: bool = False) -> Bundle:
    """Open a bundle for serving.

    verify: "sizes" (default: every file present with its size), "full" (also sha256),
    or "none". Refuses a foreign format, a newer format version, a path outside the
    bundle, and a toolchain that cannot run the artifacts, each with a named error.
    """
    if verify not in ("sizes", "full", "none"):
        raise ValueError(f"verify must be 'sizes', 'full' or 'none', got {verify!r}")
    root = Path(path)
    if not root.is_dir():
        raise BundleError(f"{root}: not a bundle directory")
    manifest = read_manifest(root)
    if verify != "none":
        problems = check(root, full=verify == "full")
        if problems:
            raise BundleError(f"{root}: " + "; ".join(map(str, problems)))
    reason = toolchain_problem(manifest.get("toolchain", {}))
    if reason:
        raise IncompatibleBundle(f"{root}: {reason}")
    bundle = Bundle(root, manifest, device)
    if preload:
        for label in bundle.labels:
            bundle.artifact(label)
    return bundle
