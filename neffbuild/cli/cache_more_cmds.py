"""``neffbuild cache prune`` and ``neffbuild cache remote check``: keeping the cache tiers in shape."""

from __future__ import annotations

import time

import click

from neffbuild import settings
from neffbuild.cli.output import echo_json, json_option
from neffbuild.compiler.cache import Cache


@click.command("prune")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
              help="Cache folder (default: $NEFFBUILD_CACHE_DIR, else ~/.cache/neffbuild).")
@click.option("--max-size", default=None, metavar="SIZE",
              help="Keep at most this much (500M, 20G, bytes): least recently used entries go first.")
@click.option("--unused-for", "unused_for", type=click.FloatRange(min=0), default=None, metavar="DAYS",
              help="Remove every entry not used for more than DAYS days.")
@click.option("--dry-run", is_flag=True, help="Only list what would be removed.")
@json_option('Print {"dry_run", "removed", "kept", "freed_bytes", "kept_bytes"} on stdout.')
def prune(cache_dir, max_size, unused_for, dry_run, as_json):
    """Remove local cache entries, least recently USED first (last use is recorded on every hit).

    Refuses while a build holds the cache. The remote tier is never touched.
    """
    from neffbuild.compiler.prune import parse_size
    from neffbuild.compiler.prune import prune as do_prune

    max_bytes = parse_size(max_size) if max_size is not None else None
    res = do_prune(Cache(cache_dir or settings.cache_dir()), max_bytes=max_bytes,
                   unused_for_s=unused_for * 86400 if unused_for is not None else None, dry_run=dry_run)
    if as_json:
        echo_json(res)
        return
    verb = "would remove" if dry_run else "removed"
    for e in res["removed"]:
        click.echo(f"{verb} {e['key'][:16]}  {e['label']:<28} {e['bytes'] / 1e6:7.2f} MB  last used "
                   f"{_ago(e['last_used'])}{'' if e['valid'] else ' (corrupt)'}")
    click.echo(f"{verb} {len(res['removed'])} entries ({res['freed_bytes'] / 1e6:.2f} MB); kept "
               f"{len(res['kept'])} ({res['kept_bytes'] / 1e6:.2f} MB)", err=True)


def _ago(t: float) -> str:
    s = max(0.0, time.time() - t)
    return f"{s / 86400:.1f} days ago" if s >= 86400 else f"{s / 3600:.1f} h ago" if s >= 3600 else f"{s:.0f} s ago"


@click.group("remote")
def remote():
    """The remote cache tier (s3://BUCKET/PREFIX)."""


@remote.command("check")
@click.argument("url", metavar="s3://BUCKET/PREFIX")
@json_option('Print {"url", "endpoint", "reachable", "readable", "writable", "errors"} on stdout.')
def check(url, as_json):
    """Say whether URL is reachable, readable and writable with the credentials of the standard AWS chain.

    Writable is probed with a create-only put of one small object under PREFIX/.neffbuild-probe/.
    Exit 0 when readable, 1 otherwise.
    """
    from neffbuild.compiler.remote_cache import check as do_check
    from neffbuild.s3 import parse_url

    parse_url(url, "URL")
    res = do_check(url)
    if as_json:
        echo_json(res)
    else:
        for k in ("reachable", "readable", "writable"):
            click.echo(f"{k}: {'yes' if res[k] else 'no'}")
        for e in res["errors"]:
            click.echo(f"  {e}", err=True)
    if not res["readable"]:
        raise SystemExit(1)



