"""``neffbuild generate``: the reference harness that accepts a bundle before it ships.

Parse, call the engine (``neffbuild.serve.result.generate``), print. Every mode is a choice
of the engine's parts: ``--di`` (KV from a prefill worker over NIXL), ``--spec`` (EAGLE3
drafts), ``--dp N`` / a sharded bundle (the world's ranks), in any mix. ``--requests FILE``
serves a JSON-lines request file with continuous batching; ``--prompt-ids`` prompts all
arrive at step 0. ``--check`` also runs the unsharded eager model and fails on a mismatch.
"""

from __future__ import annotations

import re

import click

from neffbuild.bundle.recipe_check import verify_fully
from neffbuild.cli import bundle_cmds, ship_cmds
from neffbuild.cli.output import dumps, error_doc, json_option, shorten
from neffbuild.errors import BundleError, InvalidInput, NeffbuildError
from neffbuild.fsutil import output_problem, write_output
from neffbuild.runtime.step.histogram import NeededSeqHistogram

PROMPT_RE = re.compile(r" *[0-9]{1,10} *(?:, *[0-9]{1,10} *)*")  # ASCII digits only: "1 2 3" is not "123"


def _parse_prompt(text: str) -> list[int]:
    if not PROMPT_RE.fullmatch(text):
        raise InvalidInput(f"--prompt-ids {shorten(repr(text), 80)}: must be comma-separated token ids "
                           "(ASCII digits), e.g. 1,2,3")
    return [int(x) for x in text.split(",")]


@click.command("generate")
@click.argument("bundle_path", metavar="BUNDLE", type=click.Path(file_okay=False, exists=True))
@click.option("--prompt-ids", "prompt_ids", multiple=True,
              help="One prompt as comma-separated token ids; repeat for a batch "
                   "(e.g. --prompt-ids 1,2,3 --prompt-ids 4,5). Every prompt arrives at step 0.")
@click.option("--requests", "requests_path", type=click.Path(dir_okay=False), default=None,
              help='A JSON-lines request file, one {"id", "prompt_ids", "max_new_tokens", "arrival"} per line '
                   "(arrival: the decode step it may join at, default 0), served with continuous batching.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=32, show_default=True,
              help="Greedy tokens to generate per prompt (a request file's default).")
@click.option("--dp", type=click.IntRange(min=1, max=8), default=None,
              help="Data-parallel ranks, run as processes over gloo; each owns every dp-th request. "
                   "Default: the bundle's dp (a sharded bundle always runs its own tp x dp ranks).")
@click.option("--di", is_flag=True,
              help="Disaggregated inference: prefill runs in a second process (eager, its own KV cache), the KV "
                   "moves over NIXL into every decode rank, whose first step runs the last prompt token. "
                   "Needs the nixl extra.")
@click.option("--prefill-tp", "prefill_tp", type=click.IntRange(min=1, max=8), default=None,
              help="With --di: run the prefill worker as P ranks, each holding kv_heads / P KV heads; every decode "
                   "rank pulls its heads from the prefill rank(s) that hold them. Default: the bundle's tp.")
@click.option("--spec", is_flag=True,
              help="EAGLE3 speculative decoding through the bundle's three families (greedy, lossless: the tokens "
                   "of a plain run); each step verifies the draft's k tokens or, without room or drafts, runs one.")
@click.option("--check", is_flag=True, help="Also run the unsharded eager model; exit 1 on any token mismatch.")
@click.option("--metrics", is_flag=True,
              help="Print the run's Prometheus metrics (executions per bucket, padding, needed_seq histogram) "
                   "on stderr (under --json: as the \"metrics\" field).")
@click.option("--histogram", "histogram_path", type=click.Path(dir_okay=False), default=None,
              help="Write the needed_seq of every decode step as CSV (needed_seq,count), "
                   "the input of `neffbuild recommend`.")
@ship_cmds.trust_option("Refuse BUNDLE unless its signature by this public key covers every file (checked "
                        "before anything of the bundle is loaded).")
@json_option('Print {"tokens", "requests", "steps", "decode_seconds", "tokens_per_second"[, "ranks", "transfers", '
             '"check"]} on stdout (errors too); --spec adds "acceptance_rate".')
