"""One rank's serving run: open the bundle, choose the parts, run the engine, report.

``serve_rank`` is what every rank runs, alone (one process) or inside a world
(serve/world.py): it opens the bundle (a sharded one collectively, artifacts preloaded so
no step pays for loading), picks the parts from ``Options`` (KV source: local prefill or
NIXL from the prefill worker on ``prefill``; proposer: none or EAGLE3) and runs one
``Engine`` over this rank's requests. Its answer is a plain dict (it crosses processes);
serve/result.py merges the ranks' answers into one ``GenerateResult``.
"""

from __future__ import annotations

from dataclasses import dataclass

from neffbuild.errors import BundleError, InvalidInput
from neffbuild.runtime.histogram import NeededSeqHistogram
from neffbuild.serve.parts import Request


@dataclass(frozen=True)
class Options:
    spec: bool = False  # EAGLE3 through the bundle's draft artifacts
    di: bool = False  # KV from a prefill worker over NIXL
    dp: int | None = None  # DP ranks for an unsharded bundle (default: the bundle's dp)
    metrics: bool = False  # Prometheus text in the result
    prefill_tp: int | None = None  # DI: ranks of the prefill group (default: the bundle's tp)
    source: str = "--prompt-ids"  # what the requests came from (error messages)


def model_config(gi: dict):
    """The bundle's model config, checked with the recipe's rules (a broken bundle: exit 1, not the user's input)."""
    from pathlib import Path

    from neffbuild.errors import RecipeError
    from neffbuild.recipe.validator import Validator

    v = Validator(Path.cwd(), "graph_inputs.model_config")
    hf = gi["model_config"]
    cfg = v.arch_config(hf, "graph_inputs.model_config", gi["arch"]) if isinstance(hf, dict) else None
    if cfg is None or v.problems:
        raise BundleError(str(RecipeError("manifest graph_inputs.model_config", v.problems or [])))
    return cfg


def check_bundle(bundle) -> None:
    """The manifest's model_config is valid and describes the weights the artifacts bind (else exit 1)."""
    from neffbuild import registry

    gi = bundle.manifest["graph_inputs"]
    cfg = model_config(gi)
    arch = registry.arch(gi["arch"])
    experts = arch.get("experts_of")(bundle.weights)  # dense or MXFP4: the stored names say which
    for name, shape in arch.get("rank_shapes")(cfg, bundle.parallel, experts).items():
        have = tuple(bundle.weights[name].shape) if name in bundle.weights else None
        if have != tuple(shape):
            raise BundleError(f"graph_inputs.model_config implies weight {name!r} of shape {list(shape)}, the bundle's "
                              f"weights hold {list(have) if have else 'none'}: the manifest and weights disagree")


def _parts(bundle, session, opts: Options, prefill):
    from neffbuild.serve.parts import LocalPrefill
    from neffbuild.serve.spec import Eagle3Proposer, draft_config

    proposer = None
    if opts.spec:
        dcfg = draft_config(bundle, session.config)
        if dcfg is None:
            raise InvalidInput(f"--spec: bundle {bundle.root.name} was built without speculative decoding; drop "
                               "--spec or build a recipe with a speculative: section")
        proposer = Eagle3Proposer(session.stepper, dcfg, bundle.weights)
    if opts.di:
        from neffbuild.serve.di import NixlSource

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
    from neffbuild.runtime import dp_sync
    from neffbuild.runtime.bundle import open_bundle
    from neffbuild.serve.engine import Engine
    from neffbuild.serve.greedy import prometheus
    from neffbuild.serve.requests import check_requests
    from neffbuild.serve.session import open_session

    bundle = open_bundle(bundle_path, group=group)  # a sharded bundle joins the world here (every rank opens it)
    check_bundle(bundle)
    hist = NeededSeqHistogram(bundle.grid.max_model_len)
    session = open_session(bundle, group=group, on_plan=lambda plan: hist.record(plan.needed_seq))
    check_requests(requests, session.config.vocab_size, bundle.grid.max_model_len, opts.source)
    for label in bundle.labels:  # load every artifact now: no decode step pays for loading
        bundle.artifact(label)
    source, proposer = _parts(bundle, session, opts, prefill)
    before = dp_sync.COLLECTIVES["count"]
    try:
        engine = Engine(session.stepper, session.block_manager(), source, proposer)
        engine.run(requests)
    finally:
        source.close()
    st = engine.stats
    out = {"requests": [dict(r.result(), index=r.index) for r in requests], "steps": st.steps,
           "collectives": dp_sync.COLLECTIVES["count"] - before, "step_seconds": st.step_seconds,
           "step_tokens": st.step_tokens, "run_seconds": st.run_seconds, "engine_seconds": st.engine_seconds,
           "source_seconds": st.source_seconds, "histogram": hist.rows(),
           "transfers": [dict(r.transfer, id=r.id) for r in requests if r.transfer is not None]}
    if proposer is not None:
        out.update(proposed=st.proposed, accepted=st.accepted, draft_calls=st.draft_calls,
                   acceptance_rate=round(st.acceptance_rate, 6))
    if opts.metrics:
        out["metrics"] = prometheus(st.plans) + hist.to_prometheus()
    return out
