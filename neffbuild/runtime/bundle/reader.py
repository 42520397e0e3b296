"""Open and verify a bundle, memory-map its weights once, load artifacts lazily.

Artifacts load through ``runtime/bundle/loaders.py``, the one loading path per backend.

Thin: standard library, torch, the bundle layout constants and the base file helpers only. Reads JSON and
safetensors; never unpickles anything from a bundle. The format is docs/bundle-format.md.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import torch

from neffbuild.errors import BundleError, IncompatibleBundle, Problem, ShapeNotCovered
from neffbuild.fsutil import sha256_file
from neffbuild.runtime import parallel, world
from neffbuild.runtime.bundle import aoti_package, eager, loaders, paths, weights_file
from neffbuild.runtime.bundle import facts as bundle_facts
from neffbuild.runtime.bundle import gate as bundle_gate
from neffbuild.runtime.bundle import model_sig as signature
from neffbuild.runtime.bundle import schema as manifest_schema
from neffbuild.runtime.bundle.graph_inputs import GraphInputs
from neffbuild.runtime.bundle.manifest_file import manifest_bytes, read_manifest, safe_path

__all__ = ["Bundle", "Problem", "check", "open_bundle", "read_facts", "read_manifest", "safe_path", "weight_pieces"]


def digest_problem(root: Path) -> Problem | None:
    """Whether manifest.sha256 holds the sha256 of manifest.json's bytes."""
    dpath = root / paths.MANIFEST_DIGEST_PATH
    line = bundle_gate.read_digest_line(dpath)  # bounded: never the whole file
    if line is None:
        return Problem(paths.MANIFEST_DIGEST_PATH, "missing or unreadable; the manifest is not covered by a digest")
    digest = hashlib.sha256(manifest_bytes(root)).hexdigest()
    if line.split(" ")[0].strip() != digest:
        return Problem(paths.MANIFEST_PATH, f"sha256 {digest} differs from {paths.MANIFEST_DIGEST_PATH} "
                       "(the manifest was modified or corrupted)")
    return None


def check(root: str | Path, *, full: bool = True) -> list[Problem]:
    """Every problem with a bundle: digest, schema, paths, missing or unlisted files, sizes, (full) sha256
    and (full) each artifact against its own declared inputs and constants."""
    root = Path(root)
    try:
        m = read_manifest(root)
        digest = digest_problem(root)
    except BundleError as exc:
        return [Problem(paths.MANIFEST_PATH, str(exc))]
    problems = ([digest] if digest else []) + manifest_problems(m)
    if problems:
        return problems
    problems += _file_problems(root, m["files"], full)
    for w in ([m["weights"]] + list(m.get("parallel", {}).get("pieces", {}).values())) if not problems else []:
        try:  # the header only: limits, dtypes, spans, overlaps, and the manifest's weights table
            path = safe_path(root, w["file"])
            _, header = weights_file.read_header(path)
            weights_file.check_table(str(path), header, w["tensors"])
        except BundleError as exc:
            problems.append(Problem(w["file"], str(exc)))
    if full and not problems and loaders.reads_package_signature(m["toolchain"]):
        for i, entry in enumerate(m["artifacts"]):
            try:
                check_artifact(safe_path(root, entry["file"]), entry, bundle_facts.weight_table(m), f"artifacts[{i}]")
            except BundleError as exc:
                problems.append(Problem(entry["file"], str(exc)))
    return problems


def manifest_problems(m: dict) -> list[Problem]:
    """The manifest's own part of the judgement (``check`` adds the digest and the files): schema, the parallel
    section, then the gate (the model config under the recipe's rules, the weights' shapes it implies, ...)."""
    problems = manifest_schema.problems(m)
    problems += bundle_gate.parallel_presence(m) if not problems else []  # a section on the wrong kind of bundle
    problems += _parallel_problems(m) if not problems else []
    return problems or bundle_gate.problems(m)  # the gate reads the sections the schema and parallel checks passed


def _file_problems(root: Path, files: dict, full: bool) -> list[Problem]:
    problems = []
    for rel, info in files.items():
        try:
            p = safe_path(root, rel)
        except BundleError as exc:
            problems.append(Problem(str(rel), str(exc)))
            continue
        if not p.is_file():
            problems.append(Problem(rel, "missing (or not a regular file)"))
        elif p.stat().st_size != info["bytes"]:
            problems.append(Problem(rel, f"size {p.stat().st_size} != manifest {info['bytes']}"))
        elif full and sha256_file(p) != info["sha256"]:
            problems.append(Problem(rel, "sha256 mismatch (corrupt or modified)"))
    for d in (paths.ARTIFACTS_DIR, paths.WEIGHTS_DIR):
        folder = root / d
        if folder.is_dir() and not folder.is_symlink():
            for p in sorted(folder.rglob("*")):
                rel = p.relative_to(root).as_posix()
                if rel not in files and not p.is_dir():
                    problems.append(Problem(rel, "not listed in the manifest's files (an unexpected file)"))
    return problems


