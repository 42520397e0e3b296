"""``neffbuild generate``: the reference harness that accepts a bundle before it ships.

Per-layer prefill (eager) into the KV cache, then greedy decode through the bundle's
artifacts, one dispatch per step (the loop: neffbuild/serve/greedy.py). ``decode_seconds`` is
the wall time of the decode steps only; ``tokens_per_second`` = decode-step tokens / it.
``--dp N`` runs N ranks as N processes over gloo with the prompts split across them
(``prompts[r::N]``); a rank without work runs dummy steps at the synced bucket. A sharded
bundle (tp or ep above 1) always runs its own tp x dp ranks, the prompts dealt to its DP
groups. ``--check`` also runs the unsharded eager model (a sharded bundle's weight pieces
joined) and fails on any mismatch.
``--di`` runs disaggregated inference: a prefill worker process and this decode process, the
KV moved over NIXL (neffbuild/serve/di.py). ``--spec`` runs EAGLE3 speculative greedy decoding
(neffbuild/serve/spec.py); its tokens equal a plain run's.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

import click

from neffbuild.cli import ship_cmds
from neffbuild.cli.output import dumps, json_option, shorten
from neffbuild.errors import BundleError, InvalidInput, NeffbuildError
from neffbuild.runtime.histogram import NeededSeqHistogram

PROMPT_RE = re.compile(r" *[0-9]{1,10} *(?:, *[0-9]{1,10} *)*")  # ASCII digits only: "1 2 3" is not "123"


def _parse_prompt(text: str) -> list[int]:
    if not PROMPT_RE.fullmatch(text):
        raise InvalidInput(f"--prompt-ids {shorten(repr(text), 80)}: must be comma-separated token ids "
                           "(ASCII digits), e.g. 1,2,3")
    return [int(x) for x in text.split(",")]


def check_prompts(gi: dict, prompts: list[list[int]], max_new_tokens: int) -> None:
    """The user's prompts against a bundle whose manifest already passed the schema (exit 2 when they do not fit)."""
    _check_prompts(prompts, max_new_tokens, _config(gi).vocab_size, gi["max_model_len"])


def check_bundle(bundle) -> None:
    """The manifest's model_config is valid and describes the weights the artifacts bind (else exit 1)."""
    from neffbuild import registry

    gi = bundle.manifest["graph_inputs"]
    cfg = _config(gi)
    for name, shape in registry.arch(gi["arch"]).get("rank_shapes")(cfg, bundle.parallel).items():
        have = tuple(bundle.weights[name].shape) if name in bundle.weights else None
        if have != tuple(shape):
            raise BundleError(f"graph_inputs.model_config implies weight {name!r} of shape {list(shape)}, the bundle's "
                              f"weights hold {list(have) if have else 'none'}: the manifest and weights disagree")


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
    check_bundle(bundle)
    hist = NeededSeqHistogram(bundle.grid.max_model_len)
    session = open_session(bundle, on_plan=lambda plan: hist.record(plan.needed_seq))
    _check_prompts(prompts, max_new_tokens, session.config.vocab_size, bundle.grid.max_model_len)
    for label in bundle.labels:  # load every artifact now: decode_seconds must not include loading
        bundle.artifact(label)
    with PrefillWorker(bundle_path) as worker:
        gen = generate_di(session, worker.port, prompts, max_new_tokens)
    return {"tokens": gen.tokens, "steps": [s.to_json() for s in gen.plans],
            "metrics": prometheus(gen.plans) + hist.to_prometheus(), "histogram": hist.rows(),
            "decode_seconds": gen.decode_seconds, "decode_tokens": gen.decode_tokens, "transfers": gen.transfers}