def generate(bundle_path, prompt_ids, requests_path, max_new_tokens, dp, di, prefill_tp, spec, check, metrics,
             histogram_path, trust, as_json):
    """Greedy-generate through BUNDLE's compiled artifacts (prefill runs eagerly).

    Each step picks the smallest compiled (batch, context) bucket that covers the live
    batch; requests join at their arrival step and leave at their own max_new_tokens.
    Use --check in CI to accept a bundle before shipping it.
    """
    ship_cmds.require_signature(bundle_path, trust)  # before any file of the bundle is read
    from neffbuild.serve import requests as reqs_mod
    from neffbuild.serve.result import check_against_reference
    from neffbuild.serve.result import generate as run
    from neffbuild.serve.run import Options

    if histogram_path and output_problem(histogram_path, "--histogram"):  # refused before any work, exit 2
        raise InvalidInput(output_problem(histogram_path, "--histogram"))
    if check:  # --check accepts a bundle: every sha256 and recipe.yaml first, not the size-only open
        verify_fully(bundle_path)
    facts = _refuse_nonfinite(bundle_path)  # the bundle's facts, read once for the run below

    if bool(prompt_ids) == bool(requests_path):
        raise InvalidInput("give the prompts as --prompt-ids ... or as --requests FILE.jsonl (one of them)")
    if requests_path:
        requests = reqs_mod.load_requests(requests_path, max_new_tokens)
    else:
        requests = reqs_mod.from_prompts([_parse_prompt(p) for p in prompt_ids], max_new_tokens)
    what = f"--requests {requests_path}" if requests_path else "--prompt-ids"
    if prefill_tp is not None and not di:
        raise InvalidInput("--prefill-tp sizes the DI prefill worker; add --di or drop it")
    opts = Options(spec=spec, di=di, dp=dp, metrics=metrics, prefill_tp=prefill_tp, requests_flag=what)
    res = run(bundle_path, requests, opts, facts)
    if histogram_path:
        _write_histogram(histogram_path, res.histogram)
    if check:
        res.check = check_against_reference(bundle_path, requests, res.tokens)
    failed = _check_failure(res.check) if check else None
    if as_json:  # one document, the failure's error in it (main.py then prints no second one)
        click.echo(dumps(res.to_json() | (error_doc(failed, failed.exit_code) if failed else {})))
        click.get_current_context().meta["json_printed"] = failed is not None
    else:
        _print(res, requests, spec)
        if check:
            _print_check(res.check, failed)
    if failed:
        raise failed


def _refuse_nonfinite(bundle_path: str):
    """NaN or infinite weights: refused as ``verify`` refuses them (its check, one pass over the weights), not
    served as a run of token 0. A bundle that is broken otherwise is left to the open, which names the problem.
    Returns the bundle's facts (None: broken)."""
    from pathlib import Path

    from neffbuild.runtime.bundle import reader

    facts = reader.read_facts(bundle_path, strict=False)
    if facts is None:
        return None
    bad = bundle_cmds.nonfinite_weights(Path(bundle_path))
    if bad:
        raise BundleError(f"{bundle_path}: " + "; ".join(map(str, bad)) + " (`neffbuild verify` refuses it too)")
    return facts


def _check_failure(verdict: dict) -> NeffbuildError | None:
    from neffbuild.serve.check import describe

    if verdict["ok"]:
        return None
    lines = [describe(v) for v in verdict["differences"] if not v["near_tie"]]
    return NeffbuildError("--check: tokens differ from the eager reference (" + verdict["precision"] +
                          " rule, serve/check.py): " + "; ".join(lines))


def _print_check(verdict: dict, failed) -> None:
    from neffbuild.serve.check import describe

    for v in verdict["differences"]:
        if v["near_tie"]:
            click.echo(f"check: {describe(v)}", err=True)
    if not failed:
        ties = sum(v["near_tie"] for v in verdict["differences"])
        click.echo("check: tokens equal the eager reference" + (f" (up to {ties} near-tie(s) within the "
                   f"{verdict['precision']} tolerance)" if ties else ""), err=True)


def _print(res, requests, spec: bool) -> None:
    for r, toks in zip(requests, res.tokens, strict=True):
        click.echo(f"prompt {r.id}: {','.join(map(str, toks))}")
    click.echo(f"decode: {res.decode_seconds:.3f} s, {res.tokens_per_second:.1f} tokens/s "
               f"(decode steps after the first; no loading, prefill or --check)")
    for t in res.transfers:
        click.echo(f"request {t['id']}: pulled KV of {t['kv_len']} tokens ({t['blocks']} blocks, {t['bytes']} bytes) "
                   f"in {t['pull_seconds'] * 1e3:.1f} ms{' (sliding-window N-1 rule)' if t['truncated'] else ''}",
                   err=True)
    last = None
    for i, s in enumerate(res.steps):
        if s["label"] != last:
            click.echo(f"step {i}: {s['label']} (needed_seq {s['needed_seq']}, {s['num_reqs']} requests)", err=True)
            last = s["label"]
    if spec:
        click.echo(f"acceptance rate: {res.acceptance_rate:.3f} over {len(res.steps)} target steps", err=True)
    if res.metrics:
        click.echo(res.metrics, err=True, nl=False)


def _write_histogram(path: str, rows) -> None:
    write_output(path, NeededSeqHistogram(counts=rows).to_csv(), "--histogram")  # in place, only what we own
    click.echo(f"histogram: {path} ({sum(n for _, n in rows)} decode steps)", err=True)


def register(group: click.Group) -> None:
    group.add_command(generate)