def _parallel_problems(m: dict) -> list[Problem]:
    par = m.get("parallel")
    if par is None:
        return []
    if not isinstance(par, dict) or not isinstance(par.get("pieces"), dict):
        return [Problem(paths.MANIFEST_PATH, "field 'parallel' must be an object with 'pieces'")]
    try:
        lay = parallel.ParallelLayout.from_json(par)
    except (TypeError, ValueError):
        return [Problem(paths.MANIFEST_PATH, f"parallel: tp/dp/ep must be integers, got {par}")]
    if lay.world_size != par.get("world_size") or min(lay.tp, lay.dp, lay.ep) < 1 or lay.world_size % lay.ep:
        return [Problem(paths.MANIFEST_PATH, f"parallel: inconsistent {lay} / world_size {par.get('world_size')}")]
    ranks = par.get("rank_pieces")
    if not (isinstance(ranks, list) and len(ranks) == lay.world_size
            and all(isinstance(r, list) and all(isinstance(n, str) for n in r) for r in ranks)):
        return [Problem(paths.MANIFEST_PATH, f"parallel.rank_pieces: must list, for each of the {lay.world_size} "
                        "ranks, the names of the pieces it maps")]
    wanted = {n for r in ranks for n in r}
    problems = [Problem(paths.MANIFEST_PATH, f"parallel.pieces lacks {n!r}")
                for n in sorted(wanted - set(par["pieces"]))]
    for name, e in par["pieces"].items():
        if not isinstance(e, dict) or not isinstance(e.get("tensors"), dict) or e.get("file") not in m["files"]:
            problems.append(Problem(paths.MANIFEST_PATH,
                                    f"parallel.pieces.{name}: needs tensors and a file listed in files"))
    return problems


def read_facts(root: str | Path, *, strict: bool = True, files: bool = True,
               trusted_keys=()) -> bundle_facts.BundleFacts | None:
    """The typed facts (world rank 0) of a bundle the one judge (``check``, sizes) passes, nothing loaded: for a
    caller that must size its world or judge its own flags before it opens the bundle. ``files=False``: the
    manifest's part of the judgement only. Not valid: a BundleError naming the problems, or None with
    ``strict=False`` (open_bundle then reports). ``trusted_keys``: open_bundle's, the signature first (``()``: none)."""
    root = Path(root)
    if trusted_keys != ():
        signature.require(root, trusted_keys)
    try:
        problems = check(root, full=False) if files else manifest_problems(read_manifest(root))
    except BundleError as exc:
        problems = [Problem(paths.MANIFEST_PATH, str(exc))]
    if problems:
        if not strict:
            return None
        raise BundleError(f"{root}: " + "; ".join(map(str, problems[:10])))
    return bundle_facts.facts_of(read_manifest(root))


def weight_pieces(root: str | Path) -> tuple[dict, dict]:
    """(the replicated weights, {piece: its tensors}) of a judged bundle, every file memory-mapped: the parts an
    engine joins into the unsharded model (``{}`` pieces for an unsharded bundle)."""
    root = Path(root)
    m = read_manifest(root)
    weights = weights_file.load(safe_path(root, m["weights"]["file"]), m["weights"]["tensors"])
    section = parallel.ParallelSection.of_manifest(m)
    pieces = {name: load_pieces(root, section, [name]) for name in section.pieces} if section is not None else {}
    return weights, pieces


def check_artifact(path: Path, entry: dict, weights_table: dict, where: str) -> None:
    """Before any native code: sha256, then the package's own input checks and constants vs the manifest."""
    if sha256_file(path) != entry["sha256"]:
        raise BundleError(f"{path}: sha256 mismatch (corrupt or modified)")
    reported, consts = aoti_package.describe(path)
    why = manifest_schema.compare_with_artifact(where, entry["input_signature"], reported) or \
        manifest_schema.compare_constants(where, weights_table, consts)
    if why:
        raise BundleError(f"{path}: {why}")