def run_rank(bundle_path: str, prompts: list[list[int]], max_new_tokens: int, *, group=None, reference=False,
             spec=False):
    """Greedy tokens, the step log and decode timing for this rank's prompts (bundle artifacts, or eager;
    ``spec``: EAGLE3 speculative decoding through the bundle's three families)."""
    from neffbuild.runtime import dp_sync
    from neffbuild.runtime.bundle import open_bundle
    from neffbuild.serve.greedy import greedy, prometheus
    from neffbuild.serve.session import open_session

    bundle = open_bundle(bundle_path, group=group)  # a sharded bundle joins the world here (every rank opens it)
    check_bundle(bundle)
    hist = NeededSeqHistogram(bundle.grid.max_model_len)
    session = open_session(bundle, reference=reference, group=group,
                           on_plan=lambda plan: hist.record(plan.needed_seq))
    _check_prompts(prompts, max_new_tokens, session.config.vocab_size, bundle.grid.max_model_len)
    if not reference:
        for label in bundle.labels:  # load every artifact now: decode_seconds must not include loading
            bundle.artifact(label)
    before = dp_sync.COLLECTIVES["count"]
    if spec:
        return dict(_run_spec(bundle, session, prompts, max_new_tokens, before), histogram=hist.rows())
    gen = greedy(session.stepper, session.prefill, session.block_manager(), prompts, max_new_tokens,
                 lockstep_group=session.lockstep_group)
    return {"tokens": gen.tokens, "steps": [s.to_json() for s in gen.plans],
            "collectives": dp_sync.COLLECTIVES["count"] - before,
            "metrics": prometheus(gen.plans) + hist.to_prometheus(),
            "decode_seconds": gen.decode_seconds, "decode_tokens": gen.decode_tokens, "histogram": hist.rows()}


def _run_spec(bundle, session, prompts, max_new_tokens: int, collectives_before: int) -> dict:
    from neffbuild.models.eagle3.config import Eagle3Config
    from neffbuild.runtime import dp_sync
    from neffbuild.serve.greedy import prometheus
    from neffbuild.serve.spec import SpecLoop

    gi = bundle.manifest["graph_inputs"]
    if not bundle.grid.num_speculative_tokens or "draft_config" not in gi:
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


def run_reference(bundle_path: str, prompts, max_new_tokens: int) -> list[list[int]]:
    """Greedy tokens of the UNSHARDED eager model on the bundle's weights (a sharded bundle's pieces joined).

    Runs in this one process, without opening the bundle for serving (a sharded bundle needs its world).
    """
    from neffbuild import registry
    from neffbuild.runtime import bundle as reader
    from neffbuild.runtime import weights_file
    from neffbuild.runtime.dispatch import GridSpec
    from neffbuild.runtime.kv_cache import KVLayout
    from neffbuild.runtime.parallel import ParallelLayout
    from neffbuild.serve.greedy import greedy
    from neffbuild.serve.session import eager_artifacts, make_session

    root = Path(bundle_path)
    m = reader.read_manifest(root)
    gi = m["graph_inputs"]
    cfg = _config(gi)
    _check_prompts(prompts, max_new_tokens, cfg.vocab_size, gi["max_model_len"])
    weights = weights_file.load(reader.safe_path(root, m["weights"]["file"]), m["weights"]["tensors"])
    if "parallel" in m:
        parts = {name: weights_file.load(reader.safe_path(root, e["file"]), e["tensors"])
                 for name, e in m["parallel"]["pieces"].items()}
        unshard = registry.arch(gi["arch"]).get("unshard")
        weights = unshard(cfg, dict(parts, shared=weights), ParallelLayout.from_json(m["parallel"]))
    kv = gi["kv_layout"]
    _, nb, _, bs, d = kv["buffer_shape"]
    layout = KVLayout(kv["num_buffers"], nb, cfg.num_key_value_heads, bs, d, fp8=kv["dtype"].startswith("float8"),
                      packed_k=kv["packed_k"])  # every KV head: the unsharded model
    spec = GridSpec(tuple(gi["num_seqs_buckets"]), tuple(gi["decode_context_length_buckets"]), gi["max_model_len"],
                    gi["num_speculative_tokens"])
    session = make_session(cfg, weights, eager_artifacts(cfg, weights, spec, layout, gi["num_swa"]))
    return greedy(session.stepper, session.prefill, session.block_manager(), prompts, max_new_tokens).tokens


def _speed(seconds: float, tokens: int) -> dict:
    rate = round(tokens / seconds, 3) if seconds > 0 else 0.0
    return {"decode_seconds": round(seconds, 6), "tokens_per_second": rate}


def _config(gi: dict):
    """The bundle's model config, checked with the recipe's rules (a broken bundle: exit 1, not the user's input)."""
    from neffbuild.errors import RecipeError
    from neffbuild.recipe.validator import Validator

    v = Validator(Path.cwd(), "graph_inputs.model_config")
    hf = gi["model_config"]
    cfg = v.arch_config(hf, "graph_inputs.model_config", gi["arch"]) if isinstance(hf, dict) else None
    if cfg is None or v.problems:
        raise BundleError(str(RecipeError("manifest graph_inputs.model_config", v.problems or [])))
    return cfg


