"""Bundle commands: ``inspect``, ``verify``, ``diff``."""

from __future__ import annotations

import json
from pathlib import Path

import click

from neffbuild.errors import BundleError
from neffbuild.runtime import bundle as reader


def _console():
    from rich.console import Console

    return Console()


@click.command("inspect")
@click.argument("bundle_path", metavar="BUNDLE", type=click.Path(file_okay=False, exists=True))
@click.option("--json", "as_json", is_flag=True, help="Print the manifest plus totals as one JSON document.")
@click.option("--vllm-config", "vllm", is_flag=True,
              help="Print the JSON for vLLM's --additional-config (the compiled neuron_config grid); the other "
                   "vLLM flags that must match go to stderr. With --json: one document with the additional config, "
                   "the speculative config and the engine arguments.")
def inspect_(bundle_path, as_json, vllm):
    """Show what BUNDLE holds: header, toolchain, the grid with sizes and compile times, totals."""
    m = reader.read_manifest(Path(bundle_path))
    if vllm:
        _print_vllm_config(Path(bundle_path), m, as_json)
        return
    totals = {"artifacts": len(m["artifacts"]), "artifact_bytes": sum(a["bytes"] for a in m["artifacts"]),
              "compile_seconds": round(sum(a["compile_seconds"] for a in m["artifacts"]), 3),
              "bundle_bytes": sum(f["bytes"] for f in m["files"].values())}
    if as_json:
        click.echo(json.dumps(dict(m, totals=totals), sort_keys=True))
        return
    from rich.table import Table

    c = _console()
    gi = m["graph_inputs"]
    c.print(f"[bold]{m['name']} {m['version']}[/bold]  format {m['format']} v{m['format_version']}")
    c.print("toolchain: " + ", ".join(f"{k}={v}" for k, v in sorted(m["toolchain"].items())))
    c.print(f"recipe sha256: {m['recipe_sha256']}")
    c.print(f"grid: num_seqs {gi['num_seqs_buckets']} x ctx {gi['decode_context_length_buckets']} + fallback "
            f"{gi['max_model_len']}; block_size {gi['block_size']}, num_blocks {gi['num_blocks']}, "
            f"num_swa {gi['num_swa']}, fp8_packed_kv {gi['fp8_packed_kv']}, k {gi['num_speculative_tokens']}")
    t = Table()
    for col in ("label", "family", "batch", "ctx", "query_len", "MB", "compile s"):
        t.add_column(col, justify="left" if col in ("label", "family") else "right", no_wrap=col == "label")
    for a in m["artifacts"]:
        t.add_row(a["label"], a["family"], str(a["batch"]), str(a["ctx"]), str(a["query_len"]),
                  f"{a['bytes'] / 1e6:.2f}", f"{a['compile_seconds']:.1f}")
    c.print(t)
    c.print(f"totals: {totals['artifacts']} artifacts, {totals['artifact_bytes'] / 1e6:.1f} MB of artifacts, "
            f"{totals['bundle_bytes'] / 1e6:.1f} MB in all, {totals['compile_seconds']:.0f} s of compile time")


def _print_vllm_config(root: Path, manifest: dict, as_json: bool) -> None:
    import yaml

    from neffbuild.bundle import handoff, layout

    recipe_file = reader.safe_path(root, layout.RECIPE_PATH)
    recipe = yaml.safe_load(recipe_file.read_text()) if recipe_file.is_file() else {}
    config = handoff.vllm_config(manifest, recipe if isinstance(recipe, dict) else {})
    if as_json:
        click.echo(json.dumps(config, sort_keys=True))
        return
    click.echo(json.dumps(config["additional_config"]))
    click.echo(f"vLLM flags for this bundle: {handoff.vllm_flags(config)}", err=True)


@click.command("verify")
@click.argument("bundle_path", metavar="BUNDLE", type=click.Path(file_okay=False, exists=True))
@click.option("--json", "as_json", is_flag=True, help='Print {"ok": bool, "problems": [{"path", "message"}]}.')
def verify(bundle_path, as_json):
    """Check every checksum and the manifest schema of BUNDLE. Exit 1 naming each bad file."""
    problems = reader.check(Path(bundle_path), full=True)
    if as_json:
        listed = [{"path": p.path, "message": p.message} for p in problems]
        click.echo(json.dumps({"ok": not problems, "problems": listed}))
    if problems:
        raise BundleError(f"{bundle_path}: {len(problems)} problem(s)\n" + "\n".join(f"  - {p}" for p in problems))
    if not as_json:
        click.echo(f"{bundle_path}: ok")


def diff_manifests(a: dict, b: dict) -> dict:
    la, lb = {x["label"]: x for x in a["artifacts"]}, {x["label"]: x for x in b["artifacts"]}
    config = {}
    for section in ("graph_inputs", "toolchain"):
        for k in sorted(set(a[section]) | set(b[section])):
            if a[section].get(k) != b[section].get(k):
                config[f"{section}.{k}"] = [a[section].get(k), b[section].get(k)]
    return {
        "added": sorted(set(lb) - set(la)),
        "removed": sorted(set(la) - set(lb)),
        "changed": sorted(k for k in set(la) & set(lb) if la[k]["sha256"] != lb[k]["sha256"]),
        "unchanged": sorted(k for k in set(la) & set(lb) if la[k]["sha256"] == lb[k]["sha256"]),
        "config": config,
        "weights_changed": a["files"].get(a["weights"]["file"]) != b["files"].get(b["weights"]["file"]),
    }


@click.command("diff")
@click.argument("a", type=click.Path(file_okay=False, exists=True))
@click.argument("b", type=click.Path(file_okay=False, exists=True))
@click.option("--json", "as_json", is_flag=True, help="Print the difference as one JSON document.")
def diff(a, b, as_json):
    """What changed from bundle A to bundle B: targets added/removed, artifacts changed, config."""
    d = diff_manifests(reader.read_manifest(Path(a)), reader.read_manifest(Path(b)))
    if as_json:
        click.echo(json.dumps(d, sort_keys=True))
        return
    for key in ("added", "removed", "changed"):
        click.echo(f"{key} ({len(d[key])}): {', '.join(d[key]) or '-'}")
    click.echo(f"unchanged: {len(d['unchanged'])}; weights changed: {d['weights_changed']}")
    for k, (old, new) in d["config"].items():
        click.echo(f"config {k}: {old!r} -> {new!r}")


def register(group: click.Group) -> None:
    for cmd in (inspect_, verify, diff):
        group.add_command(cmd)