class Bundle:
    """An opened bundle: its typed facts (``facts``: what engines read, never the manifest), grid, KV layout,
    shared weights, and lazily loaded artifacts. ``manifest`` stays for the bundle room's own readers."""

    def __init__(self, root: Path, manifest: dict, device: str, rank: world.RankContext | None = None):
        self.root, self.manifest, self.device = root, manifest, device
        self.context = rank  # None: an unsharded bundle, any world
        self.graph_inputs = GraphInputs.from_json(manifest["graph_inputs"])
        self.grid, self.kv_layout = self.graph_inputs.grid, self.graph_inputs.kv_layout
        self.num_swa = self.graph_inputs.num_swa
        self.entries = {a["label"]: a for a in manifest["artifacts"]}
        self.weights = weights_file.load(safe_path(root, manifest["weights"]["file"]), manifest["weights"]["tensors"])
        self.parallel_section = parallel.ParallelSection.from_json(manifest["parallel"]) \
            if "parallel" in manifest else None
        if rank is not None:  # a sharded rank maps the replicated piece plus the pieces the manifest lists for it
            self.weights.update(load_pieces(root, self.parallel_section, self.parallel_section.pieces_of(rank.rank)))
        self.facts = bundle_facts.facts_of(manifest, rank.rank if rank is not None else 0)
        self._loaded: dict[str, object] = {}
        self._lock = threading.Lock()
        self._prefill = self._draft_prefill = None

    read_facts = staticmethod(read_facts)  # a host's view before its ranks exist (open_bundle: after)

    @property
    def vocab_size(self) -> int:
        """Token ids the artifacts take: [0, vocab_size) (the step API checks every id against it)."""
        return self.facts.vocab_size

    @property
    def aux_hidden_size(self) -> int:
        """Width of the EAGLE3 draft's hidden input (3 x the target's hidden size)."""
        return 3 * self.facts.hidden_size

    def prefill(self, prompt, kv_caches: list, rows: dict, *, start: int = 0, logits: str = "last",
                aux_layers: tuple[int, ...] = (), pad_to: int = 0):
        """The bundle's eager forward over ``prompt`` (positions ``start`` onwards; the KV of the positions before
        it already in ``kv_caches``) on the bundle's own weights, writing the KV through ``rows`` ({group: block
        row}): a host engine's prefill and chunks (runtime/bundle/eager.py). Logits of the last position by
        default ([1, vocab]). ``pad_to``: run that many positions (DP ranks in lockstep: ``Stepper.lockstep``)."""
        if self._prefill is None:
            self._prefill = eager.prefill_on(self.facts.config, self.weights, self.facts.fp8_packed_kv,
                                             self.facts.parallel, self.facts.rank)
        return self._prefill(prompt, kv_caches, rows, start=start, logits=logits, aux_layers=aux_layers, pad_to=pad_to)

    def draft_prefill(self, tokens, aux, draft_kv_cache, block_row) -> None:
        """EAGLE3: the draft's KV over prompt positions 0..n-1 (``tokens``: the token at each position + 1, ``aux``:
        the target's aux states there), eager, on the bundle's draft weights (runtime/bundle/eager.py)."""
        if self._draft_prefill is None:
            f = self.facts
            self._draft_prefill = eager.draft_prefill_on(f.speculative_method, f.draft_config, self.weights,
                                                         f.num_speculative_tokens, f.fp8_packed_kv, f.parallel,
                                                         f.rank)
        self._draft_prefill(tokens, aux, draft_kv_cache, block_row)

    @property
    def labels(self) -> list[str]:
        return sorted(self.entries)

    @property
    def parallel(self) -> parallel.ParallelLayout:
        """The parallel layout the artifacts were compiled for (tp = dp = ep = 1 when unsharded)."""
        return self.context.parallel if self.context else self.graph_inputs.parallel

    @property
    def group(self):
        """The group DP sync runs over (the bundle's world), or None for an unsharded bundle."""
        return self.context.world_group if self.context else None

    def artifact(self, label: str):
        """The callable for one label, checked, loaded and bound to the shared weights on first use.

        Sharded: bound to this rank's id too (the graph's last input, where its input signature
        has one), so callers pass the same arguments as for an unsharded artifact.
        """
        with self._lock:
            if label not in self._loaded:
                entry = self.entries.get(label)
                if entry is None:
                    raise ShapeNotCovered(f"{self.root.name}: no artifact {label!r}; the bundle has {self.labels}")
                # Every sharded graph takes the rank (the EAGLE3 draft for the target's vocabulary-split
                # embedding); a manifest without signatures: the target families only.
                sig = entry.get("input_signature")
                takes_rank = any(i.get("name") == "rank" for i in sig) if sig else entry.get("family") != "draft"
                self._loaded[label] = _with_rank(self._load(entry), self.context if takes_rank else None)
            return self._loaded[label]

    def _load(self, entry: dict):
        path = safe_path(self.root, entry["file"])
        if loaders.reads_package_signature(self.manifest["toolchain"]):
            check_artifact(path, entry, bundle_facts.weight_table(self.manifest), f"artifacts[{entry['label']}]")
        elif sha256_file(path) != entry["sha256"]:  # other backends: at least the bytes the manifest names
            raise BundleError(f"{path}: sha256 mismatch (corrupt or modified)")
        return loaders.load(self.manifest["toolchain"], path, self.weights, self.device)


