"""``neffbuild plan``: the grid a recipe compiles, with cache state and estimated time."""

from __future__ import annotations

import click

from neffbuild import grid, registry, settings
from neffbuild import recipe as recipe_mod
from neffbuild.cli import memory_view
from neffbuild.cli.output import echo_json, json_option
from neffbuild.recipe import parallel_rules


@click.command("plan")
@click.argument("recipe_path", metavar="RECIPE", type=click.Path(dir_okay=False))
@json_option("Print one JSON document {count, formula, targets, warnings} on stdout (errors too).")
@click.option("--cache/--no-cache", "check_cache", default=True, show_default=True,
              help="Look each target up in the compile cache (traces the graph; needs torch).")
@click.option("--backend", type=click.Choice(registry.backend_choices()), default=None,
              help="Override compiler.backend for the cache lookup.")
@memory_view.device_memory_option("says whether a rank fits and the largest serving.num_blocks that does.")
@click.option("--cache-remote", default=None, metavar="s3://BUCKET/PREFIX",
              help="Also look local misses up in this remote cache tier (default: $NEFFBUILD_CACHE_REMOTE); "
                   "rows then say local, remote or build.")
def plan(recipe_path, as_json, check_cache, backend, device_memory, cache_remote):
    """Show every graph RECIPE compiles: label, family, batch, ctx, query_len.

    With --cache (the default) each row also says whether it is in the local cache, in the
    remote tier (--cache-remote) or to build, why a
    miss misses (the nearest cached entry and the fields that differ) and an estimated
    build time from past compiles. After the table: what one rank holds (weights, KV, the
    largest artifact), each target's expected compile memory, and with --device-memory
    whether a rank fits (docs/recipe.md, "Memory").
    """
    r = recipe_mod.load(recipe_path)
    if backend:
        r = r.replace(backend=backend)
    tgts = grid.targets(r)
    states = {}
    if check_cache:
        from neffbuild.compiler.planner import cache_states

        states = cache_states(r, tgts, remote=cache_remote or settings.cache_remote(), on_target=_progress())
    memory = memory_view.plan_memory(r, tgts, states, device_memory)
    if as_json:
        rows = []
        for t in tgts:
            row = t.to_json()
            if t.label in states:
                row.update(states[t.label])
            rows.append(row)
        echo_json({"count": len(tgts), "formula": grid.count_formula(r), "targets": rows, "warnings": list(r.warnings),
                   "parallel": parallel_rules.layout_json(r), "memory": memory})
        return
    from rich.console import Console

    for w in r.warnings:
        click.echo(f"warning: {w}", err=True)
    console = Console()
    console.print(_table(r, tgts, states))
    notes = _notes(tgts, states)
    for note in notes:
        console.print(note, overflow="fold")
    console.print(f"NEFF count: {grid.count_formula(r)}")
    console.print(parallel_rules.describe(r))
    memory_view.print_plan_memory(console, memory, r.jobs or settings.default_jobs())
    if states:
        console.print(_summary(r, tgts, states))


def _progress(every_s: float = 5.0):
    """``on_target`` for cache_states: one stderr line every ``every_s`` seconds of keying (stdout stays --json's)."""
    import time

    start = time.monotonic()
    state = {"next": start + every_s}

    def on_target(done: int, total: int) -> None:
        now = time.monotonic()
        if now >= state["next"]:
            state["next"] = now + every_s
            click.echo(f"plan: keyed {done}/{total} targets ({now - start:.0f} s)", err=True)

    return on_target


def _note(state: dict) -> str:
    return state.get("why", "") + (f" (~{state['estimate_s']:.0f}s)" if state.get("estimate_s") else "")


def _table(r, tgts, states):
    """One line per graph at any width: short columns only; the reasons go below the table (_notes)."""
    from rich import box
    from rich.table import Table

    table = Table(title=f"{r.name} {r.version}: {len(tgts)} graphs", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("label", no_wrap=True)
    table.add_column("family", no_wrap=True)
    for col in ("batch", "ctx", "q"):
        table.add_column(col, justify="right", no_wrap=True)
    if states:
        table.add_column("cache", no_wrap=True)
    for t in tgts:
        cells = [t.label, t.family, str(t.batch), str(t.ctx), str(t.query_len)]
        if states:
            cells.append(states[t.label]["cache"])
        table.add_row(*cells)
    return table


def _notes(tgts, states) -> list[str]:
    """Why each graph is not cached, once per distinct reason (48 rows of one reason are one line)."""
    by_note: dict[str, list[str]] = {}
    for t in tgts:
        note = _note(states[t.label]) if t.label in states else ""
        if note:
            by_note.setdefault(note, []).append(t.label)
    out = []
    for note, labels in by_note.items():
        who = f"all {len(labels)} graphs" if len(labels) == len(tgts) else ", ".join(labels)
        out.append(f"why ({who}): {note}")
    return out


def _summary(r, tgts, states) -> str:
    """'to build: N of M' counting only what the cache could decide; unknown and error rows said as such."""
    count = {c: sum(1 for s in states.values() if s["cache"] == c)
             for c in ("build", "local", "remote", "unknown", "error")}
    if count["unknown"] == len(tgts):
        return f"cache state unknown for all {len(tgts)} graphs (see why above): nothing was looked up"
    todo = [s for s in states.values() if s["cache"] == "build"]
    line = f"to build: {len(todo)} of {len(tgts)} ({count['local']} cached"
    line += "".join(f", {count[c]} {c}" for c in ("remote", "unknown", "error") if count[c]) + ")"
    est = [s["estimate_s"] for s in todo if s.get("estimate_s")]
    if est:
        jobs = r.jobs or settings.default_jobs()
        minutes = sum(est) / max(1, min(jobs, len(todo))) / 60
        line += f", about {minutes:.1f} min with {jobs} jobs (from past compiles)"
    return line


def register(group: click.Group) -> None:
    group.add_command(plan)
