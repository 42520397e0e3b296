"""One ``neffbuild bench`` run: every measurement on one bundle, in one process (plus probes)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

from neffbuild.bench import bytes as B
from neffbuild.bench import overhead, steps


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{torch.get_num_threads()} torch thread(s) on {os.cpu_count()} cores ({cpu}), torch {torch.__version__}"


def run(bundle_path: str | Path, *, repeat: int = 20, dynamic: bool = True, eager: bool = True,
        startup: bool = True, dp: bool = True, extra_contexts: tuple[int, ...] = (),
        progress=lambda msg: None) -> dict:
    from neffbuild.runtime.bundle.reader import open_bundle

    bundle = open_bundle(bundle_path)
    cfg = steps.graph_spec(bundle, batch=1, ctx=bundle.grid.max_model_len).config
    progress("copy bandwidth")
    bandwidth = B.copy_bandwidth()
    progress("step times" + (" (compiling the dynamic-width artifact first)" if dynamic else ""))
    result = {"bundle": str(bundle_path), "machine": machine(), "copy_bandwidth_gbs": round(bandwidth / 1e9, 2),
              "steps": steps.step_times(bundle, repeat=repeat, dynamic=dynamic, eager=eager,
                                               extra_contexts=extra_contexts),
              "num_blocks": bundle.kv_layout.num_blocks, "max_model_len": bundle.grid.max_model_len}
    batch = result["steps"]["batch"]
    weights = B.weight_bytes(bundle.weights, cfg, tokens=batch)
    for row in result["steps"]["rows"]:
        ctxs = {"bucketed": row["ctx_bucket"], "fallback": bundle.grid.max_model_len,
                "dynamic": -(-row["context"] // bundle.kv_layout.block_size) * bundle.kv_layout.block_size}
        row["bytes"] = {v: weights + B.kv_bytes(cfg, bundle.kv_layout, batch=batch, ctx=c, num_swa=bundle.num_swa)
                        for v, c in ctxs.items()}
        row["bound_ms"] = round(row["bytes"]["bucketed"] / bandwidth * 1e3, 4)
        row["fraction_of_bound"] = round(row["bound_ms"] / row["bucketed"]["median_ms"], 4)
    context = result["steps"]["rows"][0]["context"]
    progress("plan + metadata")
    result["plan"] = overhead.plan_and_metadata(bundle, context)
    if startup:
        progress("cold start vs compile at start-up")
        result["startup"] = overhead.cold_start(str(bundle_path), context)
    if dp:
        progress("DP sync vs bare gloo all-reduce")
        result["dp"] = overhead.dp_sync_cost()
    return result
