"""The ``neffbuild`` entry point and the one place that maps errors to exit codes.

Exit codes: 0 success, 1 operation failed, 2 invalid input or usage. A user error never
prints a traceback; an unexpected exception does (it is a bug worth reporting).
"""

from __future__ import annotations

import logging
import sys

import click

from neffbuild import __version__, settings
from neffbuild.cli import output
from neffbuild.errors import NeffbuildError


class _Group(click.Group):
    def invoke(self, ctx):
        wants_json = "--json" in [*getattr(ctx, "_protected_args", []), *ctx.args]
        if wants_json:
            output.keep_native_output_off_stdout()  # UCX warnings and the like go to stderr, not into the JSON
        try:
            return super().invoke(ctx)
        except NeffbuildError as exc:
            _report(ctx, exc, exc.exit_code, wants_json)
        except click.exceptions.Exit:
            raise
        except click.ClickException as exc:  # usage errors: bad option, missing argument, bad path
            if not (wants_json or ctx.meta.get("json_errors")):
                raise
            _report(ctx, exc, exc.exit_code, True)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(130)


def _report(ctx, exc: Exception, code: int, wants_json: bool) -> None:
    """Every error: one line (or block) on stderr, and with --json one JSON document on stdout."""
    if (wants_json or ctx.meta.get("json_errors")) and not ctx.meta.get("json_printed"):
        click.echo(output.dumps(output.error_doc(exc, code)))
    message = exc.format_message() if isinstance(exc, click.ClickException) else str(exc)
    click.echo(f"error: {message}", err=True)
    ctx.exit(code)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="neffbuild")
def cli():
    """Compile LLM decode graphs ahead of time into a versioned bundle, and run them.

    \b
    Typical flow:
      neffbuild validate recipes/gpt-oss-tiny.yaml     # check the recipe, all errors at once
      neffbuild plan recipes/gpt-oss-tiny.yaml         # the grid of graphs it will compile
      neffbuild compile recipes/gpt-oss-tiny.yaml -o artifacts
      neffbuild inspect artifacts/gpt-oss-tiny-0.1.0   # what is in the bundle
      neffbuild generate artifacts/gpt-oss-tiny-0.1.0 --prompt-ids 1,2,3 --check
    """
    logging.basicConfig(level=settings.log_level(), stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")


def _register() -> None:
    import importlib

    for name in ("validate_cmd", "plan_cmd", "compile_cmd", "bundle_cmds", "cache_cmds", "generate_cmd",
                 "recommend_cmd", "bench_cmd", "ship_cmds"):
        importlib.import_module(f"neffbuild.cli.{name}").register(cli)


def main() -> None:
    _register()
    cli(prog_name="neffbuild")


if __name__ == "__main__":  # python -m neffbuild.cli.main
    main()
