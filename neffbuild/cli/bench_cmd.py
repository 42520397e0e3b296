"""``neffbuild bench``: decode step cost of a bundle, every variant side by side in one run."""

from __future__ import annotations

import json
from pathlib import Path

import click


def _render(result: dict) -> str:
    from neffbuild.bench.report import table

    lines = [(f"machine: {result['machine']}; copy bandwidth {result['copy_bandwidth_gbs']} GB/s; "
              f"num_blocks {result['num_blocks']}, max_model_len {result['max_model_len']}, "
              f"batch bucket {result['steps']['batch']}"), table(result)]
    if result["steps"]["dynamic_compile_s"] is not None:
        lines.append(f"dynamic-width artifact compiled in {result['steps']['dynamic_compile_s']:.1f} s")
    lines.append(f"plan + metadata per step: {result['plan']['plan_plus_metadata_us']} us")
    if "startup" in result:
        s = result["startup"]
        lines.append(f"cold start (open + first step, fresh process): {s['cold']['open_and_first_step_s']} s; "
                     f"compiling the same graph at start-up: {s['compile_at_startup']['compile_and_first_step_s']} s")
    if "dp" in result:
        lines.append(f"DP sync per step: {result['dp']['dp_sync_us']} us vs bare gloo all-reduce "
                     f"{result['dp']['bare_allreduce_us']} us (2 ranks on this host)")
    return "\n".join(lines)


@click.command("bench")
@click.argument("bundle_path", metavar="BUNDLE", type=click.Path(file_okay=False, exists=True))
@click.option("--json", "as_json", is_flag=True, help="Print the whole result as one JSON document on stdout.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Write step time vs context as a PNG.")
@click.option("--repeat", default=20, show_default=True, type=click.IntRange(3),
              help="Timed steps per variant and context.")
@click.option("--threads", default=1, show_default=True, type=click.IntRange(1), help="torch threads for the steps.")
@click.option("--context", "extra_contexts", multiple=True, type=click.IntRange(1),
              help="Also measure at this context (tokens needed); repeatable.")
@click.option("--no-dynamic", is_flag=True, help="Skip the dynamic-width variant (it compiles an artifact: ~1 min).")
@click.option("--no-startup", is_flag=True,
              help="Skip cold start vs compile at start-up (compiles in a fresh process).")
@click.option("--no-dp", is_flag=True, help="Skip DP sync vs a bare gloo all-reduce (starts 2 processes).")
def bench(bundle_path, as_json, plot_path, repeat, threads, extra_contexts, no_dynamic, no_startup, no_dp):
    """Measure what a decode step of BUNDLE costs, side by side in one run.

    \b
    For one request at 1/32, 1/8, 1/2 and all of max_model_len: step time (median, p90) of
    the bucketed artifact the runtime picks, the fallback, a dynamic-width artifact and eager
    PyTorch; the bytes each step must read over the copy bandwidth measured in the same run
    (the fraction of the bound reached); cold start vs compiling at start-up; plan + metadata
    per step; DP sync vs a bare gloo all-reduce. Progress goes to stderr.
    """
    import torch

    from neffbuild.bench.run import run

    _refuse_before_running(bundle_path, plot_path, extra_contexts)

    torch.set_num_threads(threads)
    result = run(bundle_path, repeat=repeat, dynamic=not no_dynamic, startup=not no_startup, dp=not no_dp,
                 extra_contexts=tuple(extra_contexts), progress=lambda msg: click.echo(f"bench: {msg}", err=True))
    if plot_path:
        from neffbuild.bench.report import plot

        result["plot"] = str(plot(result, plot_path, f"{Path(bundle_path).name}\n{result['machine']}"))
    click.echo(json.dumps(result, sort_keys=True) if as_json else _render(result))


def _refuse_before_running(bundle_path, plot_path, extra_contexts) -> None:
    """Invalid input is exit 2 before minutes of timing: an unusable --plot path, a --context above
    max_model_len, an EAGLE3 bundle (bench times the decode family; its artifacts take drafts)."""
    from neffbuild.errors import InvalidInput
    from neffbuild.fsutil import output_problem
    from neffbuild.runtime.bundle.reader import read_manifest

    if plot_path and output_problem(plot_path, "--plot"):
        raise InvalidInput(output_problem(plot_path, "--plot"))
    gi = read_manifest(Path(bundle_path)).get("graph_inputs")
    if not isinstance(gi, dict):
        return  # run() opens the bundle and names what is wrong with it
    mml = gi.get("max_model_len")
    high = [c for c in extra_contexts if isinstance(mml, int) and c > mml]
    if high:
        raise InvalidInput(f"--context {high[0]}: above the bundle's max_model_len ({mml})")
    if gi.get("num_speculative_tokens"):
        raise InvalidInput(f"{bundle_path}: bench times the plain decode family; this EAGLE3 bundle has "
                           "target_spec / target_nospec / draft artifacts instead (bench a bundle built without "
                           "speculative:)")


def register(group: click.Group) -> None:
    group.add_command(bench)
