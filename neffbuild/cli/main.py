"""The ``neffbuild`` entry point and the one place that maps errors to exit codes.

Exit codes: 0 success, 1 operation failed, 2 invalid input or usage. A user error never
prints a traceback; an unexpected exception does (it is a bug worth reporting).
"""

from __future__ import annotations

import json
import logging
import sys

import click

from neffbuild import __version__, settings
from neffbuild.errors import NeffbuildError, RecipeError


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except RecipeError as exc:
            if ctx.meta.get("json_errors"):
                click.echo(json.dumps({"valid": False, "errors": [p.to_json() for p in exc.problems],
                                       "warnings": exc.warnings}, default=str))
            click.echo(f"error: {exc}", err=True)
            ctx.exit(exc.exit_code)
        except NeffbuildError as exc:
            click.echo(f"error: {exc}", err=True)
            ctx.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(130)


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

    for name in ("validate_cmd", "plan_cmd", "compile_cmd", "bundle_cmds", "cache_cmds", "generate_cmd", "bench_cmd"):
        importlib.import_module(f"neffbuild.cli.{name}").register(cli)


def main() -> None:
    _register()
    cli(prog_name="neffbuild")


if __name__ == "__main__":  # python -m neffbuild.cli.main
    main()
