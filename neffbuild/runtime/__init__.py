"""neffbuild's thin serving runtime: the library a host engine drives (vLLM through neffbuild's plugin, or
neffbuild's own engine), opening a bundle onto the host's world and running decode steps over its tables.

    from neffbuild.runtime import open_bundle, Stepper, StepBatch
    bundle = open_bundle("artifacts/gpt-oss-tiny-0.1.0")          # the one judge of validity; bundle.facts
    step = Stepper(bundle, kv_caches=engine_buffers, group=engine_dp_group)
    out = step.step(StepBatch(tokens=[[tok]], num_computed=[n], block_tables={"full": rows, "sliding": swa_rows}))
    step.idle()                                                    # an idle DP rank's step, same collective

What a host engine calls is exported here (at most 20 names, docs/architecture.md "How a host engine drives
the runtime"): opening (``open_bundle``, ``Bundle``, ``BundleFacts``, ``HostGroups``), the step (``Stepper``,
``StepBatch``, ``StepOutput``, ``StepPlan``, ``Grid``, ``Artifacts``), KV in the bundle layout (``KVLayout``,
the group names, ``kv_access``: writes, reads and packed-FP8 decode), transfer regions (``regions_for``), the
needed_seq histogram, and the errors a step raises. Conveniences for engines without their own (the block
manager, neffbuild's own KV transfer) are imported from their rooms: ``runtime.kv.blocks``, ``runtime.di``.

Four rooms, each a package with its own docstring: ``bundle/`` (open and judge a bundle, its facts, load
its artifacts), ``step/`` (the per-step API), ``kv/`` (KV buffers, blocks, tables and the layout's access),
``di/`` (disaggregated inference: KV moved over NIXL); ``parallel.py`` and ``world.py`` (the tp/dp/ep layout
and a rank's process groups, made here or the host's) serve them all, and ``native.py`` registers the native
ops compiled CPU graphs call (packed experts, the bf16 linears: ``native_cpu.c``, built on the host).

Imports only the standard library, torch and safetensors (nixl lazily) and the base modules
(errors, fsutil, registry). Names resolve lazily, so ``neffbuild.runtime.step.buckets``
(imported by the recipe validator and the grid) stays torch-free.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "open_bundle": "bundle.reader", "Bundle": "bundle.reader", "BundleFacts": "bundle.facts", "HostGroups": "world",
    "Stepper": "step.stepper", "StepBatch": "step.stepper", "StepOutput": "step.stepper", "Artifacts": "step.stepper",
    "StepPlan": "step.dispatch", "Grid": "step.dispatch", "NeededSeqHistogram": "step.histogram",
    "FULL_GROUP": "kv.blocks", "SLIDING_GROUP": "kv.blocks", "KVLayout": "kv.layout", "regions_for": "di.regions",
}
_MODULES = {"kv_access": "kv.access"}  # a room's module exported whole: the bundle layout's KV functions
_ERRORS = ("BundleError", "IncompatibleBundle", "ShapeNotCovered", "StepInputError")

__all__ = [  # noqa: RUF022 - grouped as above: runtime names, then errors
    "open_bundle", "Bundle", "BundleFacts", "HostGroups", "Stepper", "StepBatch", "StepOutput", "Artifacts",
    "StepPlan", "Grid", "NeededSeqHistogram", "FULL_GROUP", "SLIDING_GROUP", "KVLayout", "regions_for", "kv_access",
    "BundleError", "IncompatibleBundle", "ShapeNotCovered", "StepInputError",
]
assert set(__all__) == set(_EXPORTS) | set(_MODULES) | set(_ERRORS) and len(__all__) <= 20


def __getattr__(name: str):
    if name in _ERRORS:
        return getattr(importlib.import_module("neffbuild.errors"), name)
    if name in _MODULES:
        return importlib.import_module(f"neffbuild.runtime.{_MODULES[name]}")
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"neffbuild.runtime.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'neffbuild.runtime' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