def _rank_worker(rank: int, world: int, dp: int, init_file: str, bundle_path: str, prompts, max_new_tokens: int,
                 out_dir: str, spec: bool = False):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    dp_rank = rank // (world // dp)  # the ranks of one DP group are consecutive (runtime/parallel.py)
    try:
        res = run_rank(bundle_path, prompts[dp_rank::dp], max_new_tokens, group=dist.group.WORLD, spec=spec)
        res.update(rank=rank, dp_rank=dp_rank)
    except NeffbuildError as exc:  # the real cause: written before the peers see a closed connection
        res = {"rank": rank, "error": str(exc), "exit_code": exc.exit_code, "cause": True}
    except Exception as exc:
        res = {"rank": rank, "error": f"{type(exc).__name__}: {str(exc)[:300]}", "exit_code": 1, "cause": False}
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(dumps(res))


def run_world(bundle_path: str, prompts, max_new_tokens: int, world: int, dp: int, spec: bool = False) -> dict:
    """``world`` gloo processes in ``dp`` DP groups of world/dp ranks; prompts dealt to DP groups (``[g::dp]``)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="neffbuild-ranks-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        try:
            mp.spawn(_rank_worker, args=(world, dp, init_file, bundle_path, prompts, max_new_tokens, tmp, spec),
                     nprocs=world, join=True)
        except mp.ProcessRaisedException:
            pass  # every rank writes its outcome; the cause is read below
        except mp.ProcessExitedException as exc:
            raise NeffbuildError(f"{world} ranks: a rank died ({exc}); no result") from None
        files = [Path(tmp, f"rank{r}.json") for r in range(world)]
        ranks = [json.loads(f.read_text()) for f in files if f.is_file()]
    causes = [r for r in ranks if r.get("cause")] or [r for r in ranks if "error" in r]
    if causes or len(ranks) < world:
        first = causes[0] if causes else {"rank": "?", "error": "a rank wrote no result", "exit_code": 1}
        err = (InvalidInput if first.get("exit_code") == 2 else NeffbuildError)(
            f"rank {first['rank']}: {first['error']}")
        raise err
    tokens = [None] * len(prompts)
    for r in ranks:
        for n, toks in enumerate(r["tokens"]):
            if tokens[r["dp_rank"] + n * dp] not in (None, toks):
                raise NeffbuildError(f"rank {r['rank']}: tokens differ from another TP rank of DP group {r['dp_rank']}")
            tokens[r["dp_rank"] + n * dp] = toks
    # Ranks decode in lockstep: the slowest rank's decode time, every DP group's tokens once.
    first = [r for r in ranks if r["rank"] % (world // dp) == 0]
    speed = _speed(max(r["decode_seconds"] for r in ranks), sum(r["decode_tokens"] for r in first))
    # Every rank records the synced needed_seq, so rank 0's histogram is the run's.
    out = {"tokens": tokens, "steps": ranks[0]["steps"], **speed, "histogram": ranks[0].get("histogram", []),
           "ranks": [{"rank": r["rank"], "dp_rank": r["dp_rank"], "steps": r["steps"], "collectives": r["collectives"],
                      "decode_seconds": r["decode_seconds"]} for r in ranks]}
    if spec:
        proposed = sum(r["proposed"] for r in first)
        out["acceptance_rate"] = round(sum(r["accepted"] for r in first) / proposed, 6) if proposed else 0.0
        for o, r in zip(out["ranks"], ranks, strict=True):
            o.update(draft_calls=r["draft_calls"], acceptance_rate=r["acceptance_rate"])
    return out


MAX_LOCAL_WORLD = 16


def world_for(bundle_path: str, dp_flag: int | None) -> tuple[int, int]:
    """(world size, dp) to run: a sharded bundle's own tp x dp; else --dp (default: the recipe's dp)."""
    from neffbuild.runtime.bundle import read_manifest

    m = read_manifest(Path(bundle_path))
    par = m.get("parallel")
    if par is None:  # unsharded: the same graph serves any number of DP ranks
        dp = dp_flag or int(m["graph_inputs"].get("dp", 1))
        return dp, dp
    world, dp = int(par["world_size"]), int(par["dp"])
    if dp_flag not in (None, dp):
        raise InvalidInput(f"--dp {dp_flag}: this bundle was compiled for dp {dp} (tp {par['tp']}, ep {par['ep']}); "
                           "drop --dp or rebuild with parallel.dp set")
    if world > MAX_LOCAL_WORLD:
        raise InvalidInput(f"the bundle needs {world} ranks; generate runs every rank on this host (at most "
                           f"{MAX_LOCAL_WORLD}); serve it with the runtime API on a cluster instead")
    return world, dp


@click.command("generate")
@click.argument("bundle_path", metavar="BUNDLE", type=click.Path(file_okay=False, exists=True))
@click.option("--prompt-ids", "prompt_ids", multiple=True, required=True,
              help="One prompt as comma-separated token ids; repeat for a batch "
                   "(e.g. --prompt-ids 1,2,3 --prompt-ids 4,5).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=32, show_default=True,
              help="Greedy tokens to generate per prompt.")
@click.option("--dp", type=click.IntRange(min=1, max=8), default=None,
              help="Data-parallel ranks, run as processes over gloo; every step all ranks run the same artifact. "
                   "Default: the bundle's dp (a sharded bundle always runs its own tp x dp ranks).")
@click.option("--di", is_flag=True,
              help="Disaggregated inference: prefill runs in a second process (eager, its own KV cache), the KV "
                   "moves over NIXL into this process, which runs every decode step (the first one recomputes the "
                   "last prompt token). Needs the nixl extra.")
@click.option("--spec", is_flag=True,
              help="EAGLE3 speculative decoding through the bundle's three families (greedy, lossless: the tokens "
                   "of a plain run); each step verifies the draft's k tokens or, without room or drafts, runs one.")
@click.option("--check", is_flag=True, help="Also run the unsharded eager model; exit 1 on any token mismatch.")
@click.option("--histogram", "histogram_path", type=click.Path(dir_okay=False), default=None,
              help="Write the needed_seq of every decode step as CSV (needed_seq,count), "
                   "the input of `neffbuild recommend`.")
@ship_cmds.trust_option("Refuse BUNDLE unless its signature by this public key covers every file (checked "
                        "before anything of the bundle is loaded).")
@json_option('Print {"tokens", "steps", "decode_seconds", "tokens_per_second"[, "ranks", "transfers", "check"]} '
             'on stdout (errors too); --spec adds "acceptance_rate" and each step\'s "family".')
def generate(bundle_path, prompt_ids, max_new_tokens, dp, di, spec, check, histogram_path, trust, as_json):
    """Greedy-generate through BUNDLE's compiled artifacts (prefill runs eagerly).

    Each step picks the smallest compiled (batch, context) bucket that fits; the step log
    shows which artifact ran. Use --check in CI to accept a bundle before shipping it.
    With --di the tokens must equal those of a plain run (same bundle, same prompts).
    """
    ship_cmds.require_signature(bundle_path, trust)  # before any file of the bundle is read
    prompts = [_parse_prompt(p) for p in prompt_ids]
    if di and (dp or 1) > 1:
        raise InvalidInput("--di runs one decode process; use it without --dp")
    if di and spec:
        raise InvalidInput("--spec with --di is not supported yet; use one of them")
    world, dp = (1, 1) if di else world_for(bundle_path, dp)
    if world > 1:
        from neffbuild.runtime.bundle import read_manifest
        from neffbuild.runtime.manifest_schema import problems

        m = read_manifest(Path(bundle_path))  # the prompts are the user's: refuse them before any rank starts
        if not problems(m):
            check_prompts(m["graph_inputs"], prompts, max_new_tokens)
        out = run_world(bundle_path, prompts, max_new_tokens, world, dp, spec)
    else:
        out = (run_di_rank(bundle_path, prompts, max_new_tokens) if di
               else run_rank(bundle_path, prompts, max_new_tokens, spec=spec))
        out.pop("collectives", None)
        metrics = out.pop("metrics")
        out.update(_speed(out["decode_seconds"], out.pop("decode_tokens")))
        if not as_json:
            click.echo(metrics, err=True, nl=False)
    rows = out.pop("histogram", [])
    if histogram_path:
        _write_histogram(histogram_path, rows)
    if check:
        ref = run_reference(bundle_path, prompts, max_new_tokens)
        out["check"] = {"ok": ref == out["tokens"], "reference": ref}
    if as_json:
        click.echo(dumps(out))
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


def _write_histogram(path: str, rows) -> None:
    try:
        NeededSeqHistogram(counts=rows).write_csv(path)
    except OSError as exc:
        raise InvalidInput(f"--histogram {path}: cannot write ({exc.strerror or exc})") from None
    click.echo(f"histogram: {path} ({sum(n for _, n in rows)} decode steps)", err=True)


def register(group: click.Group) -> None:
    group.add_command(generate)

