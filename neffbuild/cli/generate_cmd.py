"""``neffbuild generate``: the reference harness that accepts a bundle before it ships.

Per-layer prefill (eager) into the KV cache, then greedy decode through the bundle's
artifacts, one dispatch per step (the loop: neffbuild/serve/greedy.py). ``decode_seconds`` is
the wall time of the decode steps only; ``tokens_per_second`` = decode-step tokens / it. ``--dp N`` runs N ranks as N processes over gloo with
the prompts split across them (``prompts[r::N]``); a rank without work runs dummy steps
at the synced bucket. ``--check`` also runs the eager graph and fails on any mismatch.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import click

from neffbuild.errors import InvalidInput, NeffbuildError


def _parse_prompt(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise InvalidInput(f"--prompt-ids {text!r}: must be comma-separated token ids, e.g. 1,2,3") from None
    if not ids:
        raise InvalidInput("--prompt-ids: empty prompt")
    return ids


def run_rank(bundle_path: str, prompts: list[list[int]], max_new_tokens: int, *, group=None, reference=False):
    """Greedy tokens, the step log and decode timing for this rank's prompts (bundle artifacts, or eager)."""
    from neffbuild.runtime import dp_sync
    from neffbuild.runtime.bundle import open_bundle
    from neffbuild.serve.greedy import greedy, prometheus
    from neffbuild.serve.session import open_session

    bundle = open_bundle(bundle_path)
    session = open_session(bundle, reference=reference, group=group)
    vocab = session.config.vocab_size
    bad = [t for p in prompts for t in p if not 0 <= t < vocab]
    if bad:
        raise InvalidInput(f"--prompt-ids: token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    longest = max((len(p) for p in prompts), default=0)
    if longest + max_new_tokens > bundle.spec.max_model_len:
        raise InvalidInput(f"prompt of {longest} tokens + {max_new_tokens} new tokens exceeds the bundle's "
                           f"max_model_len {bundle.spec.max_model_len}")
    if not reference:
        for label in bundle.labels:  # load every artifact now: decode_seconds must not include loading
            bundle.artifact(label)
    before = dp_sync.COLLECTIVES["count"]
    gen = greedy(session.stepper, session.prefill, session.block_manager(), prompts, max_new_tokens)
    return {"tokens": gen.tokens, "steps": [s.to_json() for s in gen.plans],
            "collectives": dp_sync.COLLECTIVES["count"] - before, "metrics": prometheus(gen.plans),
            "decode_seconds": gen.decode_seconds, "decode_tokens": gen.decode_tokens}


def _speed(seconds: float, tokens: int) -> dict:
    return {"decode_seconds": round(seconds, 6), "tokens_per_second": round(tokens / seconds, 3) if seconds > 0 else 0.0}


def _dp_worker(rank: int, world: int, init_file: str, bundle_path: str, prompts, max_new_tokens: int, out_dir: str):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        res = run_rank(bundle_path, prompts[rank::world], max_new_tokens, group=dist.group.WORLD)
        res["rank"] = rank
    except NeffbuildError as exc:
        res = {"rank": rank, "error": str(exc)}
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))


def run_dp(bundle_path: str, prompts, max_new_tokens: int, dp: int) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="neffbuild-dp-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        mp.spawn(_dp_worker, args=(dp, init_file, bundle_path, prompts, max_new_tokens, tmp), nprocs=dp, join=True)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(dp)]
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        raise NeffbuildError("; ".join(errors))
    tokens = [None] * len(prompts)
    for r in ranks:
        for n, toks in enumerate(r["tokens"]):
            tokens[r["rank"] + n * dp] = toks
    # Ranks decode in lockstep: the slowest rank's decode time, every rank's tokens.
    speed = _speed(max(r["decode_seconds"] for r in ranks), sum(r["decode_tokens"] for r in ranks))
    return {"tokens": tokens, "steps": ranks[0]["steps"], **speed,
            "ranks": [{"rank": r["rank"], "steps": r["steps"], "collectives": r["collectives"],
                       "decode_seconds": r["decode_seconds"]} for r in ranks]}


@click.command("generate")
@click.argument("bundle_path", metavar="BUNDLE", type=click.Path(file_okay=False, exists=True))
@click.option("--prompt-ids", "prompt_ids", multiple=True, required=True,
              help="One prompt as comma-separated token ids; repeat for a batch (e.g. --prompt-ids 1,2,3 --prompt-ids 4,5).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=32, show_default=True,
              help="Greedy tokens to generate per prompt.")
@click.option("--dp", type=click.IntRange(min=1, max=8), default=1, show_default=True,
              help="Data-parallel ranks, run as processes over gloo; every step all ranks run the same artifact.")
@click.option("--check", is_flag=True, help="Also run the eager graph; exit 1 on any token mismatch.")
@click.option("--json", "as_json", is_flag=True,
              help='Print {"tokens", "steps", "decode_seconds", "tokens_per_second"[, "ranks", "check"]} on stdout.')
def generate(bundle_path, prompt_ids, max_new_tokens, dp, check, as_json):
    """Greedy-generate through BUNDLE's compiled artifacts (prefill runs eagerly).

    Each step picks the smallest compiled (batch, context) bucket that fits; the step log
    shows which artifact ran. Use --check in CI to accept a bundle before shipping it.
    """
    prompts = [_parse_prompt(p) for p in prompt_ids]
    if dp > 1:
        out = run_dp(bundle_path, prompts, max_new_tokens, dp)
    else:
        out = run_rank(bundle_path, prompts, max_new_tokens)
        out.pop("collectives")
        metrics = out.pop("metrics")
        out.update(_speed(out["decode_seconds"], out.pop("decode_tokens")))
        if not as_json:
            click.echo(metrics, err=True, nl=False)
    if check:
        ref = run_rank(bundle_path, prompts, max_new_tokens, reference=True)["tokens"]
        out["check"] = {"ok": ref == out["tokens"], "reference": ref}
    if as_json:
        click.echo(json.dumps(out))
    else:
        for n, toks in enumerate(out["tokens"]):
            click.echo(f"prompt {n}: {','.join(map(str, toks))}")
        click.echo(f"decode: {out['decode_seconds']:.3f} s, {out['tokens_per_second']:.1f} tokens/s "
                   f"(decode steps only: no loading, prefill or --check)")
        last = None
        for i, s in enumerate(out["steps"]):
            if s["label"] != last:
                click.echo(f"step {i}: {s['label']} (needed_seq {s['needed_seq']})", err=True)
                last = s["label"]
    if check and not out["check"]["ok"]:
        bad = [n for n, (a, b) in enumerate(zip(out["tokens"], out["check"]["reference"], strict=False)) if a != b]
        raise NeffbuildError(f"--check: tokens differ from the eager reference for prompts {bad}")
    if check and not as_json:
        click.echo("check: tokens equal the eager reference", err=True)


def register(group: click.Group) -> None:
    group.add_command(generate)

