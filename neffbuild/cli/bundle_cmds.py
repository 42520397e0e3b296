"""Bundle commands: ``inspect``, ``verify``, ``diff``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import click

from neffbuild import registry
from neffbuild.bundle import recipe_check
from neffbuild.cli import ship_cmds
from neffbuild.cli.output import echo_json, json_option
from neffbuild.errors import BundleError
from neffbuild.runtime.bundle import paths
from neffbuild.runtime.bundle.manifest_file import read_manifest, safe_path
from neffbuild.runtime.bundle.schema import Problem
from neffbuild.runtime.bundle.schema import problems as schema_problems


def _manifest(path: str) -> dict:
    """The manifest of a bundle whose schema holds (what every read command may rely on)."""
    m = read_manifest(Path(path))
    found = schema_problems(m)
    if found:
        raise BundleError(f"{path}: {len(found)} manifest problem(s)\n" + "\n".join(f"  - {p}" for p in found[:20]))
    return m


def _diffable(path: str) -> dict:
    """A manifest with the fields diff reads well typed (diff may compare a bundle that fails verify)."""
    m = read_manifest(Path(path))
    ok = (all(isinstance(m.get(k), dict) for k in ("graph_inputs", "toolchain", "files", "weights"))
          and isinstance(m.get("artifacts"), list)
          and all(isinstance(a, dict) and isinstance(a.get("label"), str) for a in m["artifacts"]))
    if not ok:
        raise BundleError(f"{path}: manifest lacks the fields diff compares (graph_inputs, toolchain, files, weights, "
                          "artifacts with labels); run `neffbuild verify` on it")
    return m


def _compile_seconds(path: str) -> dict[str, float]:
    """Per-label compile times from build-info.json (a per-build record; empty when absent or odd)."""
    info = Path(path) / paths.BUILD_INFO_PATH
    try:
        if not info.is_file() or info.stat().st_size > 16 * 1024 * 1024:
            return {}
        doc = json.loads(info.read_text(encoding="utf-8"))
        seconds = doc.get("compile_seconds", {}) if isinstance(doc, dict) else {}
        return {k: float(v) for k, v in seconds.items()
                if isinstance(v, (int, float)) and math.isfinite(v) and abs(v) < 1e12}
    except (OSError, ValueError, RecursionError, AttributeError):
        return {}


def _console():
    from rich.console import Console

    return Console()


@click.command("inspect")
@click.argument("bundle_path", metavar="BUNDLE", type=click.Path(file_okay=False, exists=True))
@json_option("Print the manifest plus totals (and build-info compile times) as one JSON document.")
@click.option("--vllm-config", "vllm", is_flag=True,
              help="Neuron bundles: print the JSON for vLLM Neuron's --additional-config (the compiled "
                   "neuron_config grid); the other vLLM flags that must match go to stderr. CPU (inductor) "
                   "bundles: print the whole `vllm serve` command line that serves BUNDLE through neffbuild's "
                   "vLLM plugin (docs/vllm.md). With --json: one document (the configs and engine arguments).")
def inspect_(bundle_path, as_json, vllm):
    """Show what BUNDLE holds: header, toolchain, the grid with sizes and compile times, totals."""
    m = _manifest(bundle_path)
    if vllm:
        _print_vllm_config(Path(bundle_path), m, as_json)
        return
    seconds = _compile_seconds(bundle_path)
    totals = {"artifacts": len(m["artifacts"]), "artifact_bytes": sum(a["bytes"] for a in m["artifacts"]),
              "compile_seconds": round(sum(seconds.values()), 3),
              "bundle_bytes": sum(f["bytes"] for f in m["files"].values())}
    shipped = ship_cmds.inspect_fields(bundle_path)
    if as_json:
        echo_json(dict(m, totals=totals, compile_seconds=seconds, **shipped))
        return
    from rich.table import Table

    c = _console()
    gi = m["graph_inputs"]
    c.print(f"[bold]{m['name']} {m['version']}[/bold]  format {m['format']} v{m['format_version']}")
    c.print("toolchain: " + ", ".join(f"{k}={v}" for k, v in sorted(m["toolchain"].items()) if k != "cpu_target"))
    cpu = m["toolchain"].get("cpu_target")
    if isinstance(cpu, dict):
        c.print(f"cpu target: {cpu.get('target')} (-march={cpu.get('march')}, vector width "
                f"{cpu.get('simdlen') if cpu.get('simdlen') is not None else 'auto'}); needs "
                f"{', '.join(cpu.get('features') or []) or 'baseline x86-64 only'}")
    c.print(f"recipe sha256: {m['recipe_sha256']}")
    c.print(f"grid: num_seqs {gi['num_seqs_buckets']} x ctx {gi['decode_context_length_buckets']} + fallback "
            f"{gi['max_model_len']}; block_size {gi['block_size']}, num_blocks {gi['num_blocks']}, "
            f"num_swa {gi['num_swa']}, fp8_packed_kv {gi['fp8_packed_kv']}, k {gi['num_speculative_tokens']}")
    _print_parallel(c, m)
    for line in ship_cmds.inspect_lines(shipped):
        c.print(line, markup=False)
    t = Table()
    for col in ("label", "family", "batch", "ctx", "query_len", "MB", "compile s"):
        t.add_column(col, justify="left" if col in ("label", "family") else "right", no_wrap=col == "label")
    for a in m["artifacts"]:
        t.add_row(a["label"], a["family"], str(a["batch"]), str(a["ctx"]), str(a["query_len"]),
                  f"{a['bytes'] / 1e6:.2f}", f"{seconds[a['label']]:.1f}" if a["label"] in seconds else "-")
    c.print(t)
    c.print(f"totals: {totals['artifacts']} artifacts, {totals['artifact_bytes'] / 1e6:.1f} MB of artifacts, "
            f"{totals['bundle_bytes'] / 1e6:.1f} MB in all, {totals['compile_seconds']:.0f} s of compile time")


def _print_parallel(c, m: dict) -> None:
    """The parallel layout and which weight pieces each rank maps (sharded bundles only)."""
    par = m.get("parallel")
    if par is None:
        gi = m["graph_inputs"]
        c.print(f"parallel: unsharded (tp {gi.get('tp', 1)}, dp {gi.get('dp', 1)}, ep {gi.get('ep', 1)}); "
                "every rank maps the whole model")
        return
    c.print(f"parallel: tp {par['tp']} x dp {par['dp']} = {par['world_size']} ranks, ep {par['ep']} "
            f"(MoE combine: {par['ep_combine']}); rank r maps {m['weights']['file']}"
            + (" + tp{r % tp}" if par["tp"] > 1 else "") + (" + ep{r % ep}" if par["ep"] > 1 else ""))
    sizes = {name: m["files"].get(e["file"], {}).get("bytes", 0) for name, e in par["pieces"].items()}
    c.print("  pieces: " + ", ".join(f"{n} {sizes[n] / 1e6:.2f} MB" for n in sorted(sizes)))
    split = ", ".join(f"{k} over {v['over']} (axis {v['axis']})" for k, v in sorted(par["shard_layout"].items()))
    c.print(f"  split: {split}")


def _print_vllm_config(root: Path, manifest: dict, as_json: bool) -> None:
    import yaml

    from neffbuild.bundle import handoff, paths

    recipe_file = safe_path(root, paths.RECIPE_PATH)
    recipe = yaml.safe_load(recipe_file.read_text()) if recipe_file.is_file() else {}
    recipe = recipe if isinstance(recipe, dict) else {}
    backend = registry.BACKENDS.get(manifest.get("toolchain", {}).get("backend"))
    if backend is None or "vllm_plugin" in backend.parts:  # vLLM with neffbuild's plugin (a CPU bundle)
        plugin = handoff.plugin_config(root, manifest, recipe)
        if as_json:
            click.echo(json.dumps(plugin, sort_keys=True))
            return
        click.echo(plugin["command"])
        for w in plugin["warnings"]:
            click.echo(f"warning: {w}", err=True)
        return
    config = handoff.vllm_config(manifest, recipe)
    if as_json:
        click.echo(json.dumps(config, sort_keys=True))
        return
    click.echo(json.dumps(config["additional_config"]))
    click.echo(f"vLLM flags for this bundle: {handoff.vllm_flags(config)}", err=True)
    for w in config["warnings"]:
        click.echo(f"warning: {w}", err=True)


@click.command("verify")
@click.argument("bundle_path", metavar="BUNDLE", type=click.Path(file_okay=False, exists=True))
@ship_cmds.trust_option("Also require BUNDLE's signature (model.sig) by this public key over every file.")
@json_option('Print {"ok": bool, "problems": [{"path", "message"}]}.')
@click.pass_context
def verify(ctx, bundle_path, trust, as_json):
    """Check the manifest digest and schema, every checksum and each artifact's declared inputs.

    With --trust (or NEFFBUILD_TRUSTED_KEYS) the signature is checked first. Exit 1 naming each
    bad file or field, or the key.
    """
    from neffbuild.runtime.bundle import reader

    signed = ship_cmds.check_signature(bundle_path, trust)
    problems = [Problem(path, message) for path, message in signed] or reader.check(Path(bundle_path), full=True)
    problems = problems or recipe_check.problems(Path(bundle_path), read_manifest(Path(bundle_path)))  # + yaml
    problems = problems or nonfinite_weights(Path(bundle_path))
    if as_json:
        echo_json({"ok": not problems, "problems": [{"path": p.path, "message": p.message} for p in problems]})
        ctx.meta["json_printed"] = True
    if problems:
        raise BundleError(f"{bundle_path}: {len(problems)} problem(s)\n" + "\n".join(f"  - {p}" for p in problems))
    if not as_json:
        click.echo(f"{bundle_path}: ok")


def nonfinite_weights(root: Path) -> list:
    """A NaN or an infinity in any stored weight (digests recomputed to match would pass every other check, and
    generate would print zeros): one pass over every weights file, after the digests held."""
    from neffbuild.runtime.bundle import weights_file

    m = read_manifest(root)
    files = [m["weights"]["file"], *(e["file"] for e in m.get("parallel", {}).get("pieces", {}).values())]
    out = []
    for rel in files:
        bad = weights_file.nonfinite(safe_path(root, rel))
        if bad:
            out.append(Problem(rel, f"tensors {bad[:5]} hold NaN or infinite values; rebuild from a sound "
                                    "checkpoint"))
    return out


HEADER_FIELDS = ("name", "version", "recipe_sha256")


def _flat(node, prefix: str, out: dict) -> dict:
    """Nested mappings -> {"a.b.c": leaf}; lists and scalars are leaves."""
    if isinstance(node, dict) and node:
        for k, v in node.items():
            _flat(v, f"{prefix}.{k}", out)
    else:
        out[prefix] = node
    return out


def _bundle_recipe(path: str) -> dict:
    """The bundle's normalised recipe.yaml, flattened to dotted fields ({} when absent or unreadable)."""
    from neffbuild.errors import NeffbuildError
    from neffbuild.recipe import parse_yaml, read_regular_file

    try:
        f = safe_path(Path(path), paths.RECIPE_PATH)
        if not f.is_file():
            return {}
        raw = parse_yaml(read_regular_file(f, "bundle recipe"), str(f))
    except NeffbuildError:
        return {}
    return _flat(raw, "recipe", {}) if isinstance(raw, dict) else {}


