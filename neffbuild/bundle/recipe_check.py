"""A bundle's manifest against its own recipe.yaml: ``verify`` and ``generate --check`` run it.

The manifest's ``graph_inputs`` are what the runtime and ``generate`` read (the model config
builds the eager prefill and the reference model; the grid picks artifacts). A consistent
tamper rewrites the manifest and its digest, so the manifest cannot vouch for itself: the
recipe the bundle was built from must hash to ``recipe_sha256`` and imply the same
graph_inputs. (The runtime reads no YAML, so this lives outside it; ``open_bundle`` checks
what it can without the recipe: runtime/bundle/gate.py.)
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from neffbuild.errors import NeffbuildError
from neffbuild.runtime.bundle.paths import RECIPE_PATH
from neffbuild.runtime.bundle.schema import Problem, short

# graph_inputs field -> (recipe section, key)
FIELDS = {"max_model_len": ("serving", "max_model_len"), "block_size": ("serving", "block_size"),
          "num_blocks": ("serving", "num_blocks"), "num_seqs_buckets": ("neuron_config", "num_seqs_buckets"),
          "decode_context_length_buckets": ("neuron_config", "decode_context_length_buckets"),
          "fp8_packed_kv": ("neuron_config", "fp8_packed_kv"), "lnc": ("neuron_config", "lnc"),
          "tp": ("parallel", "tp"), "dp": ("parallel", "dp"), "ep": ("parallel", "ep")}


def problems(root: Path, m: dict) -> list[Problem]:
    """Where the manifest disagrees with recipe.yaml (or recipe.yaml with recipe_sha256)."""
    from neffbuild import recipe, registry

    path = Path(root) / RECIPE_PATH
    try:
        raw = recipe.parse_yaml(recipe.read_regular_file(path, RECIPE_PATH), str(path))
    except NeffbuildError as exc:
        return [Problem(RECIPE_PATH, f"unreadable ({str(exc).splitlines()[-1].strip()[:160]})")]
    if not isinstance(raw, dict) or not all(isinstance(raw.get(s), dict) for s in ("model", "serving",
                                                                                  "neuron_config", "parallel")):
        return [Problem(RECIPE_PATH, "is not a normalised neffbuild recipe")]
    if hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest() != m.get("recipe_sha256"):
        return [Problem(RECIPE_PATH, "does not hash to the manifest's recipe_sha256 (one of them was modified)")]
    gi, out = m["graph_inputs"], []
    for field, (section, key) in FIELDS.items():
        if raw[section].get(key) != gi.get(field):
            out.append(Problem(f"graph_inputs.{field}", f"{short(gi.get(field))} differs from recipe.yaml "
                               f"{section}.{key} ({short(raw[section].get(key))})"))
    k = (raw.get("speculative") or {}).get("num_speculative_tokens", 0)
    if k != gi.get("num_speculative_tokens"):
        out.append(Problem("graph_inputs.num_speculative_tokens", f"differs from recipe.yaml ({short(k)})"))
    arch = raw["model"].get("arch")
    if arch != gi.get("arch") or arch not in registry.ARCHITECTURES:
        return out + [Problem("graph_inputs.arch", f"{short(gi.get('arch'))} differs from recipe.yaml ({short(arch)})")]
    try:
        want = registry.arch(arch).get("config").from_hf_dict(raw["model"].get("config") or {}).to_hf_dict()
    except (NeffbuildError, TypeError, ValueError, KeyError, AttributeError) as exc:
        return out + [Problem(RECIPE_PATH, f"model.config cannot be read ({str(exc)[:120]})")]
    if want != gi.get("model_config"):
        bad = sorted(k for k in set(want) | set(gi["model_config"]) if want.get(k) != gi["model_config"].get(k))
        out.append(Problem("graph_inputs.model_config", f"differs from recipe.yaml model.config in {bad[:6]} "
                           "(the manifest was edited after the build)"))
    return out


def verify_fully(root) -> None:
    """What ``neffbuild verify`` checks (every sha256, each artifact's inputs, recipe.yaml); BundleError if any."""
    from neffbuild.errors import BundleError
    from neffbuild.runtime.bundle import reader

    root = Path(root)
    found = reader.check(root, full=True)
    found = found or problems(root, reader.read_manifest(root))
    if found:
        raise BundleError(f"{root}: {len(found)} problem(s)\n" + "\n".join(f"  - {p}" for p in found))
