"""One rank's serving run: open the bundle, choose the parts, run the engine, report.

``serve_rank`` is what every rank runs, alone (one process) or inside a world
(serve/world.py): it opens the bundle (a sharded one collectively, artifacts preloaded so
no step pays for loading), picks the parts from ``Options`` (KV source: local prefill or
NIXL from the prefill worker on ``prefill``; proposer: none or EAGLE3) and runs one
``Engine`` over this rank's requests. Its answer is a plain dict (it crosses processes);
serve/result.py merges the ranks' answers into one ``GenerateResult``.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

from neffbuild.errors import InvalidInput
from neffbuild.runtime.step import dp_sync
from neffbuild.runtime.step.dispatch import StepPlan
from neffbuild.runtime.step.histogram import NeededSeqHistogram
from neffbuild.serve.di import NixlSource
from neffbuild.serve.engine import Engine
from neffbuild.serve.parts import LocalPrefill, Request
from neffbuild.serve.rank import ServingRank, open_rank
from neffbuild.serve.requests import check_requests
from neffbuild.serve.spec import Eagle3Proposer


@dataclass(frozen=True)
class Options:
    spec: bool = False  # EAGLE3 through the bundle's draft artifacts
    di: bool = False  # KV from a prefill worker over NIXL
    dp: int | None = None  # DP ranks for an unsharded bundle (default: the bundle's dp)
    metrics: bool = False  # Prometheus text in the result
    prefill_tp: int | None = None  # DI: ranks of the prefill group (default: the bundle's tp)
    requests_flag: str = "--prompt-ids"  # the flag the requests came from (error messages name it)


def _parts(session: ServingRank, opts: Options, prefill):
    proposer = None
    if opts.spec:
        dcfg = session.draft_config()
        if dcfg is None:
            raise InvalidInput(f"--spec: bundle {session.bundle.root.name} was built without speculative decoding; "
                               "drop --spec or build a recipe with a speculative: section")
        proposer = Eagle3Proposer(session.stepper, dcfg, session.weights, parallel=session.parallel, rank=session.rank)
    if opts.di:
        addresses, alive = prefill
        return NixlSource(session, addresses, alive=alive), proposer  # keys req-{file index}: unique over DP
    aux = proposer.aux_layers if proposer is not None else ()
    return LocalPrefill(session.prefill, session.stepper.kv_caches, lockstep_group=session.lockstep_group,
                        aux_layers=aux, proposer=proposer), proposer


def serve_rank(bundle_path: str, requests: list[Request], opts: Options, *, group=None, prefill=None) -> dict:
    """This rank's requests through the engine; a JSON-able dict (requests, steps, timing, counters).

    ``prefill``: with ``opts.di``, ``(addresses, alive)`` of the prefill group (``alive``: a
    liveness callable in the process that started it, else None).
    """
    session = open_rank(bundle_path, group=group)  # a sharded bundle joins the world here (every rank opens it)
    bundle = session.bundle
    hist = NeededSeqHistogram(bundle.grid.max_model_len)
    session.stepper.on_plan = lambda plan: hist.record(plan.needed_seq)
    check_requests(requests, session.config.vocab_size, bundle.grid.max_model_len, opts.requests_flag)
    for label in bundle.labels:  # load every artifact now: no decode step pays for loading
        bundle.artifact(label)
    source, proposer = _parts(session, opts, prefill)
    before = session.stepper.collectives
    try:
        engine = Engine(session.stepper, session.block_manager(), source, proposer, on_step=progress(requests, group))
        engine.run(requests)
    finally:
        source.close()
    st = engine.stats
    out = {"requests": [dict(r.result(), index=r.index) for r in requests], "steps": st.steps,
           "collectives": session.stepper.collectives - before, "step_seconds": st.step_seconds,
           "step_tokens": st.step_tokens, "run_seconds": st.run_seconds, "engine_seconds": st.engine_seconds,
           "source_seconds": st.source_seconds, "histogram": hist.rows(),
           "transfers": [dict(r.transfer, id=r.id) for r in requests if r.transfer is not None]}
    if proposer is not None:
        out.update(proposed=st.proposed, accepted=st.accepted, draft_calls=st.draft_calls,
                   acceptance_rate=round(st.acceptance_rate, 6))
    if opts.metrics:
        out["metrics"] = prometheus(st.plans) + hist.to_prometheus()
    return out


def prometheus(plans: Sequence[StepPlan]) -> str:
    """Executions per batch bucket and the batch padding ratio, Prometheus text format."""
    executions = Counter(f"decode_b{p.batch}" for p in plans)
    rows, padding = sum(p.batch for p in plans), sum(p.padding for p in plans)
    lines = ["# TYPE neffbuild_neff_execution_count counter"]
    lines += [f'neffbuild_neff_execution_count{{bucket="{k}"}} {v}' for k, v in sorted(executions.items())]
    ratio = padding / rows if rows else 0.0
    lines += ["# TYPE neffbuild_batch_padding_ratio gauge", f"neffbuild_batch_padding_ratio {ratio:.6f}"]
    return "\n".join(lines) + "\n"


PROGRESS_EVERY_S = 10.0


def progress(requests: list[Request], group=None, every_s: float = PROGRESS_EVERY_S):
    """An ``on_step`` hook that prints ``N/M requests done`` on stderr every ``every_s`` seconds of a long run
    (a short run prints nothing; one clock read per step otherwise)."""
    who = f"rank {dist_rank(group)}: " if dp_sync.world_size(group) > 1 else ""
    start = time.monotonic()
    state = {"next": start + every_s, "steps": 0}

    def on_step(plan, out) -> None:
        state["steps"] += 1
        now = time.monotonic()
        if now >= state["next"]:
            state["next"] = now + every_s
            done = sum(r.done for r in requests)
            print(f"{who}{done}/{len(requests)} requests done, {state['steps']} decode steps, "
                  f"{now - start:.0f} s", file=sys.stderr, flush=True)

    return on_step


def dist_rank(group) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0
