"""``neffbuild compile``: recipe -> bundle, in parallel, through the cache."""

from __future__ import annotations

import sys
import threading
import time

import click

from neffbuild import recipe as recipe_mod
from neffbuild import registry, settings
from neffbuild.cli.output import echo_json, json_option
from neffbuild.compiler.progress import Progress
from neffbuild.errors import BuildFailed, InvalidInput
from neffbuild.fsutil import writable_dir_problem


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
            state = (("[green]remote hit[/green]" if result.remote_hit else "[green]cache hit[/green]")
                     if result.hit else f"[yellow]compiled[/yellow] {result.compile_seconds:.1f}s")
        else:
            state = f"[red]FAILED[/red] ({result.kind}): {(result.error or '')[:200]}"
        self.bar.console.print(f"  {label}: {state}")
        self.bar.update(self.task, advance=1, description="running: " + ", ".join(self.active))

    def close(self):
        self.bar.stop()


def _field(result, name: str, default=None):
    """A job result's field, from the result dict or a typed result's attribute."""
    return result.get(name, default) if isinstance(result, dict) else getattr(result, name, default)


def _result_ok(result) -> bool:
    return result.get("status") == "ok" if isinstance(result, dict) else bool(result.ok)


class LineProgress(Progress):
    """Without a terminal (a pipe, CI log): plain progress lines on stderr, none of them rewritten.

    A target still running after ``START_S`` gets a "started" line (so cache hits, which finish at
    once, print one line each), and every ``EVERY_S`` a line says what is still running.
    """

    START_S, EVERY_S = 2.0, 30.0

    def __init__(self, clock=time.monotonic, tick_s: float = 0.5):
        from rich.console import Console

        self.console = Console(stderr=True)  # the summary table (compile_ prints it through this)
        self.clock, self.t0, self.tick_s = clock, clock(), tick_s
        self.total, self.done = 0, 0
        self.active: dict[str, float] = {}  # label -> start time
        self.announced: set[str] = set()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.last_summary = self.t0
        self.thread = threading.Thread(target=self._beat, name="compile-progress", daemon=True)

    def _line(self, text: str) -> None:
        count = f" [{self.done}/{self.total}]" if self.total else ""
        click.echo(f"compile{count} {self.clock() - self.t0:5.0f}s  {text}", err=True)

    def stage(self, message):
        with self.lock:
            self._line(message)

    def start(self, total):
        with self.lock:
            self.total = total
            self._line(f"{total} targets (largest first)")
        self.thread.start()

    def running(self, label):
        with self.lock:
            self.active[label] = self.clock()

    def finished(self, result):
        label = _field(result, "label")
        with self.lock:
            started = self.active.pop(label, None)
            self.done += 1
            if not _result_ok(result):
                error = _field(result, "error") or ""
                self._line(f"{label}: FAILED ({_field(result, 'kind')}): {error[:300]}")
            elif _field(result, "hit"):
                self._line(f"{label}: {'remote hit' if _field(result, 'remote_hit') else 'cache hit'}")
            else:
                took = f" in {self.clock() - started:.0f}s" if started is not None else ""
                self._line(f"{label}: compiled{took} (compiler {_field(result, 'compile_seconds'):.1f}s)")

    def beat(self) -> None:
        """One tick: announce targets running longer than START_S; every EVERY_S, what still runs."""
        now = self.clock()
        with self.lock:
            for label, since in self.active.items():
                if label not in self.announced and now - since >= self.START_S:
                    self.announced.add(label)
                    self._line(f"{label}: started")
            if self.active and now - self.last_summary >= self.EVERY_S:
                self.last_summary = now
                self._line("still running: " + ", ".join(f"{lb} ({now - t:.0f}s)" for lb, t in self.active.items()))

    def _beat(self):
        while not self.stop.wait(self.tick_s):
            self.beat()

    def close(self):
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join()


def make_progress() -> Progress:
    """A live bar on a terminal; progress lines everywhere else (a bar would print nothing until the end)."""
    return RichProgress() if sys.stderr.isatty() else LineProgress()


def summary_table(res):
    from rich.table import Table

    table = Table(title="build summary")
    for col in ("label", "result", "compile s", "MB"):
        table.add_column(col)
    for r in sorted(res.results, key=lambda r: r.label):
        if r.ok:
            state = ("remote hit" if r.remote_hit else "cache hit") if r.hit else "compiled"
            if r.push == "pushed":
                state += ", pushed"
            table.add_row(r.label, state, f"{r.compile_seconds:.1f}", f"{r.bytes / 1e6:.2f}")
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
@click.option("--cache-remote", default=None, metavar="s3://BUCKET/PREFIX",
              help="A shared remote cache tier behind the local cache (default: $NEFFBUILD_CACHE_REMOTE). "
                   "Credentials and endpoint come from the standard AWS chain (AWS_ENDPOINT_URL_S3 for an "
                   "S3-compatible server). Needs the s3 extra: pip install 'neffbuild[s3]'.")
