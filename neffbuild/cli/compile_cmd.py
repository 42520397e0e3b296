"""``neffbuild compile``: recipe -> bundle, in parallel, through the cache."""

from __future__ import annotations

import time

import click

from neffbuild import recipe as recipe_mod
from neffbuild import registry
from neffbuild.cli.output import echo_json, json_option
from neffbuild.compiler.progress import Progress
from neffbuild.errors import BuildFailed, InvalidInput


class RichProgress(Progress):
    """N/M done, per-target state, elapsed and ETA on stderr."""

    def __init__(self):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
        from rich.progress import Progress as Bar

        self.console = Console(stderr=True)
        self.bar = Bar(TextColumn("[bold]compile"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                       TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.description}"),
                       console=self.console, transient=False)
        self.task = None
        self.active: list[str] = []
        self.t0 = time.monotonic()

    def stage(self, message):
        self.console.print(f"[dim]{message}…[/dim]")

    def start(self, total):
        self.bar.start()
        self.task = self.bar.add_task("", total=total)

    def running(self, label):
        self.active.append(label)
        self.bar.update(self.task, description="running: " + ", ".join(self.active))

    def finished(self, result):
        label = result.label
        if label in self.active:
            self.active.remove(label)
        if result.ok:
            state = ("[green]cache hit[/green]" if result.hit
                     else f"[yellow]compiled[/yellow] {result.compile_seconds:.1f}s")
        else:
            state = f"[red]FAILED[/red] ({result.kind}): {(result.error or '')[:200]}"
        self.bar.console.print(f"  {label}: {state}")
        self.bar.update(self.task, advance=1, description="running: " + ", ".join(self.active))

    def close(self):
        self.bar.stop()


def summary_table(res):
    from rich.table import Table

    table = Table(title="build summary")
    for col in ("label", "result", "compile s", "MB"):
        table.add_column(col)
    for r in sorted(res.results, key=lambda r: r.label):
        if r.ok:
            table.add_row(r.label, "cache hit" if r.hit else "compiled", f"{r.compile_seconds:.1f}",
                          f"{r.bytes / 1e6:.2f}")
        else:
            table.add_row(r.label, f"FAILED: {r.kind}", "", "")
    return table


@click.command("compile")
@click.pass_context
@click.argument("recipe_path", metavar="RECIPE", type=click.Path(dir_okay=False))
@click.option("-o", "--out", "out_dir", default="artifacts", show_default=True, type=click.Path(file_okay=False),
              help="Folder that receives <name>-<version>/.")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=None,
              help="Parallel compile workers (default: build.jobs from the recipe, else the CPU count).")
@click.option("--backend", type=click.Choice(registry.backend_choices()), default=None,
              help="Override compiler.backend (auto: neuron when the Neuron SDK imports, else inductor).")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
              help="Compile cache folder (default: build.cache_dir, else $NEFFBUILD_CACHE_DIR, "
                   "else ~/.cache/neffbuild).")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=1), default=None,
              help="Give up on one target after this many seconds (classified as a timeout).")
@click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="local: a pool of --jobs warm workers on this machine. ray: one Ray task per target on a "
                   "cluster (needs the ray extra), with memory reserved per target.")
@click.option("--address", default=None, metavar="auto|ray://HOST:PORT|HOST:PORT",
              help="Ray cluster to join (with --executor ray); default: start a Ray instance on this machine.")
@click.option("--shared-cache", is_flag=True,
              help="With --executor ray: the cache folder is mounted at the same path on every node, so tasks "
                   "read and publish it directly instead of returning artifacts through Ray's object store.")
@click.option("--sign-key", "sign_key", type=click.Path(dir_okay=False), default=None, metavar="KEY.pem",
              help="Sign the bundle with this EC private key (PEM) before it is published: model.sig in the "
                   "OpenSSF model-signing format over every file (see `neffbuild sign`).")
@json_option('Print {"bundle", "built", "cached", "failed"} on stdout (errors too); progress goes to stderr.')
def compile_(ctx, recipe_path, out_dir, jobs, backend, cache_dir, timeout_s, executor, address, shared_cache,
             sign_key, as_json):
    """Compile every graph of RECIPE into a versioned bundle under OUT.

    Targets build largest first on a pool of warm workers, through a content-addressed
    cache: a second run of the same recipe compiles nothing. One failing target does not
    stop the others, but then no bundle is published (exit 1) and each failure is listed,
    classified, with its log. Ctrl-C stops cleanly; re-running builds only what is missing.
    With --executor ray the same targets run on a Ray cluster and the bundle is the same
    (same cache keys, same manifest); build-info.json records the node of each target.
    """
    if executor != "ray" and (address or shared_cache):
        raise InvalidInput("--address and --shared-cache need --executor ray")
    key = None
    if sign_key:  # a bad key fails now, not after the build
        from neffbuild.bundle.signing import load_private_key

        key = load_private_key(sign_key)
    r = recipe_mod.load(recipe_path)
    for w in r.warnings:
        click.echo(f"warning: {w}", err=True)
    from neffbuild.compiler.builder import compile_recipe  # torch: only once a build starts (torch-free --help)

    progress = RichProgress()
    try:
        res = compile_recipe(r, out_dir, jobs=jobs, backend_name=backend, cache_root=cache_dir, progress=progress,
                             timeout_s=timeout_s, executor=executor, address=address, shared_cache=shared_cache,
                             sign_key=key)
    finally:
        progress.close()
    if as_json:
        echo_json(res.to_json())
        ctx.meta["json_printed"] = True
    else:
        progress.console.print(summary_table(res))
    if res.memory_note:
        click.echo(res.memory_note, err=True)
    if res.failed:
        lines = [f"  - {f.label}: {f.kind}: {f.error} (log: {f.log})" for f in res.failed]
        raise BuildFailed(f"{len(res.failed)} of {len(res.results)} targets failed; no bundle published.\n"
                          + "\n".join(lines))
    click.echo(f"bundle: {res.bundle} ({res.built} compiled, {res.cached} cached, {res.wall_s:.1f}s)", err=True)


def register(group: click.Group) -> None:
    group.add_command(compile_)
