"""Decode step time of four variants on one request, side by side in one run.

For each context (1/32, 1/8, 1/2 and all of ``max_model_len``) one request with that many
tokens needed runs through: the **bucketed** artifact the runtime picks, the **fallback**
artifact (``ctx = max_model_len``), one **dynamic**-width artifact (compiled here with a
``torch.export`` dynamic block-table width, called with exactly the blocks needed) and
**eager** PyTorch (the same module, uncompiled, on the bucketed inputs). Calls are
interleaved (one of each variant per round) so drift on a shared host hits all alike.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from neffbuild import memory, registry
from neffbuild.compiler.graphs import TargetGraph, build_graph, target_graph_from
from neffbuild.runtime.bundle.reader import load_aoti
from neffbuild.runtime.kv.cache import allocate
from neffbuild.runtime.parallel import ParallelLayout
from neffbuild.runtime.step import attn_metadata
from neffbuild.runtime.step.buckets import round_up
from neffbuild.runtime.step.dispatch import DECODE, plan_for

VARIANTS = ("bucketed", "fallback", "dynamic", "eager")


def graph_spec(bundle, *, batch: int, ctx: int) -> TargetGraph:
    """The bundle's decode graph at (batch, ctx), from its GraphInputs (an unsharded graph: one process), in the
    form of the weights it stores (bfloat16, MXFP4 experts): the variants compiled here bind those weights."""
    gi, one = bundle.graph_inputs, ParallelLayout()
    kv = memory.kv_layout(gi.config(), gi.draft(gi.config()), gi.num_blocks, gi.block_size, gi.fp8_packed_kv, one,
                          gi.kv_layout.kv_dtype)
    graph = target_graph_from(dataclasses.replace(gi, parallel=one, kv_layout=kv), DECODE, batch, ctx, 1)
    return dataclasses.replace(graph, **stored_form(bundle))


def stored_form(bundle) -> dict:
    """``weights_dtype`` and ``experts`` of the bundle's stored weights: the experts' form from the stored names
    (the architecture's rule), the dtype that holds most of the floating-point elements."""
    weights = bundle.weights
    experts = registry.arch(bundle.graph_inputs.arch).get("experts_of")(weights)
    elements = Counter()
    for t in weights.values():
        if t.is_floating_point():
            elements[t.dtype] += t.numel()
    dtype = str(elements.most_common(1)[0][0]).removeprefix("torch.") if elements else "float32"
    return {"weights_dtype": dtype, "experts": experts}


def contexts(max_model_len: int) -> list[int]:
    return [max_model_len // 32, max_model_len // 8, max_model_len // 2, max_model_len]


def compile_graph(bundle, *, batch: int, ctx: int, dynamic: bool, workdir: Path):
    """(seconds, loaded artifact) for the decode graph at (batch, ctx); a dynamic table width if asked."""
    backend = registry.backend(bundle.facts.backend).get("compile_side")()  # the bundle's

    module, inputs = build_graph(graph_spec(bundle, batch=batch, ctx=ctx))
    t0 = time.perf_counter()
    if dynamic:
        width = torch.export.Dim("blocks", min=2, max=ctx // bundle.kv_layout.block_size)
        shapes = (None, None, {1: width}, None, None, None, None, tuple(None for _ in inputs[7]))
        with torch.no_grad():
            exported = torch.export.export(module, inputs, dynamic_shapes=shapes, strict=False)
    else:
        exported = backend.export(module, inputs)
    path = backend.compile(exported, workdir)
    return time.perf_counter() - t0, load_aoti(path, bundle.weights)


@dataclass
class Case:
    """One request at one context: the inputs each variant runs on."""

    context: int
    plan: object
    inputs: dict = field(default_factory=dict)  # variant -> StepInputs
    samples: dict = field(default_factory=dict)  # variant -> [seconds]


def make_case(bundle, context: int, batch: int) -> Case:
    bs, mml = bundle.kv_layout.block_size, bundle.grid.max_model_len
    row = torch.arange(1, 1 + mml // bs)[None]  # the request's blocks (block 0 is the null block)
    computed, tokens = torch.tensor([context - 1]), torch.tensor([[1]])
    plan = plan_for(bundle.grid, batch_count=1, needed=context, num_reqs=1)
    case = Case(context, plan)
    for variant, ctx in (("bucketed", plan.ctx), ("fallback", mml), ("dynamic", round_up(context, bs)),
                         ("eager", plan.ctx)):
        case.inputs[variant] = attn_metadata.build(tokens, computed, row, row, batch=plan.batch, ctx=ctx,
                                                   block_size=bs, num_swa=bundle.num_swa)
    return case


def _stats(samples: list[float]) -> dict:
    s = sorted(samples)
    return {"median_ms": round(statistics.median(s) * 1e3, 4), "p90_ms": round(s[int(0.9 * (len(s) - 1))] * 1e3, 4),
            "n": len(s)}


def step_times(bundle, *, repeat: int = 20, warmup: int = 2, dynamic: bool = True, eager: bool = True,
               extra_contexts: tuple[int, ...] = (), workdir: Path | None = None) -> dict:
    """{"rows": [{context, label, variant -> stats}], "dynamic_compile_s": float|None}."""
    mml = bundle.grid.max_model_len
    batch = min(bundle.grid.num_seqs_buckets)
    cases = [make_case(bundle, c, batch) for c in sorted(set(contexts(mml)) | set(extra_contexts))]
    fallback = next(p.label for p in (c.plan for c in cases) if p.ctx == mml)
    runners = {"bucketed": None, "fallback": bundle.artifact(fallback)}
    out = {"dynamic_compile_s": None, "batch": batch}
    if dynamic:
        with tempfile.TemporaryDirectory(dir=workdir) as tmp:
            out["dynamic_compile_s"], runners["dynamic"] = compile_graph(bundle, batch=batch, ctx=mml, dynamic=True,
                                                                        workdir=Path(tmp))
    if eager:
        cfg = graph_spec(bundle, batch=batch, ctx=mml).config
        decode = registry.arch_of(cfg).get("decode")
        runners["eager"] = decode(cfg, bundle.weights, packed_k=bundle.kv_layout.packed_k).eval()
    kv = allocate(bundle.kv_layout)
    for case in cases:
        per_case = dict(runners, bucketed=bundle.artifact(case.plan.label))
        for rnd in range(warmup + repeat):
            for variant, fn in per_case.items():
                args = case.inputs[variant].as_args(kv)
                with torch.no_grad():
                    t0 = time.perf_counter()
                    fn(*args)
                    dt = time.perf_counter() - t0
                if rnd >= warmup:
                    case.samples.setdefault(variant, []).append(dt)
    out["rows"] = [{"context": c.context, "label": c.plan.label, "ctx_bucket": c.plan.ctx,
                    **{v: _stats(s) for v, s in c.samples.items()}} for c in cases]
    return out
