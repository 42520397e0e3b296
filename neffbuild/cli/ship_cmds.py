"""Shipping commands: ``sign``, ``push``, ``pull``; and the signature/provenance parts of ``verify`` and ``inspect``."""

from __future__ import annotations

import json
from pathlib import Path

import click

from neffbuild import settings
from neffbuild.cli.output import echo_json, json_option
from neffbuild.runtime.bundle import paths


class BarProgress:
    """Bytes done / total, speed and ETA on stderr (rich)."""

    def __init__(self, quiet: bool = False):
        self.bar = self.task = None
        self.quiet = quiet

    def start(self, total: int, what: str) -> None:
        if self.quiet:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self.bar = Progress(TextColumn(f"[bold]{what}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                            TextColumn("eta"), TimeRemainingColumn(), console=Console(stderr=True))
        self.bar.start()
        self.task = self.bar.add_task(what, total=total)

    def advance(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, advance=n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def trust_option(help_text: str):
    return click.option("--trust", "trust", multiple=True, type=click.Path(dir_okay=False, exists=True),
                        metavar="PUB.pem",
                        help=help_text + " Repeat for several keys; default: $NEFFBUILD_TRUSTED_KEYS.")


def trusted(trust: tuple[str, ...]) -> list[str]:
    return list(trust) or settings.trusted_keys()


@click.command("sign")
@click.argument("bundle_path", metavar="BUNDLE", type=click.Path(file_okay=False, exists=True))
@click.option("--key", "key_path", required=True, type=click.Path(dir_okay=False), metavar="KEY.pem",
              help="EC private key (PEM, P-256/384/521), e.g. from `openssl ecparam -genkey -name prime256v1 "
                   "-noout -out key.pem`.")
@json_option('Print {"bundle", "signature", "key_hint", "files", "bytes"}.')
def sign_(bundle_path, key_path, as_json):
    """Sign BUNDLE: write model.sig (OpenSSF model-signing format, key mode) over every file.

    Refuses a bundle that fails its checks or whose files differ from the manifest. Verify with
    `neffbuild verify BUNDLE --trust PUB.pem` (or model-signing's own `verify key`).
    """
    from neffbuild.bundle import signing

    doc = signing.sign(bundle_path, signing.load_private_key(key_path))
    if as_json:
        echo_json(doc)
    else:
        click.echo(f"{doc['signature']}: signed {doc['files']} files ({doc['bytes'] / 1e6:.1f} MB) with key "
                   f"{doc['key_hint'][:16]}…")


@click.command("push")
@click.argument("bundle_path", metavar="BUNDLE", type=click.Path(file_okay=False, exists=True))
@click.argument("url", metavar="s3://BUCKET/PREFIX")
@json_option('Print {"bundle", "url", "digest_url", "files", "bytes", "uploaded_blobs", "uploaded_bytes", '
             '"skipped_bytes", "noop"}.')
def push(bundle_path, url, as_json):
    """Upload BUNDLE under s3://BUCKET/PREFIX as content-addressed blobs, the index last.

    Blobs the remote already holds (weights shared by two versions) are not sent again; the
    same bundle pushed twice is a no-op; a name-version that exists with other bytes is
    refused (versions are immutable). Credentials: the standard AWS chain; an S3-compatible
    server: AWS_ENDPOINT_URL_S3.
    """
    from neffbuild.bundle import remote

    bar = BarProgress(quiet=as_json)
    try:
        doc = remote.push(bundle_path, url, bar)
    finally:
        bar.close()
    if as_json:
        echo_json(doc)
    elif doc["noop"]:
        click.echo(f"{doc['url']}: already pushed with the same bytes (nothing sent)")
    else:
        click.echo(f"{doc['url']}: pushed {doc['uploaded_blobs']} blobs ({doc['uploaded_bytes'] / 1e6:.1f} MB), "
                   f"{doc['skipped_bytes'] / 1e6:.1f} MB already there; by digest: {doc['digest_url']}")


@click.command("pull")
@click.argument("url", metavar="s3://BUCKET/PREFIX/NAME-VERSION")
@click.argument("dest", metavar="DIR", type=click.Path(file_okay=False))
@trust_option("Verify the bundle's signature with this public key before it appears under DIR.")
@json_option('Print {"bundle", "files", "bytes", "downloaded_bytes", "resumed_bytes", "reused_bytes", '
             '"signature", "noop"}.')
def pull(url, dest, trust, as_json):
    """Download a bundle into DIR/NAME-VERSION (also by digest: s3://BUCKET/PREFIX/sha256:HEX).

    Files land in DIR/.NAME-VERSION.pull first; every sha256, the bundle's checks and (with
    trusted keys) its signature are checked before the folder is renamed into place. A killed
    pull leaves no bundle; the next one resumes partial files with ranged reads.
    """
    from neffbuild.bundle import remote

    bar = BarProgress(quiet=as_json)
    try:
        doc = remote.pull(url, dest, trusted_keys=trusted(trust), progress=bar)
    finally:
        bar.close()
    if as_json:
        echo_json(doc)
        return
    sig = doc["signature"]
    click.echo(f"{doc['bundle']}: " + ("already present" if doc["noop"] else
               f"{doc['downloaded_bytes'] / 1e6:.1f} MB downloaded, {doc['resumed_bytes'] / 1e6:.1f} MB resumed") +
               (f"; signature ok (key {sig['key']})" if sig else "; signature not checked (no trusted key)"))


def check_signature(bundle_path: str, trust: tuple[str, ...]) -> list[tuple[str, str]]:
    """``verify``'s signature part: [(path, message)] problems; none when no key is trusted."""
    from neffbuild.errors import SignatureError
    from neffbuild.runtime.bundle import model_sig as signature

    keys = trusted(trust)
    if not keys:
        return []
    try:
        signature.verify_bundle(Path(bundle_path), keys)
    except SignatureError as exc:
        return [(path, str(exc)) for path in exc.paths]
    return []


def require_signature(bundle_path: str, trust: tuple[str, ...]) -> None:
    """``generate --trust``: SignatureError (exit 1) unless the signature verifies; --trust absent: open_bundle
    still honours NEFFBUILD_TRUSTED_KEYS."""
    if trust:
        from neffbuild.runtime.bundle import model_sig as signature

        signature.verify_bundle(Path(bundle_path), list(trust))


def inspect_fields(bundle_path: str) -> dict:
    """``inspect``'s signature and provenance fields (the signature is described, not verified)."""
    from neffbuild.bundle import provenance, signing

    out = {"signature": signing.describe(bundle_path), "provenance": None}
    p = Path(bundle_path) / paths.PROVENANCE_PATH
    if p.is_file() and not p.is_symlink() and p.stat().st_size < 16 * 1024 * 1024:
        try:
            out["provenance"] = provenance.summary(json.loads(p.read_text(encoding="utf-8")))
        except (ValueError, UnicodeDecodeError, RecursionError):
            out["provenance"] = {"error": f"{paths.PROVENANCE_PATH} is not JSON"}
    return out


def inspect_lines(fields: dict) -> list[str]:
    sig, prov = fields["signature"], fields["provenance"]
    lines = [f"signature: signed by key {sig['key_hint'][:16]}… (not verified here: `neffbuild verify --trust "
             "PUB.pem`)" if sig.get("signed") else "signature: unsigned" + (f" ({sig['error']})" if "error" in sig
                                                                           else "")]
    if prov and "error" not in prov:
        lines.append(f"provenance: built by {prov['builder']} at {prov['finished']}; checkpoint "
                     + ", ".join(f"{k} {v}" for k, v in (prov["checkpoint"] or {}).items())
                     + f"; from cache: {len(prov['from_cache'] or [])}, compiled: {len(prov['compiled'] or [])}")
    else:
        lines.append("provenance: none" if not prov else f"provenance: {prov['error']}")
    return lines


def register(group: click.Group) -> None:
    for cmd in (sign_, push, pull):
        group.add_command(cmd)