@click.option("--cache-remote-mode", type=click.Choice(["auto", "rw", "ro"]), default="auto", show_default=True,
              help="auto: write until a write is refused, then read-only for the run. rw: always try to write. "
                   "ro: never write.")
@click.option("--cache-trust", "cache_trust", multiple=True, type=click.Path(dir_okay=False), metavar="KEY.pub",
              help="Use only remote cache entries signed by this EC public key (PEM); others are rebuilt. Repeat "
                   "for several keys; default: $NEFFBUILD_CACHE_TRUSTED_KEYS. Without one the bucket is trusted.")
@click.option("--cache-sign-key", "cache_sign_key", type=click.Path(dir_okay=False), default=None, metavar="KEY.pem",
              help="Sign every entry this build pushes to the remote cache with this EC private key (PEM); "
                   "default: $NEFFBUILD_CACHE_SIGN_KEY.")
@click.option("--shard", default=None, metavar="I/N",
              help="Build only the I-th of N deterministic slices of the grid into the cache (no bundle); a "
                   "later compile with every shard's entries in the remote tier assembles the bundle.")
@json_option('Print {"bundle", "built", "cached", "local_hits", "remote_hits", "misses", "pushes", '
             '"remote_errors", "remote", "failed"} on stdout (errors too); progress goes to stderr.')
def compile_(ctx, recipe_path, out_dir, jobs, backend, cache_dir, timeout_s, executor, address, shared_cache,
             sign_key, cache_remote, cache_remote_mode, cache_trust, cache_sign_key, shard, as_json):
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
    from neffbuild.compiler import remote_tier

    cache_remote = cache_remote or settings.cache_remote()
    remote_tier.open_tier(cache_remote, cache_remote_mode)  # a bad URL is exit 2 before any work
    shard_t = remote_tier.parse_shard(shard) if shard else None
    key = None
    if sign_key:  # a bad key fails now, not after the build
        from neffbuild.bundle.signing import load_private_key

        key = load_private_key(sign_key)
    trust, entry_key = _cache_keys(cache_remote, cache_trust, cache_sign_key)
    r = recipe_mod.load(recipe_path)
    for w in r.warnings:
        click.echo(f"warning: {w}", err=True)
    cache_problem = writable_dir_problem(cache_dir or r.cache_dir or settings.cache_dir(), "--cache-dir")
    if cache_problem:  # before any worker starts: a clean exit 2, not a traceback from the cache
        raise InvalidInput(cache_problem)

    from neffbuild.compiler.builder import compile_recipe  # torch: only once a build starts (torch-free --help)

    progress = make_progress()
    try:
        res = compile_recipe(r, out_dir, jobs=jobs, backend_name=backend, cache_root=cache_dir, progress=progress,
                             timeout_s=timeout_s, executor=executor, address=address, shared_cache=shared_cache,
                             sign_key=key, remote=cache_remote, remote_mode=cache_remote_mode, shard=shard_t,
                             remote_trust=trust, remote_sign_key=entry_key)
    finally:
        progress.close()
    for w in (res.remote or {}).get("warnings", []):
        click.echo(f"warning: {w}", err=True)
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
    click.echo(counts_line(res), err=True)


def _cache_keys(cache_remote, cache_trust, cache_sign_key) -> tuple[tuple[bytes, ...], object]:
    """(trusted PEM keys, signing key) of the remote tier, each read and checked now: a bad key is exit 2 first."""
    trust_paths = list(cache_trust) or settings.cache_trusted_keys()
    sign_path = cache_sign_key or settings.cache_sign_key()
    if not cache_remote:
        return (), None
    from neffbuild.compiler.entry_sig import load_trusted

    trust = load_trusted(trust_paths)
    if not sign_path:
        return trust, None
    from neffbuild.bundle.signing import load_private_key

    return trust, load_private_key(sign_path, what="--cache-sign-key")


def counts_line(res) -> str:
    """The one-line summary: where the bundle went and where each target came from."""
    doc = res.to_json()
    head = f"shard {res.shard}: {len(res.results)} targets into the cache (no bundle)" if res.shard else \
        f"bundle: {res.bundle}"
    line = f"{head} ({res.built} compiled, {res.cached} cached, {res.wall_s:.1f}s)"
    if res.remote:
        line += (f"; cache: {doc['local_hits']} local hits, {doc['remote_hits']} remote hits, {doc['misses']} misses, "
                 f"{doc['pushes']} pushes, {doc['remote_errors']} remote errors; remote {res.remote['url']} "
                 f"{res.remote['state']}")
    return line


def register(group: click.Group) -> None:
    group.add_command(compile_)
