"""The build's provenance: an in-toto statement with the SLSA v1 provenance predicate (``provenance.json``).

It records what a serving host may want to audit before trusting a bundle: the recipe hash,
the checkpoint's digest, the toolchain, the builder's host name, and which targets came from
the compile cache. It names a host and times, so it is a per-build record (not in the
manifest's ``files``); a signature made after it covers it. Spec: docs/bundle-format.md.
"""

from __future__ import annotations

import hashlib
import json
import socket
import time
from pathlib import Path

from neffbuild import __version__
from neffbuild.fsutil import sha256_file

SLSA_PREDICATE = "https://slsa.dev/provenance/v1"
BUILD_TYPE = "urn:neffbuild:build-type:compile:v1"
MAX_CHECKPOINT_FILES = 10_000


def checkpoint_digest(path: str | Path | None, seed: int | None = None) -> dict:
    """A resolvedDependencies entry: one file's sha256, or for a folder the sha256 over its files' digests
    (sorted by name, as a model-signing subject digest), each file listed; a random checkpoint names its seed."""
    if path is None:
        return {"name": "checkpoint", "annotations": {"random_seed": seed}}
    p = Path(path)
    files = sorted(f for f in p.rglob("*") if f.is_file())[:MAX_CHECKPOINT_FILES] if p.is_dir() else [p]
    digests = {f.relative_to(p).as_posix() if p.is_dir() else f.name: sha256_file(f) for f in files}
    root = digests[p.name] if not p.is_dir() and digests else \
        hashlib.sha256(b"".join(bytes.fromhex(d) for _, d in sorted(digests.items()))).hexdigest()
    return {"name": "checkpoint", "uri": f"file://{p.resolve()}", "digest": {"sha256": root},
            "annotations": {"files": digests}}


def statement(recipe, manifest: dict, manifest_sha256: str, hits: dict[str, bool], *, started: float,
              extra: dict | None = None) -> dict:
    """The provenance statement of one build (subject: the bundle, by its manifest's sha256)."""
    deps = [checkpoint_digest(recipe.model.checkpoint, recipe.model.random_seed)]
    spec = recipe.speculative
    if spec is not None:
        deps.append(dict(checkpoint_digest(spec.draft_checkpoint, spec.draft_random_seed), name="draft_checkpoint"))
    stamp = lambda t: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
    return {
        "_type": "https://in-toto.io/Statement/v1",
        "subject": [{"name": f"{manifest['name']}-{manifest['version']}", "digest": {"sha256": manifest_sha256},
                     "annotations": {"file": "manifest.json"}}],
        "predicateType": SLSA_PREDICATE,
        "predicate": {
            "buildDefinition": {
                "buildType": BUILD_TYPE,
                "externalParameters": {"recipe": {"name": manifest["name"], "version": manifest["version"],
                                                  "sha256": manifest["recipe_sha256"]}},
                "internalParameters": {"toolchain": manifest["toolchain"], **(extra or {})},
                "resolvedDependencies": deps,
            },
            "runDetails": {
                "builder": {"id": f"urn:neffbuild:host:{socket.gethostname()}", "version": {"neffbuild": __version__}},
                "metadata": {"startedOn": stamp(started), "finishedOn": stamp(time.time())},
                "byproducts": [{"name": "compile-cache", "annotations": {
                    "from_cache": sorted(k for k, v in hits.items() if v),
                    "compiled": sorted(k for k, v in hits.items() if not v)}}],
            },
        },
    }


def dumps(doc: dict) -> str:
    return json.dumps(doc, sort_keys=True, indent=1) + "\n"


def summary(doc: dict) -> dict:
    """The fields ``inspect`` shows, from a provenance statement (tolerant: a field missing reads None)."""
    def get(*path):
        cur = doc
        for k in path:
            cur = cur.get(k) if isinstance(cur, dict) else (cur[k] if isinstance(cur, list) and len(cur) > k else None)
        return cur

    byproducts = get("predicate", "runDetails", "byproducts") or []
    cache = next((b.get("annotations", {}) for b in byproducts if isinstance(b, dict)
                  and b.get("name") == "compile-cache"), {})
    deps = get("predicate", "buildDefinition", "resolvedDependencies") or []
    ckpt = {d.get("name"): (d.get("digest") or {}).get("sha256") or d.get("annotations", {}).get("random_seed")
            for d in deps if isinstance(d, dict)}
    return {"recipe_sha256": get("predicate", "buildDefinition", "externalParameters", "recipe", "sha256"),
            "checkpoint": ckpt, "toolchain": get("predicate", "buildDefinition", "internalParameters", "toolchain"),
            "builder": get("predicate", "runDetails", "builder", "id"),
            "finished": get("predicate", "runDetails", "metadata", "finishedOn"),
            "from_cache": cache.get("from_cache"), "compiled": cache.get("compiled")}
