"""``neffbuild plan``: the grid a recipe compiles, with cache state and estimated time."""

from __future__ import annotations

import click

from neffbuild import grid, registry, settings
from neffbuild import recipe as recipe_mod
from neffbuild.cli.output import echo_json, json_option
from neffbuild.recipe import parallel_rules


@click.command("plan")
@click.argument("recipe_path", metavar="RECIPE", type=click.Path(dir_okay=False))
@json_option("Print one JSON document {count, formula, targets, warnings} on stdout (errors too).")
@click.option("--cache/--no-cache", "check_cache", default=True, show_default=True,
              help="Look each target up in the compile cache (traces the graph; needs torch).")
@click.option("--backend", type=click.Choice(registry.backend_choices()), default=None,
              help="Override compiler.backend for the cache lookup.")
@click.option("--cache-remote", default=None, metavar="s3://BUCKET/PREFIX",
              help="Also look local misses up in this remote cache tier (default: $NEFFBUILD_CACHE_REMOTE); "
                   "rows then say local, remote or build.")
def plan(recipe_path, as_json, check_cache, backend, cache_remote):
    """Show every graph RECIPE compiles: label, family, batch, ctx, query_len.

    With --cache (the default) each row also says whether it is in the local cache, in the
    remote tier (--cache-remote) or to build, why a
    miss misses (the nearest cached entry and the fields that differ) and an estimated
    build time from past compiles.
    """
    r = recipe_mod.load(recipe_path)
    if backend:
        r = r.replace(backend=backend)
    tgts = grid.targets(r)
    states = {}
    if check_cache:
        from neffbuild.compiler.planner import cache_states

        states = cache_states(r, tgts, remote=cache_remote or settings.cache_remote())
    if as_json:
        rows = []
        for t in tgts:
            row = t.to_json()
            if t.label in states:
                row.update(states[t.label])
            rows.append(row)
        echo_json({"count": len(tgts), "formula": grid.count_formula(r), "targets": rows, "warnings": list(r.warnings),
                   "parallel": parallel_rules.layout_json(r)})
        return
    from rich.console import Console
    from rich.table import Table

    for w in r.warnings:
        click.echo(f"warning: {w}", err=True)
    table = Table(title=f"{r.name} {r.version}: {len(tgts)} graphs")
    table.add_column("label", no_wrap=True, min_width=max(len(t.label) for t in tgts))
    table.add_column("family", no_wrap=True)
    for col in ("batch", "ctx", "query_len"):
        table.add_column(col, justify="right")
    if states:
        table.add_column("cache")
        table.add_column("why / estimate")
    for t in tgts:
        cells = [t.label, t.family, str(t.batch), str(t.ctx), str(t.query_len)]
        if states:
            s = states[t.label]
            cells += [s["cache"], s.get("why", "") + (f" (~{s['estimate_s']:.0f}s)" if s.get("estimate_s") else "")]
        table.add_row(*cells)
    console = Console()
    console.print(table)
    console.print(f"NEFF count: {grid.count_formula(r)}")
    console.print(parallel_rules.describe(r))
    if states:
        todo = [s for s in states.values() if s["cache"] == "build"]
        est = [s["estimate_s"] for s in todo if s.get("estimate_s")]
        jobs = r.jobs or settings.default_jobs()
        line = f"to build: {len(todo)} of {len(tgts)}"
        if est:
            minutes = sum(est) / max(1, min(jobs, len(todo))) / 60
            line += f", about {minutes:.1f} min with {jobs} jobs (from past compiles)"
        console.print(line)


def register(group: click.Group) -> None:
    group.add_command(plan)
