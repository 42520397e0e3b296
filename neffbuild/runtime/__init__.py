"""neffbuild's thin serving runtime: open a bundle, run decode steps over engine-owned block tables.

    from neffbuild.runtime import open_bundle, Stepper, StepBatch
    step = Stepper(open_bundle("artifacts/gpt-oss-tiny-0.1.0"))
    out = step.step(StepBatch(tokens=[[tok]], num_computed=[n], block_tables={"full": rows, "sliding": swa_rows}))

Imports only the standard library, torch and safetensors (nixl lazily) and the base modules
(errors, fsutil). Names resolve lazily, so ``neffbuild.runtime.step.buckets`` (imported by the recipe
validator and the grid) stays torch-free.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "open_bundle": "bundle.reader", "Bundle": "bundle.reader",
    "Stepper": "step.stepper", "StepBatch": "step.stepper", "StepOutput": "step.stepper", "Artifacts": "step.stepper",
    "StepPlan": "step.dispatch", "Grid": "step.dispatch", "plan_step": "step.dispatch", "label": "step.dispatch",
    "BlockManager": "kv.blocks", "KVGroup": "kv.blocks", "kv_groups": "kv.blocks", "blocks_needed": "kv.blocks",
    "min_pool_blocks": "kv.blocks", "FULL_GROUP": "kv.blocks", "SLIDING_GROUP": "kv.blocks", "NULL_BLOCK": "kv.blocks",
    "KVLayout": "kv.layout", "allocate": "kv.cache",
    "KVIngest": "di.ingest", "KVProducer": "di.ingest", "KVRegions": "di.regions", "register_regions": "di.regions",
    "head_segments": "di.regions",
    "DIPrompt": "di.prompt", "di_prompt": "di.prompt",
}
_ERRORS = ("NeffbuildError", "ShapeNotCovered", "BundleError", "IncompatibleBundle", "KVPoolExhausted",
           "StepInputError", "KVTransferError", "NixlUnavailable", "KVLayoutMismatch", "PrefillWorkerLost")

__all__ = [  # noqa: RUF022 - grouped as above: runtime names, then errors
    "open_bundle", "Bundle", "Stepper", "StepBatch", "StepOutput", "Artifacts", "StepPlan", "Grid",
    "plan_step", "label", "BlockManager", "KVGroup", "kv_groups", "blocks_needed", "min_pool_blocks", "FULL_GROUP",
    "SLIDING_GROUP", "NULL_BLOCK", "KVLayout", "allocate",
    "KVIngest", "KVProducer", "KVRegions", "register_regions", "head_segments", "DIPrompt", "di_prompt",
    "NeffbuildError", "ShapeNotCovered", "BundleError", "IncompatibleBundle", "KVPoolExhausted", "StepInputError",
    "KVTransferError", "NixlUnavailable", "KVLayoutMismatch", "PrefillWorkerLost",
]
assert set(__all__) == set(_EXPORTS) | set(_ERRORS)


def __getattr__(name: str):
    if name in _ERRORS:
        return getattr(importlib.import_module("neffbuild.errors"), name)
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"neffbuild.runtime.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'neffbuild.runtime' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
