"""Targets -> jobs -> bundle: the main job of ``neffbuild compile``.

Every target is built (or found in the cache) by a worker; the weights are loaded once
here and stored once in the bundle. Targets whose pre-key is cached are resolved here
without tracing and without starting workers (a warm rebuild). Every artifact is loaded
with the bundle's weights and run once on zeroed inputs before the bundle is published
(a ``load_error`` otherwise). One failing target does not stop the others, but a
build with any failure publishes no bundle: its logs are kept in
``<out>/<name>-<version>.failed-logs/`` and the error lists each failure, classified.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from neffbuild import grid, memory, registry, settings
from neffbuild.bundle import paths
from neffbuild.bundle.writer import BundleWriter
from neffbuild.compiler import remote_tier
from neffbuild.compiler.backends import get_backend
from neffbuild.compiler.cache import Cache
from neffbuild.compiler.executor import make_executor
from neffbuild.compiler.graphs import target_graph
from neffbuild.compiler.jobs import Job, JobResult
from neffbuild.compiler.progress import Progress
from neffbuild.compiler.worker import cached_result
from neffbuild.errors import InvalidInput
from neffbuild.runtime.parallel import ParallelSection


@dataclass
class BuildResult:
    bundle: Path | None
    built: int = 0
    cached: int = 0
    traced: int = 0  # targets traced to compute their key (a warm rebuild traces none)
    failed: list[JobResult] = field(default_factory=list)
    results: list[JobResult] = field(default_factory=list)
    wall_s: float = 0.0
    failed_logs: Path | None = None
    memory_note: str | None = None  # the local pool ran fewer compiles at once than jobs: host memory
    memory: dict | None = None  # the pool's memory gate (free memory, max concurrent compiles)
    remote: dict | None = None  # the remote tier's summary (compiler/remote_tier.py), None without one
    shard: str | None = None  # "I/N" for a sharded build (no bundle)

    def to_json(self) -> dict:
        remote_hits = self.remote["hits"] if self.remote else 0
        return {"bundle": str(self.bundle) if self.bundle else None, "built": self.built, "cached": self.cached,
                "traced": self.traced, "memory_note": self.memory_note, "memory": self.memory,
                "failed": [{"label": f.label, "kind": f.kind, "error": f.error, "log": f.log} for f in self.failed],
                "wall_s": round(self.wall_s, 3), "local_hits": self.cached - remote_hits, "remote_hits": remote_hits,
                "misses": self.built, "pushes": self.remote["pushes"] if self.remote else 0,
                "remote_errors": self.remote["errors"] if self.remote else 0, "remote": self.remote,
                "shard": self.shard}


def backend_kwargs(recipe, backend_name: str | None = None) -> dict:
    return {"name": backend_name or recipe.backend, "target": recipe.target, "optlevel": recipe.optlevel,
            "lnc": recipe.lnc, "flags": tuple(recipe.flags)}


def compile_recipe(recipe, out_dir: str | Path, *, jobs: int | None = None, backend_name: str | None = None,
                   cache_root: str | Path | None = None, progress: Progress | None = None,
                   timeout_s: float | None = None, executor="local", address: str | None = None,
                   shared_cache: bool = False, sign_key=None, remote: str | None = None, remote_mode: str = "auto",
                   shard: tuple[int, int] | None = None, remote_trust: tuple[bytes, ...] = (),
                   remote_sign_key=None) -> BuildResult:
    """Build every target of ``recipe`` into a bundle under ``out_dir``.

    ``remote``: an ``s3://BUCKET/PREFIX`` cache tier behind the local cache (``remote_mode``
    auto | rw | ro; compiler/remote_cache.py). ``shard=(I, N)``: build only the I-th of N
    deterministic slices into the cache(s) and publish no bundle.

    ``executor``: "local" (a pool of ``jobs`` workers), "ray" (``address``, ``shared_cache``:
    see compiler/ray_executor.py) or an executor object with ``run(jobs, on_start)``.
    ``sign_key``: an EC private key; the bundle is signed before it is published (bundle/signing.py).
    ``remote_trust``: PEM public keys a remote entry must be signed by; ``remote_sign_key``: the EC private key
    that signs the entries this build pushes (compiler/entry_sig.py).
    """
    progress = progress or Progress()
    started = time.monotonic()
    bk = backend_kwargs(recipe, backend_name)
    backend = get_backend(**bk)  # fails fast (exit 1, clear message) when the backend cannot run here
    bk["name"] = backend.name
    cache = Cache(cache_root or recipe.cache_dir or settings.cache_dir()).ensure()
    with cache.hold():  # prune waits for no build: it refuses while one holds the cache
        return _compile(recipe, out_dir, cache, bk, backend, progress, started, jobs=jobs, timeout_s=timeout_s,
                        executor=executor, address=address, shared_cache=shared_cache, sign_key=sign_key,
                        remote=remote, remote_mode=remote_mode, shard=shard,
                        tier=remote_tier.open_tier(remote, remote_mode, trusted=remote_trust, sign_key=remote_sign_key))


def _compile(recipe, out_dir, cache, bk, backend, progress, started, *, jobs, timeout_s, executor, address,
             shared_cache, sign_key, remote, remote_mode, shard, tier) -> BuildResult:
    cache.sweep()
    targets = grid.build_order(grid.targets(recipe))
    if tier is not None:
        tier.probe()  # seconds, not minutes, to find a remote that never answers (then built without it)
    if shard:
        targets = remote_tier.shard_slice(targets, *shard)
    runner = executor
    if isinstance(executor, str):  # fails fast without Ray
        runner = make_executor(executor, jobs=jobs or recipe.jobs or settings.default_jobs(), cache_root=cache.root,
                               timeout_s=timeout_s, address=address, shared_cache=shared_cache)
    writer = BundleWriter(out_dir, recipe.name, recipe.version)
    result = BuildResult(bundle=None, shard=f"{shard[0]}/{shard[1]}" if shard else None)
    try:
        progress.stage("loading weights")
        weights = _load_weights(recipe)
        draft = None
        if recipe.speculative:  # the draft's tensors live beside the target's (draft_* names), in its dtype
            s = recipe.speculative
            method = registry.speculative(s.method)
            draft = method.get("weights")(recipe.draft_config, s.draft_checkpoint, s.draft_random_seed,
                                          recipe.model.weights_dtype)
            method.get("engine_folder")(recipe.draft_config, draft, writer.path(paths.DRAFT_DIR),  # vLLM loads it
                                        dtype=recipe.model.weights_dtype,
                                        max_position_embeddings=recipe.model.config.max_position_embeddings)
        weights_entry, parallel = _write_weights(writer, recipe, weights, draft or {})
        del weights, draft
        # The smoke run needs the weights; a sharded graph is skipped (its collectives need live peers).
        weights_path = None if parallel else str(writer.path(paths.WEIGHTS_PATH))
        jobs_list = [Job(t.label, target_graph(recipe, t), dict(bk, flags=recipe.flags_for(t.label)), str(cache.root),
                         str(writer.path(paths.log_path(t.label))), weights_path,
                         (remote, remote_mode) if tier else None, remote_trust=tier.trusted if tier else ())
                     for t in targets]
        by_label = {t.label: t for t in targets}
        progress.start(len(jobs_list))
        jobs_by_label = {j.label: j for j in jobs_list}
        for res in _run(jobs_list, runner, progress, tier, cache):
            res = remote_tier.after_result(tier, cache, jobs_by_label[res.label], res)
            result.results.append(res)
            result.traced += res.traced
            if res.ok:
                result.cached += res.hit
                result.built += not res.hit
            else:
                result.failed.append(res)
            progress.finished(res)
        result.wall_s = time.monotonic() - started
        result.memory_note = getattr(runner, "memory_note", None)
        gate = getattr(runner, "admission", None)
        result.memory = gate.to_json() if gate is not None else None
        result.remote = remote_tier.summary(tier, result.results)
        if result.failed or shard:
            result.failed_logs = _keep_logs(writer, out_dir) if result.failed else None
            result.failed = [f.replace(log=str(result.failed_logs / Path(f.log).name)) for f in result.failed]
            writer.abort()
            return result
        progress.stage("writing bundle")
        ordered = sorted(result.results, key=lambda r: r.label)
        artifacts = [_add_artifact(writer, by_label[r.label], r) for r in ordered]
        hits = {r.label: r.hit for r in result.results}
        seconds = {r.label: r.compile_seconds for r in result.results}  # per build: build-info.json
        result.bundle = writer.finish(
            recipe, toolchain=backend.fingerprint(), kv_layout=memory.recipe_kv_layout(recipe), artifacts=artifacts,
            weights=weights_entry, parallel=parallel, sign_key=sign_key,
            report_context={"hits": hits, "seconds": seconds, "built": result.built, "cached": result.cached,
                             "wall_s": round(time.monotonic() - started, 3), **_placement(runner, result.results)},
        )
        result.wall_s = time.monotonic() - started
        return result
    except BaseException:
        writer.abort()
        raise


def _run(jobs_list: list[Job], executor, progress: Progress, tier=None, cache=None):
    """Pre-key hits here, in this process (no tracing, no worker pool); the rest on the executor."""
    rest = []
    for job in jobs_list:
        res = cached_result(job) or remote_tier.cached_remote(tier, cache, job)
        if res is None:
            rest.append(remote_tier.for_worker(tier, job))
        else:
            progress.running(job.label)
            yield res
    if rest:
        yield from executor.run(rest, on_start=lambda j: progress.running(j.label))


def _write_weights(writer: BundleWriter, recipe, weights: dict, draft: dict) -> tuple[dict, ParallelSection | None]:
    """Unsharded: one file. Sharded: the replicated piece plus one file per TP and per EP rank,
    each tensor stored once; the manifest's ``parallel`` field says which pieces a rank maps. The draft's
    tensors (``draft``) go into the same pieces by its own rule (its split tensors into the TP pieces)."""
    par = recipe.parallel
    if not par.sharded:
        return writer.write_weights(dict(weights, **draft)), None
    cfg, entries, shared = recipe.model.config, {}, None
    arch = registry.arch(recipe.model.arch)
    method = registry.speculative(recipe.speculative.method) if draft else None
    for name, tensors in arch.get("iter_pieces")(cfg, weights, par):
        if method is not None:
            tensors = dict(tensors, **method.get("piece")(recipe.draft_config, draft, par, name))
        if name == "shared":
            shared = writer.write_weights(tensors)
        else:
            entries[name] = writer.write_weights(tensors, paths.weights_piece_path(name))
    layout = arch.get("shard_layout")(par, tuple(weights))
    if method is not None:
        layout.update(method.get("shard_layout")(par, tuple(draft)))
    info = ParallelSection(par, entries, tuple(tuple(n for n in arch.get("piece_names")(par, r) if n != "shared")
                                               for r in range(par.world_size)),
                           layout, {f"tp{r}": list(arch.get("kv_heads_of")(cfg, par, r)) for r in range(par.tp)})
    return shared, info


def _load_weights(recipe) -> dict:
    """The checkpoint's stacked weights; an unreadable checkpoint is the user's input (exit 2), not a crash."""
    from safetensors import SafetensorError

    arch = registry.arch(recipe.model.arch)
    form = arch.get("weight_form")(recipe.model.weights_dtype, recipe.model.experts)  # stored as served
    try:
        return arch.get("weights")(recipe.model.config, recipe.model.checkpoint, recipe.model.random_seed, form)
    except (SafetensorError, OSError) as exc:
        raise InvalidInput(f"model.checkpoint {recipe.model.checkpoint}: unreadable safetensors checkpoint "
                           f"({str(exc)[:200]})") from None


def _add_artifact(writer: BundleWriter, t, res: JobResult) -> dict:
    """Copy one built artifact into the bundle; its manifest entry."""
    rel = writer.add_artifact(t.label, res.ext, Path(res.artifact))
    return {
        "label": t.label, "family": t.family, "batch": t.batch, "ctx": t.ctx, "query_len": t.query_len,
        "file": rel, "sha256": res.sha256, "bytes": res.bytes,
        "cache_key": res.cache_key, "input_signature": res.input_signature,
        "compile_label": t.label,  # the Prometheus bucket label is the target label
    }


def _placement(runner, results: list[JobResult]) -> dict:
    """Where each target was built: a per-build record (build-info.json), never the manifest."""
    nodes = {r.label: r.node for r in results if r.node}
    record = {"executor": getattr(runner, "name", type(runner).__name__)}
    return dict(record, built_on=dict(sorted(nodes.items()))) if nodes else record


LOGS_MARKER = ".neffbuild-failed-logs"  # in every failed-logs folder neffbuild writes: only those are replaced


def _keep_logs(writer: BundleWriter, out_dir) -> Path:
    """The failed build's logs at ``<out>/<name>-<version>.failed-logs``. A previous folder there is replaced
    only when neffbuild wrote it (its marker file); anything else there (a folder without the marker, a file, a
    link) is kept, and the logs go to the first free ``.failed-logs.N``, with a warning naming both."""
    wanted = dest = Path(out_dir) / f"{writer.final.name}.failed-logs"
    n = 1
    while dest.exists() or dest.is_symlink():
        if dest.is_dir() and not dest.is_symlink() and (dest / LOGS_MARKER).is_file():
            shutil.rmtree(dest)
            break
        dest, n = wanted.with_name(f"{wanted.name}.{n}"), n + 1
    if dest != wanted:
        logging.getLogger(__name__).warning("%s is not a failed-logs folder neffbuild wrote (no %s): kept; this "
                                            "build's logs are in %s", wanted, LOGS_MARKER, dest)
    shutil.copytree(writer.path(paths.LOGS_DIR), dest)
    (dest / LOGS_MARKER).write_text("neffbuild: the logs of a failed build (replaced by the next failed build)\n")
    return dest
