"""``neffbuild recommend``: context buckets from a recorded needed_seq histogram."""

from __future__ import annotations

import json

import click

from neffbuild.errors import InvalidInput


def _constraints(recipe_path, max_model_len):
    """(Constraints, the recipe's current buckets or None) from --recipe and/or --max-model-len."""
    from neffbuild import recipe as recipe_mod
    from neffbuild.recommend import Constraints, constraints_for

    if recipe_path is None:
        if max_model_len is None:
            raise InvalidInput("pass --max-model-len N (the serving max_model_len) or --recipe RECIPE")
        return Constraints(max_model_len), None
    r = recipe_mod.load(recipe_path)
    if max_model_len is not None and max_model_len != r.max_model_len:
        raise InvalidInput(f"--max-model-len {max_model_len} disagrees with {recipe_path}'s serving.max_model_len "
                           f"{r.max_model_len}; drop one of them")
    return constraints_for(r), tuple(r.decode_context_length_buckets)


def _check_range(hist, path: str, max_model_len: int) -> None:
    above = [v for v, _ in hist.rows() if v > max_model_len]
    if above:
        raise InvalidInput(f"{path}: needed_seq {above[0]} is above max_model_len {max_model_len}"
                           f"{f' (and {len(above) - 1} more values)' if len(above) > 1 else ''}; "
                           "was the histogram recorded with another max_model_len?")


@click.command("recommend")
@click.option("--histogram", "histogram_paths", required=True, multiple=True, type=click.Path(dir_okay=False),
              help="CSV with header needed_seq,count (from `neffbuild generate --histogram` or the runtime's "
                   "NeededSeqHistogram.write_csv). Repeat to add several (replicas, days).")
@click.option("--max-model-len", type=click.IntRange(min=1), default=None,
              help="The serving max_model_len (the always-compiled fallback). Taken from --recipe when given.")
@click.option("--max-buckets", "max_buckets", type=click.IntRange(min=1, max=64), default=4, show_default=True,
              help="At most this many context buckets besides the fallback.")
@click.option("--recipe", "recipe_path", type=click.Path(dir_okay=False), default=None,
              help="Compare with this recipe's buckets, count its NEFFs, respect its bucket rules "
                   "(block_size, sliding-window width) and print the neuron_config snippet.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
def recommend(histogram_paths, max_model_len, max_buckets, recipe_path, as_json):
    """Recommend at most K context buckets that minimise the KV tokens read per decode step.

    A step that needs s tokens runs the smallest compiled bucket >= s (or max_model_len)
    and reads that many tokens of KV. The choice is exact (dynamic programming over the
    multiples of 128 that round up an observed needed_seq); the table shows k = 1..K so
    you can see where another bucket (and its NEFFs) stops paying.
    """
    from neffbuild.recommend import report
    from neffbuild.runtime.step.histogram import NeededSeqHistogram, read_csv

    con, current = _constraints(recipe_path, max_model_len)
    hist = NeededSeqHistogram()
    for path in histogram_paths:
        one = read_csv(path)
        _check_range(one, path, con.max_model_len)
        hist.merge(one)
    out = report(hist.rows(), con, max_buckets, current)
    if as_json:
        click.echo(json.dumps(out))
    else:
        _print(out, recipe_path)


def _print(out: dict, recipe_path) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(soft_wrap=True)
    table = Table(title=f"{out['steps']} decode steps, max_model_len {out['max_model_len']}")
    for col, just in (("k", "right"), ("buckets", "left"), ("KV tokens/step", "right"),
                      ("vs fallback", "right"), ("NEFFs", "right")):
        table.add_column(col, justify=just)
    fb = out["fallback_only_tokens_per_step"]
    table.add_row("0", "(fallback only)", f"{fb:.1f}", "1.00x", "")
    for row in out["table"]:
        table.add_row(str(row["k"]), str(row["buckets"]), f"{row['expected_tokens_per_step']:.1f}",
                      f"{fb / row['expected_tokens_per_step']:.2f}x", str(row["neffs"]))
    console.print(table)
    console.print(f"recommended: decode_context_length_buckets {out['buckets']}: "
                  f"{out['expected_tokens_per_step']:.1f} KV tokens/step, {out['fallback_vs_chosen']:.2f}x fewer than "
                  f"the fallback alone ({fb:.0f}), {out['neffs']} NEFFs")
    if "recipe_buckets" in out:
        console.print(f"{recipe_path} now: {out['recipe_buckets']}: {out['recipe_tokens_per_step']:.1f} KV tokens/step "
                      f"({out['recipe_vs_chosen']:.2f}x the recommendation), {out['recipe_neffs']} NEFFs")
        console.print("paste into the recipe (and vLLM's additional_config.neuron_config):")
        console.print(f"neuron_config:\n  decode_context_length_buckets: {out['buckets']}", highlight=False)
    else:
        console.print("NEFFs counted per num_seqs bucket and family; pass --recipe for the total and the snippet.")


def register(group: click.Group) -> None:
    group.add_command(recommend)
