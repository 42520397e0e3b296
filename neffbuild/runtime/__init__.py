"""neffbuild's thin serving runtime: open a bundle, run decode steps over engine-owned block tables.

    from neffbuild.runtime import open_bundle, Stepper, StepBatch
    step = Stepper(open_bundle("artifacts/gpt-oss-tiny-0.1.0"))
    out = step.step(StepBatch(tokens=[[tok]], num_computed=[n], block_tables={"full": rows, "sliding": swa_rows}))

Four rooms, each a package with its own docstring: ``bundle/`` (open and verify a bundle, load
its artifacts), ``step/`` (the per-step API), ``kv/`` (KV buffers, blocks and their tables),
``di/`` (disaggregated inference: KV moved over NIXL); ``parallel.py`` and ``world.py`` (the
tp/dp/ep layout and a rank's process groups) serve them all, and ``native.py`` registers the native
ops compiled CPU graphs call (packed experts, the bf16 LM head: ``native_cpu.c``, built on the host). This
module exports what serving code calls (docs/architecture.md lists it); everything else is imported from its room.

Imports only the standard library, torch and safetensors (nixl lazily) and the base modules
(errors, fsutil, registry). Names resolve lazily, so ``neffbuild.runtime.step.buckets``
(imported by the recipe validator and the grid) stays torch-free.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "open_bundle": "bundle.reader", "Bundle": "bundle.reader",
    "Stepper": "step.stepper", "StepBatch": "step.stepper", "StepOutput": "step.stepper", "Artifacts": "step.stepper",
    "StepPlan": "step.dispatch", "Grid": "step.dispatch",
    "BlockManager": "kv.blocks", "kv_groups": "kv.blocks", "blocks_needed": "kv.blocks", "FULL_GROUP": "kv.blocks",
    "SLIDING_GROUP": "kv.blocks", "KVLayout": "kv.layout",
    "KVIngest": "di.ingest", "KVProducer": "di.ingest",
}
_ERRORS = ("BundleError", "ShapeNotCovered", "StepInputError", "KVPoolExhausted")

__all__ = [  # noqa: RUF022 - grouped as above: runtime names, then errors
    "open_bundle", "Bundle", "Stepper", "StepBatch", "StepOutput", "Artifacts", "StepPlan", "Grid",
    "BlockManager", "kv_groups", "blocks_needed", "FULL_GROUP", "SLIDING_GROUP", "KVLayout", "KVIngest", "KVProducer",
    "BundleError", "ShapeNotCovered", "StepInputError", "KVPoolExhausted",
]
assert set(__all__) == set(_EXPORTS) | set(_ERRORS) and len(__all__) <= 20


def __getattr__(name: str):
    if name in _ERRORS:
        return getattr(importlib.import_module("neffbuild.errors"), name)
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"neffbuild.runtime.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'neffbuild.runtime' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
