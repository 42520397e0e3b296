"""``neffbuild cache path|ls|clear`` (and prune, remote: cli/cache_more_cmds.py): the compile cache."""

from __future__ import annotations

import click

from neffbuild import settings
from neffbuild.cli.output import echo_json, json_option
from neffbuild.compiler.cache import Cache

_dir = click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
                    help="Cache folder (default: $NEFFBUILD_CACHE_DIR, else ~/.cache/neffbuild).")


def _cache(cache_dir) -> Cache:
    return Cache(cache_dir or settings.cache_dir())


@click.group("cache")
def cache():
    """Inspect or clear the compile cache (safe to delete at any time)."""


@cache.command("path")
@_dir
def path(cache_dir):
    """Print the cache folder."""
    click.echo(str(_cache(cache_dir).root))


@cache.command("ls")
@_dir
@json_option("Print the entries as one JSON list.")
def ls(cache_dir, as_json):
    """List valid cache entries: key, target label, compile time, size, last use. Changes nothing."""
    c = _cache(cache_dir)
    entries = [dict(e, last_used=c.last_used(e["key"])) for e in c.list()]
    if as_json:
        echo_json(entries)
        return
    from neffbuild.cli.cache_more_cmds import _ago

    for e in entries:
        click.echo(f"{e['key'][:16]}  {e.get('label', '?'):<28} {e.get('compile_seconds', 0):7.1f}s  "
                   f"{e['bytes'] / 1e6:6.2f} MB  used {_ago(e['last_used']):<14} "
                   f"{e.get('fingerprint', {}).get('backend', '?')}")
    click.echo(f"{len(entries)} entries", err=True)


@cache.command("clear")
@_dir
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def clear(cache_dir, yes):
    """Delete every cache entry."""
    c = _cache(cache_dir)
    if not yes:
        click.confirm(f"delete {c.root}?", abort=True)
    click.echo(f"removed {c.clear()} entries from {c.root}")


def register(group: click.Group) -> None:
    from neffbuild.cli.cache_more_cmds import prune, remote

    cache.add_command(prune)
    cache.add_command(remote)
    group.add_command(cache)