def diff_manifests(a: dict, b: dict, recipe_a: dict | None = None, recipe_b: dict | None = None) -> dict:
    """Targets added/removed/changed, and every changed field: bundle header, graph inputs, toolchain
    and each recipe field (``recipe.model.random_seed``), so a change that shapes no graph still shows."""
    la, lb = {x["label"]: x for x in a["artifacts"]}, {x["label"]: x for x in b["artifacts"]}
    config = {}
    for k in HEADER_FIELDS:
        if a.get(k) != b.get(k):
            config[f"bundle.{k}"] = [a.get(k), b.get(k)]
    for section in ("graph_inputs", "toolchain"):
        for k in sorted(set(a[section]) | set(b[section])):
            if a[section].get(k) != b[section].get(k):
                config[f"{section}.{k}"] = [a[section].get(k), b[section].get(k)]
    ra, rb = recipe_a or {}, recipe_b or {}
    for k in sorted(set(ra) | set(rb)):
        if ra.get(k) != rb.get(k):
            config[k] = [ra.get(k), rb.get(k)]
    return {
        "added": sorted(set(lb) - set(la)),
        "removed": sorted(set(la) - set(lb)),
        "changed": sorted(k for k in set(la) & set(lb) if la[k].get("sha256") != lb[k].get("sha256")),
        "unchanged": sorted(k for k in set(la) & set(lb) if la[k].get("sha256") == lb[k].get("sha256")),
        "config": config,
        "weights_changed": (a["files"].get(str(a["weights"].get("file")))
                            != b["files"].get(str(b["weights"].get("file")))),
    }


@click.command("diff")
@click.argument("a", type=click.Path(file_okay=False, exists=True))
@click.argument("b", type=click.Path(file_okay=False, exists=True))
@json_option("Print the difference as one JSON document.")
def diff(a, b, as_json):
    """What changed from bundle A to bundle B: targets added/removed, artifacts changed, and every changed
    field of the bundle header, graph inputs, toolchain and recipe (each named by its dotted path)."""
    d = diff_manifests(_diffable(a), _diffable(b), _bundle_recipe(a), _bundle_recipe(b))
    if as_json:
        echo_json(d)
        return
    for key in ("added", "removed", "changed"):
        click.echo(f"{key} ({len(d[key])}): {', '.join(d[key]) or '-'}")
    click.echo(f"unchanged: {len(d['unchanged'])}; weights changed: {d['weights_changed']}")
    if not d["config"]:
        click.echo("config: no field changed")
    for k, (old, new) in d["config"].items():
        click.echo(f"config {k}: {old!r} -> {new!r}")


def register(group: click.Group) -> None:
    for cmd in (inspect_, verify, diff):
        group.add_command(cmd)