def load_pieces(root: Path, section: parallel.ParallelSection, names) -> dict[str, torch.Tensor]:
    """The tensors of the named weight pieces of a sharded bundle, each file mapped once."""
    out: dict[str, torch.Tensor] = {}
    for name in names:
        entry = section.pieces[name]
        out.update(weights_file.load(safe_path(root, entry["file"]), entry["tensors"]))
    return out


def _with_rank(fn, context: world.RankContext | None):
    if context is None:
        return fn
    rank = context.rank_input
    return lambda *args: fn(*args, rank)


def load_aoti(path: Path, constants: dict[str, torch.Tensor]):  # (kept for callers; see loaders.load_inductor)
    return loaders.load_inductor(path, constants, {})  # an AOTInductor package bound to shared constants


def open_bundle(path: str | Path, *, verify: str = "sizes", device: str = "cpu", preload: bool = False,
                group=None, trusted_keys=None, host_groups: world.HostGroups | None = None) -> Bundle:
    """Open a bundle for serving.

    verify: "sizes" (default: the manifest digest, every file present with its size), "full" (also every sha256
    and every artifact's declared inputs), or "none" (files unchecked). The manifest's schema is always checked.
    Refuses a foreign format, a newer format version, a path outside the bundle, and a toolchain that cannot run
    the artifacts, each with a named error. Each artifact is checked against the manifest before its first call.

    A sharded bundle (manifest ``parallel``) must be opened by every rank of a
    torch.distributed world of exactly its tp x dp ranks (else IncompatibleBundle, naming
    both); ``group`` is that world when the job holds more processes (default: the whole
    world). Opening it creates and registers the rank's TP and EP groups and maps only the
    rank's weight pieces; ``bundle.group`` is then the group DP sync runs over.
    ``host_groups``: a host engine's own groups for this rank (``world.HostGroups``: vLLM's TP, EP
    and DP groups); the bundle then opens onto them, collective-free, and creates no group.

    trusted_keys: PEM public keys (paths or bytes); default ``NEFFBUILD_TRUSTED_KEYS``. When any
    are given, the bundle's signature (``model.sig``) is verified over every file before anything
    else of the bundle is read (runtime/bundle/model_sig.py); an unsigned, mis-signed or modified bundle
    raises SignatureError naming the file or key. None given: no signature is required.
    """
    if verify not in ("sizes", "full", "none"):
        raise ValueError(f"verify must be 'sizes', 'full' or 'none', got {verify!r}")
    root = Path(path)
    if not root.is_dir():
        raise BundleError(f"{root}: not a bundle directory")
    signature.require(root, trusted_keys)  # before any file of the bundle is parsed or loaded
    manifest = read_manifest(root)
    problems = check(root, full=verify == "full") if verify != "none" else manifest_schema.problems(manifest)
    if problems:
        raise BundleError(f"{root}: " + "; ".join(map(str, problems[:10])))
    reason = loaders.toolchain_problem(manifest["toolchain"]) or loaders.device_problem(manifest["toolchain"], device)
    if reason:
        raise IncompatibleBundle(f"{root}: {reason}")
    loaders.prepare_native(manifest, device)  # the native ops' kernels built now, not in the first decode step
    if loaders.reads_package_signature(manifest["toolchain"]) and verify != "full":
        # The fallback artifact pins what the runtime allocates from before any artifact loads (KV buffers,
        # block-table widths): check it against its own package now, so a lie there fails here, not in memory.
        top = max(manifest["artifacts"], key=lambda a: (a["ctx"], a["batch"], a["label"]))
        check_artifact(safe_path(root, top["file"]), top, bundle_facts.weight_table(manifest),
                       f"artifacts[{top['label']}]")
    aoti_package.sweep_temp()
    rank = None
    if "parallel" in manifest:  # every rank of the world opens the bundle (collective unless on the host's groups)
        layout = parallel.ParallelSection.from_json(manifest["parallel"]).parallel
        rank = world.adopt(layout, host_groups, f"bundle {root}") if host_groups is not None else \
            world.join(layout, f"bundle {root}", group)
    bundle = Bundle(root, manifest, device, rank)
    if preload:
        for label in bundle.labels:
            bundle.artifact(label)
    return bundle
