"""``neffbuild validate``: check a recipe and report every problem at once."""

from __future__ import annotations

import click

from neffbuild import recipe as recipe_mod
from neffbuild.cli import memory_view
from neffbuild.cli.output import echo_json, json_option
from neffbuild.recipe import parallel_rules


@click.command("validate")
@click.argument("recipe_path", metavar="RECIPE", type=click.Path(dir_okay=False))
@json_option("Print one JSON document {valid, errors, warnings} on stdout (errors too).")
@memory_view.device_memory_option("warns when serving.num_blocks would not fit.")
def validate(recipe_path, as_json, device_memory):
    """Validate RECIPE (YAML). Exit 0 when valid, 2 when not.

    Every problem is reported, each with its dotted path, the value and the rule.
    No compiler is needed: a recipe for the neuron backend validates on any machine.
    """
    r = recipe_mod.load(recipe_path)  # a RecipeError is printed (as JSON with --json) by cli/main.py
    warning = memory_view.device_warning(r, device_memory)
    if warning:
        r = r.replace(warnings=(*r.warnings, warning))
    if as_json:
        echo_json({"valid": True, "errors": [], "warnings": list(r.warnings),
                   "parallel": parallel_rules.layout_json(r)})
    else:
        for w in r.warnings:
            click.echo(f"warning: {w}", err=True)
        click.echo(f"{recipe_path}: valid ({r.name} {r.version})")
        click.echo(parallel_rules.describe(r))


def register(group: click.Group) -> None:
    group.add_command(validate)
