"""Build the manifest object (spec: docs/bundle-format.md). Deterministic: no timestamps."""

from __future__ import annotations

import json

from neffbuild.bundle import layout


def dumps(manifest: dict) -> str:
    """The one serialisation: sorted keys, 1-space indent, trailing newline."""
    return json.dumps(manifest, sort_keys=True, indent=1, ensure_ascii=False) + "\n"


def graph_inputs(recipe, kv_layout) -> dict:
    return {
        "num_seqs_buckets": list(recipe.num_seqs_buckets),
        "decode_context_length_buckets": list(recipe.decode_context_length_buckets),
        "max_model_len": recipe.max_model_len,
        "block_size": recipe.block_size,
        "num_blocks": recipe.num_blocks,
        "num_swa": recipe.num_swa,
        "tp": recipe.tp, "dp": recipe.dp, "ep": recipe.ep, "lnc": recipe.lnc,
        "fp8_packed_kv": recipe.fp8_packed_kv,
        "num_speculative_tokens": recipe.num_speculative_tokens,
        "kv_layout": kv_layout.to_json(),
        "arch": recipe.model.arch,
        "model_config": recipe.model.config.to_hf_dict(),
        # EAGLE3: the draft's config keys as the recipe gave them (the reader derives the rest from model_config)
        **({"draft_config": recipe.speculative.draft_hf_config} if recipe.speculative else {}),
    }


def build(recipe, *, toolchain: dict, kv_layout, artifacts: list[dict], weights: dict, files: dict,
          parallel: dict | None = None) -> dict:
    out = {
        "format": layout.BUNDLE_FORMAT,
        "format_version": layout.BUNDLE_FORMAT_VERSION,
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
        out["parallel"] = parallel
    return out
