"""``--device-memory`` for ``plan`` and ``validate``, and plan's memory section (neffbuild/memory.py,
compiler/memory_plan.py do the arithmetic; this module only wires options and output)."""

from __future__ import annotations

import click

from neffbuild import settings
from neffbuild.errors import InvalidInput


def _size(_ctx, _param, value):
    if value is None:
        return None
    try:
        return settings.parse_size(value, "--device-memory")
    except InvalidInput as exc:
        raise click.BadParameter(str(exc)) from None


def device_memory_option(what: str):
    return click.option("--device-memory", "device_memory", metavar="SIZE", default=None, callback=_size,
                        help=f"Device memory of one rank (e.g. 12GiB; binary units, G = GiB): {what}")


def plan_memory(recipe, targets, states: dict, device_memory: int | None) -> dict:
    """The ``memory`` document of ``plan --json``."""
    from neffbuild.compiler.memory_plan import plan_doc

    return plan_doc(recipe, targets, states, device_bytes=device_memory,
                    cache_root=recipe.cache_dir or settings.cache_dir())


def print_plan_memory(console, doc: dict, jobs: int) -> None:
    from neffbuild.compiler.memory_plan import describe

    for line in describe(doc, jobs):
        console.print(line, highlight=False, markup=False)


def device_warning(recipe, device_memory: int | None) -> str | None:
    """validate's warning when serving.num_blocks would not fit ``device_memory`` per rank."""
    if device_memory is None:
        return None
    from neffbuild import memory

    fit = memory.per_rank(recipe, device_memory)["device"]
    if fit["fits"]:
        return None
    return (f"serving.num_blocks: {recipe.num_blocks} blocks do not fit --device-memory "
            f"{memory.fmt_bytes(device_memory)} per rank (weights + KV = {memory.fmt_bytes(fit['needed_bytes'])}, "
            f"{memory.fmt_bytes(fit['usable_bytes'])} usable after the {memory.RESERVE_PERCENT}% reserve); "
            f"at most {fit['max_num_blocks']} fit (neffbuild plan --device-memory shows the arithmetic)")
