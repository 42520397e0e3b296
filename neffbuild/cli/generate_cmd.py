"""``neffbuild generate``: the reference harness that accepts a bundle before it ships.

Per-layer prefill (eager) into the KV cache, then greedy decode through the bundle's
artifacts, one dispatch per step (the loop: neffbuild/serve/greedy.py). ``decode_seconds`` is
the wall time of the decode steps only; ``tokens_per_second`` = decode-step tokens / it.
``--dp N`` runs N ranks as N processes over gloo with the prompts split across them
(``prompts[r::N]``); a rank without work runs dummy steps at the synced bucket. ``--check``
also runs the eager graph and fails on any mismatch.
``--di`` runs disaggregated inference: a prefill worker process and this decode process, the
KV moved over NIXL (neffbuild/serve/di.py). ``--spec`` runs EAGLE3 speculative greedy decoding
(neffbuild/serve/spec.py); its tokens equal a plain run's.
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


def _check_prompts(prompts: list[list[int]], max_new_tokens: int, vocab: int, max_model_len: int) -> None:
    bad = [t for p in prompts for t in p if not 0 <= t < vocab]
    if bad:
        raise InvalidInput(f"--prompt-ids: token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    longest = max((len(p) for p in prompts), default=0)
    if longest + max_new_tokens > max_model_len:
        raise InvalidInput(f"prompt of {longest} tokens + {max_new_tokens} new tokens exceeds the bundle's "
                           f"max_model_len {max_model_len}")


def run_di_rank(bundle_path: str, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """``--di``: prefill in a worker process, KV over NIXL, decode here through the bundle's artifacts."""
    from neffbuild.runtime.bundle import open_bundle
    from neffbuild.runtime.kv_ingest import load_nixl
    from neffbuild.serve.di import PrefillWorker, generate_di
    from neffbuild.serve.greedy import prometheus
    from neffbuild.serve.session import open_session

    load_nixl()  # no NIXL: exit 1 naming the extra, before anything is loaded
    bundle = open_bundle(bundle_path)
    session = open_session(bundle)
    _check_prompts(prompts, max_new_tokens, session.config.vocab_size, bundle.spec.max_model_len)
    for label in bundle.labels:  # load every artifact now: decode_seconds must not include loading
        bundle.artifact(label)
    with PrefillWorker(bundle_path) as worker:
        gen = generate_di(session, worker.port, prompts, max_new_tokens)
    return {"tokens": gen.tokens, "steps": [s.to_json() for s in gen.plans], "metrics": prometheus(gen.plans),
            "decode_seconds": gen.decode_seconds, "decode_tokens": gen.decode_tokens, "transfers": gen.transfers}


def run_rank(bundle_path: str, prompts: list[list[int]], max_new_tokens: int, *, group=None, reference=False,
             spec=False):
    """Greedy tokens, the step log and decode timing for this rank's prompts (bundle artifacts, or eager;
    ``spec``: EAGLE3 speculative decoding through the bundle's three families)."""
    from neffbuild.runtime import dp_sync
    from neffbuild.runtime.bundle import open_bundle
    from neffbuild.serve.greedy import greedy, prometheus
    from neffbuild.serve.session import open_session

    bundle = open_bundle(bundle_path)
    session = open_session(bundle, reference=reference, group=group)
    _check_prompts(prompts, max_new_tokens, session.config.vocab_size, bundle.spec.max_model_len)
    if not reference:
        for label in bundle.labels:  # load every artifact now: decode_seconds must not include loading
            bundle.artifact(label)
    before = dp_sync.COLLECTIVES["count"]
    if spec:
        return _run_spec(bundle, session, prompts, max_new_tokens, before)
    gen = greedy(session.stepper, session.prefill, session.block_manager(), prompts, max_new_tokens)
    return {"tokens": gen.tokens, "steps": [s.to_json() for s in gen.plans],
            "collectives": dp_sync.COLLECTIVES["count"] - before, "metrics": prometheus(gen.plans),
            "decode_seconds": gen.decode_seconds, "decode_tokens": gen.decode_tokens}


def _run_spec(bundle, session, prompts, max_new_tokens: int, collectives_before: int) -> dict:
    from neffbuild.models.eagle3.config import Eagle3Config
    from neffbuild.runtime import dp_sync
    from neffbuild.serve.greedy import prometheus
    from neffbuild.serve.spec import SpecLoop

    gi = bundle.manifest["graph_inputs"]
    if not bundle.spec.num_speculative_tokens or "draft_config" not in gi:
        raise InvalidInput(f"--spec: bundle {bundle.root.name} was built without speculative decoding; drop --spec "
                           f"or build a recipe with a speculative: section")
    dcfg = Eagle3Config.from_hf_dict(gi["draft_config"], session.config)
    loop = SpecLoop(session.stepper, session.block_manager(), session.config, dcfg, bundle.weights)
    tokens = loop.generate(prompts, max_new_tokens)
    st = loop.stats
    return {"tokens": tokens, "steps": st.steps, "acceptance_rate": round(st.acceptance_rate, 6),
            "proposed": st.proposed, "accepted": st.accepted, "draft_calls": st.draft_calls,
            "collectives": dp_sync.COLLECTIVES["count"] - collectives_before, "metrics": prometheus(st.plans),
            "decode_seconds": st.decode_seconds, "decode_tokens": st.decode_tokens}


