"""Build the manifest object (spec: docs/bundle-format.md), the one place it is written. Deterministic: no
timestamps. Its typed parts are the readers' types: ``GraphInputs`` and ``ParallelSection`` (runtime/)."""

from __future__ import annotations

import json

from neffbuild.bundle import paths
from neffbuild.runtime.bundle.graph_inputs import GraphInputs
from neffbuild.runtime.parallel import ParallelSection


def dumps(manifest: dict) -> str:
    """The one serialisation: sorted keys, 1-space indent, trailing newline."""
    return json.dumps(manifest, sort_keys=True, indent=1, ensure_ascii=False) + "\n"


def graph_inputs(recipe, kv_layout) -> dict:
    """The manifest's ``graph_inputs``: the one type readers decode it with (runtime/bundle/graph_inputs.py)."""
    return GraphInputs.from_recipe(recipe, kv_layout).to_json()


def build(recipe, *, toolchain: dict, kv_layout, artifacts: list[dict], weights: dict, files: dict,
          parallel: ParallelSection | None = None) -> dict:
    out = {
        "format": paths.BUNDLE_FORMAT,
        "format_version": paths.BUNDLE_FORMAT_VERSION,
        "name": recipe.name,
        "version": recipe.version,
        "recipe_sha256": recipe.sha256(),
        "toolchain": toolchain,
        "graph_inputs": graph_inputs(recipe, kv_layout),
        "artifacts": sorted(artifacts, key=lambda a: a["label"]),
        "weights": weights,
        "files": dict(sorted(files.items())),
    }
    if parallel is not None:  # sharded bundles only (docs/bundle-format.md, "parallel")
        out["parallel"] = parallel.to_json()
    return out
