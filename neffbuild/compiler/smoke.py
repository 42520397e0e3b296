"""Smoke run: bind a compiled artifact to the bundle's weights and run one step on zeroed inputs.

The builder runs it for every target before it publishes a bundle, so a bundle never holds
an artifact that cannot load or run (missing constants, a foreign or truncated file, a
crash in the generated code). A failure is a ``load_error`` of that target.

The KV caches are allocated but not zeroed, except block 0 (the null block every pad row
reads), so a pool of many GB costs only the pages the step touches.
"""

from __future__ import annotations

from pathlib import Path

import torch

from neffbuild.compiler.graphs import DRAFT, TargetGraph, example_inputs
from neffbuild.errors import BuildFailed


class LoadFailed(BuildFailed):
    """A compiled artifact failed to load, bind the bundle's weights, or run one step."""


def _inputs(spec: TargetGraph) -> tuple:
    if spec.family == DRAFT:  # the draft's own KV group (one layer): zeroed in full
        return example_inputs(spec)
    args = list(example_inputs(spec, caches=False))
    layout = spec.kv_layout()
    kv = tuple(torch.empty(layout.buffer_shape, dtype=layout.graph_dtype) for _ in range(layout.num_buffers))
    for cache in kv:
        cache[:, 0].zero_()
    args[7] = kv  # the KV caches' place (a sharded graph's rank input follows them)
    return tuple(args)


def smoke_run(backend, artifact: Path, spec: TargetGraph, weights: dict[str, torch.Tensor]) -> None:
    """Raise LoadFailed unless the artifact loads with ``weights`` and returns finite logits of the right shape."""
    try:
        runner = backend.load(Path(artifact), weights)
        with torch.no_grad():
            out = runner(*_inputs(spec))
    except Exception as exc:  # any failure here means the bundle would not serve
        raise LoadFailed(f"{type(exc).__name__}: {exc}".strip()) from exc
    logits = out[0] if isinstance(out, (tuple, list)) else out
    if spec.family == DRAFT:  # k proposed token ids per row
        if logits.shape[0] != spec.batch:
            raise LoadFailed(f"one draft step returned shape {tuple(logits.shape)}, expected {spec.batch} rows")
        return
    want = (spec.batch, spec.query_len, spec.config.vocab_size)
    if tuple(logits.shape) != want:
        raise LoadFailed(f"one step returned logits of shape {tuple(logits.shape)}, expected {want}")
    if not torch.isfinite(logits).all():
        raise LoadFailed("one step on zeroed inputs returned non-finite logits")
