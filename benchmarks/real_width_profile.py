"""Where a bundle's decode step spends its time at real width: the compiled step beside its pieces.

    /work/heavy .venv/bin/python benchmarks/real_width_profile.py BUNDLE [--batches 1,4] [--context 500]
        [--repeat 5] [--out DIR]

One thread. For each batch: the compiled step (the bundle's artifact, median of ``--repeat``);
the eager reference step on the same weights under ``torch.profiler`` (per-op self time: which
matmul, which expert op); and the step's pieces timed alone on the bundle's own tensors, run as
the compiled CPU step runs them (runtime/native.py's ops): the unembedding over the whole
vocabulary (and, beside it, as oneDNN's matmul), one layer's MoE (router, top-k, the picked
experts' product), one layer's attention projections. With the bytes each piece reads, GB/s per
piece says which one is off the memory roofline. Prints markdown; ``--out`` keeps the profiler
tables.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _median(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def step_args(bundle, b: int, context: int, kv):
    from neffbuild.runtime.step import attn_metadata
    from neffbuild.runtime.step.dispatch import plan_for

    plan = plan_for(bundle.grid, batch_count=b, needed=context + 1, num_reqs=b)
    bs = bundle.kv_layout.block_size
    per = -(-plan.ctx // bs)
    rows = torch.stack([torch.arange(1 + r * per, 1 + (r + 1) * per) for r in range(b)])
    inputs = attn_metadata.build(torch.ones(b, 1, dtype=torch.long), torch.full((b,), context), rows, rows,
                                 batch=b, ctx=plan.ctx, block_size=bs, num_swa=bundle.num_swa)
    return plan, inputs.as_args(kv)


def pieces(bundle, cfg, b: int, repeat: int) -> list[tuple[str, float, int]]:
    """(piece, seconds, bytes read) of one step's parts, run as the compiled CPU step runs them (the native ops of
    runtime/native.py on: ``native_cpu_ops``), beside the unembedding as a plain matmul (oneDNN)."""
    from neffbuild.kernels import moe, rms_norm
    from neffbuild.kernels.moe import native_cpu_ops
    from neffbuild.models.gpt_oss.decode import expert_weights, linear, unembed

    w = bundle.weights
    x = torch.randn(b, cfg.hidden_size).to(w["lm_head"].dtype)
    attn = torch.randn(b, cfg.num_attention_heads * cfg.head_dim).to(x.dtype)

    def size(t):
        return t.numel() * t.element_size()

    gate_up, down = expert_weights(w, "gate_up_w", 0), expert_weights(w, "down_w", 0)
    routed = min(b * cfg.num_experts_per_tok, cfg.num_local_experts) / cfg.num_local_experts
    expert_bytes = int(sum(size(w[n][0]) for n in w if n.startswith(("gate_up_w", "down_w"))) * routed)
    head, projections = size(w["lm_head"]), size(w["qkv_w"][0]) + size(w["o_w"][0])

    def native(fn):
        def run():
            with native_cpu_ops():
                return fn()
        return run

    parts = [
        ("unembedding, the step's op (bf16_linear)", native(lambda: unembed(cfg, w, x[:, None])), head),
        ("unembedding, oneDNN matmul", lambda: (rms_norm(x, w["norm"], cfg.rms_norm_eps) @ w["lm_head"].t()).float(),
         head),
        ("one layer's MoE, the step's ops (mxfp4_dot)",
         native(lambda: moe(x, w["router_w"][0], w["router_b"][0], gate_up, w["gate_up_b"][0], down, w["down_b"][0],
                            cfg.num_experts_per_tok, cfg.swiglu_alpha, cfg.swiglu_limit)), expert_bytes),
        ("one layer's qkv + o projections, the step's op",
         native(lambda: (linear(x, w["qkv_w"][0]), linear(attn, w["o_w"][0]))), projections),
    ]
    with torch.no_grad():
        return [(name, _median(fn, repeat), size) for name, fn, size in parts]


def main() -> None:
    from neffbuild.models.gpt_oss.config import GptOssConfig
    from neffbuild.runtime.bundle.reader import open_bundle
    from neffbuild.runtime.kv.cache import allocate
    from neffbuild.serve.rank import eager_artifacts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    ap.add_argument("--context", type=int, default=500)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--compiled-only", action="store_true", help="the compiled step and the pieces, no eager step")
    a = ap.parse_args()
    torch.set_num_threads(1)
    bundle = open_bundle(a.bundle, preload=True)
    cfg = GptOssConfig.from_hf_dict(bundle.graph_inputs.model_config)
    eager = eager_artifacts(cfg, bundle.weights, bundle.grid, bundle.kv_layout, bundle.num_swa)
    kv = allocate(bundle.kv_layout)
    for buffer in kv:
        buffer.normal_()
    print(f"{a.bundle.name}: {cfg.num_hidden_layers} layers, context {a.context}, one thread\n")
    print("| batch | piece | time | bytes | GB/s |\n|---|---|---|---|---|")
    tables = []
    for b in a.batches:
        plan, args = step_args(bundle, b, a.context, kv)
        with torch.no_grad():
            fn, ref = bundle.artifact(plan.label), eager.artifact(plan.label)
            compiled = _median(lambda fn=fn, args=args: fn(*args), a.repeat)
        print(f"| {b} | whole step, compiled ({plan.label}) | {compiled * 1e3:.1f} ms | | |")
        if not a.compiled_only:
            with torch.no_grad():
                reference = _median(lambda ref=ref, args=args: ref(*args), a.repeat)
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                            record_shapes=True) as prof:
                    ref(*args)
            tables.append(f"batch {b}, eager reference step, by op and input shapes:\n" + prof.key_averages(
                group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=15,
                                                 max_name_column_width=40))
            print(f"| {b} | whole step, eager reference | {reference * 1e3:.1f} ms | | |")
        for name, secs, nbytes in pieces(bundle, cfg, b, a.repeat):
            print(f"| {b} | {name} | {secs * 1e3:.1f} ms | {nbytes / 1e9:.3f} GB | {nbytes / secs / 1e9:.1f} |")
    print()
    for t in tables:
        print(t)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "profile.txt").write_text("\n\n".join(tables))


if __name__ == "__main__":
    main()