def _speed(seconds: float, tokens: int) -> dict:
    rate = round(tokens / seconds, 3) if seconds > 0 else 0.0
    return {"decode_seconds": round(seconds, 6), "tokens_per_second": rate}


def _dp_worker(rank: int, world: int, init_file: str, bundle_path: str, prompts, max_new_tokens: int, out_dir: str,
               spec: bool = False):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        res = run_rank(bundle_path, prompts[rank::world], max_new_tokens, group=dist.group.WORLD, spec=spec)
        res["rank"] = rank
    except NeffbuildError as exc:
        res = {"rank": rank, "error": str(exc)}
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))


def run_dp(bundle_path: str, prompts, max_new_tokens: int, dp: int, spec: bool = False) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="neffbuild-dp-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        mp.spawn(_dp_worker, args=(dp, init_file, bundle_path, prompts, max_new_tokens, tmp, spec), nprocs=dp,
                 join=True)
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
    out = {"tokens": tokens, "steps": ranks[0]["steps"], **speed,
           "ranks": [{"rank": r["rank"], "steps": r["steps"], "collectives": r["collectives"],
                      "decode_seconds": r["decode_seconds"]} for r in ranks]}
    if spec:
        proposed = sum(r["proposed"] for r in ranks)
        out["acceptance_rate"] = round(sum(r["accepted"] for r in ranks) / proposed, 6) if proposed else 0.0
        for o, r in zip(out["ranks"], ranks, strict=True):
            o.update(draft_calls=r["draft_calls"], acceptance_rate=r["acceptance_rate"])
    return out


@click.command("generate")
@click.argument("bundle_path", metavar="BUNDLE", type=click.Path(file_okay=False, exists=True))
@click.option("--prompt-ids", "prompt_ids", multiple=True, required=True,
              help="One prompt as comma-separated token ids; repeat for a batch "
                   "(e.g. --prompt-ids 1,2,3 --prompt-ids 4,5).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=32, show_default=True,
              help="Greedy tokens to generate per prompt.")
@click.option("--dp", type=click.IntRange(min=1, max=8), default=1, show_default=True,
              help="Data-parallel ranks, run as processes over gloo; every step all ranks run the same artifact.")
@click.option("--di", is_flag=True,
              help="Disaggregated inference: prefill runs in a second process (eager, its own KV cache), the KV "
                   "moves over NIXL into this process, which runs every decode step (the first one recomputes the "
                   "last prompt token). Needs the nixl extra.")
@click.option("--spec", is_flag=True,
              help="EAGLE3 speculative decoding through the bundle's three families (greedy, lossless: the tokens "
                   "of a plain run); each step verifies the draft's k tokens or, without room or drafts, runs one.")
@click.option("--check", is_flag=True, help="Also run the eager graph (plain greedy); exit 1 on any token mismatch.")
@click.option("--json", "as_json", is_flag=True,
              help='Print {"tokens", "steps", "decode_seconds", "tokens_per_second"[, "ranks", "transfers", "check"]} '
                   'on stdout; --spec adds "acceptance_rate" and each step\'s "family".')
def generate(bundle_path, prompt_ids, max_new_tokens, dp, di, spec, check, as_json):
    """Greedy-generate through BUNDLE's compiled artifacts (prefill runs eagerly).

    Each step picks the smallest compiled (batch, context) bucket that fits; the step log
    shows which artifact ran. Use --check in CI to accept a bundle before shipping it.
    With --di the tokens must equal those of a plain run (same bundle, same prompts).
    """
    prompts = [_parse_prompt(p) for p in prompt_ids]
    if di and dp > 1:
        raise InvalidInput("--di runs one decode process; use it without --dp")
    if di and spec:
        raise InvalidInput("--spec with --di is not supported yet; use one of them")
    if dp > 1:
        out = run_dp(bundle_path, prompts, max_new_tokens, dp, spec)
    else:
        out = (run_di_rank(bundle_path, prompts, max_new_tokens) if di
               else run_rank(bundle_path, prompts, max_new_tokens, spec=spec))
        out.pop("collectives", None)
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
        for n, t in enumerate(out.get("transfers", [])):
            click.echo(f"prompt {n}: pulled KV of {t['kv_len']} tokens ({t['blocks']} blocks, {t['bytes']} bytes) in "
                       f"{t['pull_seconds'] * 1e3:.1f} ms{' (sliding-window N-1 rule)' if t['truncated'] else ''}",
                       err=True)
        last = None
        for i, s in enumerate(out["steps"]):
            if s["label"] != last:
                click.echo(f"step {i}: {s['label']} (needed_seq {s['needed_seq']})", err=True)
                last = s["label"]
        if spec:
            click.echo(f"acceptance rate: {out['acceptance_rate']:.3f} over {len(out['steps'])} target steps", err=True)
    if check and not out["check"]["ok"]:
        bad = [n for n, (a, b) in enumerate(zip(out["tokens"], out["check"]["reference"], strict=False)) if a != b]
        raise NeffbuildError(f"--check: tokens differ from the eager reference for prompts {bad}")
    if check and not as_json:
        click.echo("check: tokens equal the eager reference", err=True)


def register(group: click.Group) -> None:
    group.add_command(generate)

